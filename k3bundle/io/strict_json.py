"""The one strict JSON reader: every JSON document k3bundle reads from a file passes through it.

Python's ``json`` accepts two things JSON does not: an object that names a key twice (the last
value silently wins, so a file can say one thing to the person who reads it and another to
k3bundle) and the constants ``NaN``, ``Infinity`` and ``-Infinity``. ``loads`` refuses both and
says where they are; ``read_json`` reads a file (a regular file only: a FIFO would hang the read)
and, for k3bundle's own versioned files, checks ``kind`` and ``schema_version``. Every refusal is
one ``JsonFileError`` naming the file. A package whose callers expect its own error type maps it
(``raise BundleError(str(e)) from None``); the checks themselves live only here.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from k3bundle.errors import JsonFileError
from k3bundle.io.files import open_regular


class _Duplicated(dict):
    """An object that named ``key`` twice, kept until the walk finds where it sits."""

    key: str


class _NonFinite(float):
    """NaN or ±Infinity, with the token the file spelled it with."""

    token: str


def dotted(at: tuple) -> str:
    """A place in a document as a dotted path: ``text_config.linear_attn_config.num_heads``."""
    return ".".join(str(k) for k in at)


def _flaw(value: Any, at: tuple) -> tuple[tuple, Any] | None:
    """(where, what) of the first duplicated key or non-finite number under ``value``, in document order."""
    if isinstance(value, _Duplicated) or (isinstance(value, float) and not math.isfinite(value)):
        return at, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        hit = _flaw(v, at + (k,))
        if hit:
            return hit
    return None


def _problem(at: tuple, flaw: Any) -> str:
    if isinstance(flaw, _Duplicated):
        return f"duplicate key {flaw.key!r}" + (f" in {dotted(at)}" if at else "")
    return f"{dotted(at) or 'the document'} must be a finite number, got {getattr(flaw, 'token', flaw)}"


def nonfinite_problem(value: Any) -> str | None:
    """Where the first NaN or ±Infinity under ``value`` is, as an error's text (None: every number is
    finite). For documents that come from elsewhere than JSON text, such as YAML's ``.nan``."""
    hit = _flaw(value, ())
    return _problem(*hit) if hit else None


def nonfinite_as_text(value: Any) -> Any:
    """``value`` with every NaN or ±Infinity under it replaced by the text "nan", "inf" or "-inf": what
    a writer hands ``json.dumps`` (which would write the constants) so that a report holding a failed
    run's numbers stays JSON that ``loads`` reads. Tuples become lists, as ``json.dumps`` writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: nonfinite_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nonfinite_as_text(v) for v in value]
    return value


def loads(data: str | bytes, where: str) -> Any:
    """The JSON document in ``data`` (UTF-8 if bytes), refusing duplicate keys and NaN/Infinity.

    Args:
        data (`str | bytes`): the JSON text.
        where (`str`): the file it came from, for the error.

    Returns:
        The document. Raises ``JsonFileError`` naming ``where`` and the place of the problem.
    """
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonFileError(where, f"not valid UTF-8 at byte {e.start}") from None
    flawed: list[bool] = []

    def obj(pairs: list) -> dict:
        d = dict(pairs)
        if len(d) == len(pairs):
            return d
        flawed.append(True)
        seen: set = set()
        dup = _Duplicated(d)
        dup.key = next(k for k, _ in pairs if k in seen or seen.add(k))
        return dup

    def constant(token: str) -> float:
        flawed.append(True)
        f = _NonFinite(token)
        f.token = token
        return f

    try:
        doc = json.loads(data, object_pairs_hook=obj, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise JsonFileError(where, f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise JsonFileError(where, "not valid JSON: nested too deeply") from None
    if flawed:  # only then walk the document to say where: a clean one costs nothing more
        at, flaw = _flaw(doc, ())
        raise JsonFileError(where, _problem(at, flaw), key=getattr(flaw, "key", None), at=at)
    return doc


def check_version(doc: Any, where: str, kind: str | None = None, version: int | None = None) -> dict:
    """``doc`` if it is an object of ``kind`` (when given) and ``schema_version`` ``version`` (when given)."""
    what = f"a {kind} file" if kind else "a k3bundle file"
    if not isinstance(doc, dict):
        raise JsonFileError(where, f"not {what}: the top level is not a JSON object", cause="version")
    if kind is not None and doc.get("kind") != kind:
        raise JsonFileError(where, f"not {what} (kind {doc.get('kind')!r})", cause="version")
    if version is not None and doc.get("schema_version") != version:
        raise JsonFileError(where, f"schema_version {doc.get('schema_version')!r}, this k3bundle reads {version}",
                            cause="version")
    return doc


def read_json(path: str | os.PathLike, *, kind: str | None = None, version: int | None = None) -> Any:
    """The JSON document in the file ``path``, read strictly (``loads``); with ``kind`` or
    ``version``, a k3bundle file checked for them (``check_version``).

    Example:
        >>> read_json("bundle/manifest.json", kind="k3bundle.manifest", version=1)  # doctest: +SKIP
    """
    name = os.fspath(path)
    try:
        with os.fdopen(open_regular(name), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise JsonFileError(name, "no such file", cause="missing") from None
    except OSError as e:
        raise JsonFileError(name, f"cannot read: {e.strerror or e}", cause="unreadable") from None
    doc = loads(data, name)
    return check_version(doc, name, kind, version) if kind is not None or version is not None else doc


__all__ = ["check_version", "dotted", "loads", "nonfinite_as_text", "nonfinite_problem", "read_json"]
