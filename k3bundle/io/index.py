"""``model.safetensors.index.json``: read, cross-check against the shards, write.

The index is ``{"metadata": {"total_size": <int>, ...}, "weight_map": {key: shard}}``.
``check_index`` reads every shard header (never the data) and collects every problem
before raising once, as gguf-py's ``index_tensors`` does ("Missing or incomplete model
files: [...]").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Union

from k3bundle.errors import JsonFileError, SafetensorsError
from k3bundle.file_names import SOURCE_INDEX as INDEX_NAME
from k3bundle.io.files import file_kind, relpath_problem, write_atomic
from k3bundle.io.reader import SafetensorsHeader, read_header
from k3bundle.io.strict_json import read_json

PathLike = Union[str, "os.PathLike[str]"]


#: How many problems ``check_index`` quotes in its one-line error.
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class SafetensorsIndex:
    """A validated index file."""

    path: str
    total_size: int
    weight_map: dict[str, str]
    metadata: dict

    @property
    def shards(self) -> list[str]:
        """Shard filenames named by ``weight_map``, sorted."""
        return sorted(set(self.weight_map.values()))


@dataclass(frozen=True)
class IndexCheck:
    """The result of a passing ``check_index``: the index and every shard header."""

    index: SafetensorsIndex
    headers: dict[str, SafetensorsHeader]


def _index_path(path: PathLike) -> str:
    name = os.fspath(path)
    return os.path.join(name, INDEX_NAME) if os.path.isdir(name) else name


def check_shard_name(name: object) -> str:
    """Why a shard filename is unsafe, or '' if it is a plain relative name.

    Args:
        name (`object`): the weight_map value.

    Returns:
        `str`: the reason, empty when the name is fine.
    """
    why = relpath_problem(name)
    if why:
        return why
    if "/" in name:
        return "contains a path separator"
    if ":" in name:
        return "is not a plain file name"
    return ""


def read_index(path: PathLike) -> SafetensorsIndex:
    """Read and validate an index file.

    Args:
        path (`str | os.PathLike`): the index file, or the directory holding
            ``model.safetensors.index.json``.

    Returns:
        `SafetensorsIndex`. Raises ``SafetensorsError`` naming the file and the bad entry.
    """
    name = _index_path(path)
    try:
        obj = read_json(name)
    except JsonFileError as e:
        if e.cause == "missing":
            raise SafetensorsError(f"{name}: index file not found") from None
        raise SafetensorsError(f"{name}: {e.problem}" if e.cause == "unreadable"
                               else f"{name}: not a valid JSON index: {e.problem}") from None
    if not isinstance(obj, dict):
        raise SafetensorsError(f"{name}: index is not a JSON object")
    metadata, weight_map = obj.get("metadata"), obj.get("weight_map")
    if not isinstance(metadata, dict):
        raise SafetensorsError(f"{name}: 'metadata' is missing or not an object")
    total = metadata.get("total_size")
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise SafetensorsError(f"{name}: metadata.total_size {total!r} is not a non-negative int")
    if not isinstance(weight_map, dict):
        raise SafetensorsError(f"{name}: 'weight_map' is missing or not an object")
    for key, shard in weight_map.items():
        why = check_shard_name(shard)
        if why:
            raise SafetensorsError(f"{name}: weight_map['{key}'] = {shard!r} {why}")
    return SafetensorsIndex(name, total, weight_map, metadata)


def _shard_problems(
    shard: str, header: SafetensorsHeader, index: SafetensorsIndex, expected: set[str]
) -> list[str]:
    problems = []
    for key in sorted(expected - header.tensors.keys()):
        problems.append(f"key '{key}' mapped to '{shard}' but not in it")
    for key in header.tensors:
        if key in expected:
            continue
        mapped = index.weight_map.get(key)
        if mapped is None:
            problems.append(f"key '{key}' in '{shard}' is missing from weight_map")
        else:
            problems.append(f"key '{key}' in '{shard}' but weight_map maps it to '{mapped}'")
    return problems


def check_index(directory: PathLike, *, index_name: str = INDEX_NAME) -> IndexCheck:
    """Cross-check an index against its shard headers; raise once with every problem.

    Checks: each shard exists and has a valid header; each weight_map key is in its shard;
    each key in a shard is in weight_map (and mapped to that shard); total_size equals the
    sum of the shards' tensor byte lengths.

    Args:
        directory (`str | os.PathLike`): the checkpoint directory.
        index_name (`str`, *optional*): index file name. Defaults to
            ``model.safetensors.index.json``.

    Returns:
        `IndexCheck`: the index and each shard's header, for reuse without re-reading.
        Raises ``SafetensorsError`` ("<index>: N problems with the shards: ...") listing the
        first few; the full list is on the exception's ``problems`` attribute.
    """
    root = os.fspath(directory)
    index = read_index(os.path.join(root, index_name))
    by_shard: dict[str, set[str]] = {}
    for key, shard in index.weight_map.items():
        by_shard.setdefault(shard, set()).add(key)
    problems: list[str] = []
    headers: dict[str, SafetensorsHeader] = {}
    for shard in sorted(by_shard):
        path = os.path.join(root, shard)
        if os.path.exists(path) and not os.path.isfile(path):
            problems.append(f"shard '{shard}' is {file_kind(os.stat(path).st_mode)}, not a regular file")
            continue
        if not os.path.isfile(path):
            problems.append(f"missing shard '{shard}' ({len(by_shard[shard])} keys)")
            continue
        try:
            headers[shard] = read_header(path)
        except SafetensorsError as e:
            problems.append(str(e))
            continue
        problems.extend(_shard_problems(shard, headers[shard], index, by_shard[shard]))
    if len(headers) == len(by_shard):
        total = sum(t.nbytes for h in headers.values() for t in h.tensors.values())
        if total != index.total_size:
            problems.append(
                f"metadata.total_size is {index.total_size} but the shards hold {total} "
                "tensor bytes"
            )
    if problems:
        shown = "; ".join(problems[:MAX_EXAMPLES])
        more = f"; and {len(problems) - MAX_EXAMPLES} more" if len(problems) > MAX_EXAMPLES else ""
        err = SafetensorsError(
            f"{index.path}: {len(problems)} problem(s) with the shards: [{shown}{more}]"
        )
        err.problems = problems
        raise err
    return IndexCheck(index, headers)


def write_index(
    directory: PathLike,
    weight_map: Mapping[str, str],
    total_size: int,
    *,
    index_name: str = INDEX_NAME,
) -> str:
    """Write ``model.safetensors.index.json`` deterministically and atomically.

    The form is ``json.dumps({"metadata": {"total_size": N}, "weight_map": {...}},
    indent=2, sort_keys=True) + "\\n"``, as transformers writes it.

    Args:
        directory (`str | os.PathLike`): where to write.
        weight_map (`Mapping[str, str]`): tensor name -> shard filename.
        total_size (`int`): sum of tensor byte lengths.
        index_name (`str`, *optional*): file name. Defaults to ``model.safetensors.index.json``.

    Returns:
        `str`: the path written.
    """
    path = os.path.join(os.fspath(directory), index_name)
    if not isinstance(total_size, int) or isinstance(total_size, bool) or total_size < 0:
        raise SafetensorsError(f"{path}: total_size {total_size!r} is not a non-negative int")
    for key, shard in weight_map.items():
        why = check_shard_name(shard)
        if why:
            raise SafetensorsError(f"{path}: weight_map['{key}'] = {shard!r} {why}")
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    write_atomic(path, text)
    return path
