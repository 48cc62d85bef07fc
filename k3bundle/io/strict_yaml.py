"""The one strict YAML reader: every YAML data file a user hands k3bundle passes through it
(golden cases, layouts, tolerance files).

YAML as PyYAML reads it is more than data: a key given twice silently keeps its last value (a
second ``added:`` section appended to a tolerance file would replace the first and loosen the
gate), an anchor may be referenced so often that a 550-byte file expands to gigabytes (an alias
bomb), tags build values of types the file's reader does not expect, and ``.nan`` or ``.inf`` are
numbers every comparison with which is false. ``read_yaml`` refuses all of these, and a file
that is not a regular file (a FIFO would hang the read), is larger than ``MAX_BYTES`` or is not
UTF-8. Every refusal is one ``YamlFileError`` naming the file and the key; a package whose callers
expect its own error type maps it (``raise CaseError(str(e)) from None``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import yaml

from k3bundle.errors import YamlFileError
from k3bundle.io.files import open_regular

#: a data file larger than this is refused before it is parsed (the largest shipped is ~20 KB)
MAX_BYTES = 4 << 20
#: aliases (``*name``) a document may hold; k3bundle's own data files use none
MAX_ALIASES = 16
#: nodes of the document with every alias expanded: an alias bomb's size, found before it is built
MAX_NODES = 100_000
#: the non-specific tag ``!`` only says "a string"; any other explicit tag is refused
_PLAIN_TAGS = (None, "!")


def _dotted(at: tuple) -> str:
    return ".".join(str(k) for k in at) or "the document"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, remembering the nodes written with a tag."""

    def __init__(self, text: str):
        super().__init__(text)
        self.tagged: dict[int, str] = {}

    def compose_node(self, parent, index):
        event = self.peek_event()
        node = super().compose_node(parent, index)
        tag = getattr(event, "tag", None)
        if not isinstance(event, yaml.AliasEvent) and tag not in _PLAIN_TAGS:
            self.tagged[id(node)] = tag
        return node


class _Refused(Exception):
    def __init__(self, problem: str, key: str | None = None):
        super().__init__(problem)
        self.problem, self.key = problem, key


class _Walk:
    """One pass over a composed document: refuses tags, duplicate or non-scalar keys, merge keys
    and aliases beyond the budget, and sizes the document with every alias expanded. Composed YAML
    shares an anchored node among its aliases, so meeting a node again is meeting an alias."""

    def __init__(self, tagged: dict[int, str]):
        self.tagged = tagged
        self.sizes: dict[int, int | None] = {}  # expanded size of each node met; None while inside it
        self.aliases = 0

    def size(self, node, at: tuple) -> int:
        if id(node) in self.sizes:
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Refused(f"{_dotted(at)}: more than {MAX_ALIASES} aliases in the file (an alias bomb?): "
                               "a data file is written out, not built from anchors", _dotted(at))
            if self.sizes[id(node)] is None:
                raise _Refused(f"{_dotted(at)}: an alias of a value that contains it (a recursive alias)",
                               _dotted(at))
            return self.sizes[id(node)]
        self.sizes[id(node)] = None
        if id(node) in self.tagged:
            tag = self.tagged[id(node)].replace("tag:yaml.org,2002:", "!!")
            raise _Refused(f"{_dotted(at)}: the tag {tag} is not allowed in a data file", _dotted(at))
        size = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) and id(key) not in self.tagged else None
                if name is None:
                    raise _Refused(f"{_dotted(at)}: a key must be plain text (line {key.start_mark.line + 1})",
                                   _dotted(at))
                if key.tag == "tag:yaml.org,2002:merge":
                    raise _Refused(f"{_dotted(at + (name,))}: merge keys ('<<') are not allowed in a data file",
                                   _dotted(at + (name,)))
                if name in seen:
                    raise _Refused(f"duplicate key {_dotted(at + (name,))} (lines {seen[name]} and "
                                   f"{key.start_mark.line + 1}): YAML would keep only the last",
                                   _dotted(at + (name,)))
                seen[name] = key.start_mark.line + 1
                size += 1 + self.size(value, at + (name,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                size += self.size(item, at + (i,))
        if size > MAX_NODES:
            raise _Refused(f"{_dotted(at)}: expands to more than {MAX_NODES:,} values (an alias bomb?)",
                           _dotted(at))
        self.sizes[id(node)] = size
        return size


def _nonfinite(value: Any, at: tuple) -> tuple | None:
    if isinstance(value, float) and not math.isfinite(value):
        return at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        hit = _nonfinite(v, at + (k,))
        if hit is not None:
            return hit
    return None


def loads_yaml(text: str, where: str) -> Any:
    """The data in YAML ``text`` (one document), refusing what ``read_yaml`` refuses."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _Walk(loader.tagged).size(node, ())
        doc = loader.construct_document(node)
        bad = _nonfinite(doc, ())
    except _Refused as e:
        raise YamlFileError(where, e.problem, key=e.key) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise YamlFileError(where, f"not valid YAML: {e.problem or e.context}{at}") from None
    except (yaml.YAMLError, RecursionError) as e:
        raise YamlFileError(where, f"not valid YAML: {str(e).splitlines()[0] if str(e) else 'nested too deeply'}") \
            from None
    finally:
        loader.dispose()
    if bad is not None:
        raise YamlFileError(where, f"{_dotted(bad)} must be a finite number", key=_dotted(bad))
    return doc


def read_yaml(path: str | os.PathLike) -> Any:
    """The data in the YAML file ``path``: a regular file of at most ``MAX_BYTES``, UTF-8, one
    document of plain mappings, lists and scalars (``loads_yaml``).

    Example:
        >>> read_yaml("tolerances/bf16.yaml")["added"]["default"]  # doctest: +SKIP
    """
    name = os.fspath(path)
    try:
        with os.fdopen(open_regular(name), "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise YamlFileError(name, "no such file") from None
    except OSError as e:
        raise YamlFileError(name, f"cannot read: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise YamlFileError(name, f"larger than {MAX_BYTES >> 20} MiB; a data file is a few kilobytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise YamlFileError(name, f"not UTF-8 (byte {e.start}, line {line})") from None
    return loads_yaml(text, name)


__all__ = ["MAX_ALIASES", "MAX_BYTES", "MAX_NODES", "loads_yaml", "read_yaml"]
