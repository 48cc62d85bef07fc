"""``weights.index.json``: every device tensor -> rank, file, key, dtype, shape, byte range, source.

One entry per device tensor (sorted by rank, file, key). ``source`` names the source file (its
sha256 is in the top-level ``source_files`` table), the source key, the logical slice taken
(``rows``/``cols`` of the dequantized tensor, padding appended after it), the transform, and for
MXFP4 sources the scale key and the slice of it. A stacked expert tensor's source is a family:
``key_template`` with ``{eid}``, ``experts`` [first, stop) and ``expert_stride`` (bytes per
expert in the device tensor). ``scale`` names the device tensors holding a quantized part's
scales. The file is written streaming (full K3 has tens of thousands of entries) by
``bundle.index_writer``.

Layout, which readers may rely on: the first line is the header object (every field but
``tensors``) ending in ``,"tensors":[``; then one entry per line, compact, keys sorted, lines
joined by ``,``; then ``]}``. ``lookup`` uses it to find one entry of a 497,220-tensor index without
parsing the other 25 MB; a file in any other JSON layout is still read, by a full parse.

This module is the format and its reader, and imports no torch: ``k3bundle trace`` answers from it.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3bundle.bundle.common import check_relpath, read_json
from k3bundle.bundle.errors import BundleError
from k3bundle.errors import JsonFileError
from k3bundle.io.strict_json import loads
from k3bundle.storage import StorageFormat, stored_format

INDEX_SCHEMA_VERSION = 1
INDEX_KIND = "k3bundle.weights_index"
TENSORS_OPEN = ',"tensors":['  # how the header line ends


def read_index(path: str | Path) -> dict:
    doc = read_json(path, INDEX_KIND, INDEX_SCHEMA_VERSION)
    if not isinstance(doc.get("tensors"), list):
        raise BundleError(f"{path}: 'tensors' is missing or not a list")
    checked: set[str] = set()  # a few hundred distinct names among up to ~500,000 entries
    for i, e in enumerate(doc["tensors"]):
        if not isinstance(e, dict):
            raise BundleError(f"{path}: tensors[{i}] is not an object")
        source = e.get("source") if isinstance(e.get("source"), dict) else {}
        names = (("file", e.get("file")),) + ((("source.file", source["file"]),) if "file" in source else ())
        for field, name in names:
            if not (isinstance(name, str) and name in checked):
                check_relpath(name, f"{path}: tensors[{i}].{field}")
                checked.add(name)
    return doc


def entry_format(entry: dict) -> StorageFormat:
    """The storage format an entry's ``storage`` names (the registry's, or an installed package's)."""
    fmt = stored_format(entry["storage"])
    if fmt is None:
        raise BundleError(f"{entry['file']}: tensor {entry['key']!r} has unknown storage {entry['storage']!r}")
    return fmt


def find_entry(index: dict, rank: int, key: str) -> dict:
    """The entry of device tensor ``key`` on ``rank`` in a parsed index; a miss names near keys."""
    for e in index["tensors"]:
        if e["rank"] == rank and e["key"] == key:
            return e
    keys = sorted({e["key"] for e in index["tensors"] if e["rank"] == rank})
    if not keys:
        ranks = sorted({e["rank"] for e in index["tensors"]})
        raise BundleError(f"rank {rank} has no tensors (ranks 0..{ranks[-1] if ranks else -1})")
    held = sorted({e["rank"] for e in index["tensors"] if e["key"] == key})
    if held:  # on other ranks (the vision tower on stage 0, a TP slice on its own ranks): say which
        hint = f"; it is on rank{'s' if len(held) > 1 else ''} {_ranges(held)}"
    else:
        near = [k for k in keys if key.split(".")[-1] in k][:3]
        hint = f"; e.g. {', '.join(near)}" if near else ""
    raise BundleError(f"rank {rank} has no tensor {key!r} ({len(keys)} tensors){hint}")


def _ranges(ranks: list[int]) -> str:
    """Sorted ranks as runs: [0, 1, 2, 3, 8] -> '0-3, 8'."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def lookup(path: str | Path, rank: int, key: str) -> tuple[dict, dict]:
    """(the index's header without ``tensors``, the entry of ``key`` on ``rank``), reading the file
    once and parsing only the header line and the lines that name ``key``. A file not in the line
    layout above, or a miss (whose error lists near keys), falls back to the full parse."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BundleError(f"{path}: not found") from None
    except OSError as e:
        raise BundleError(f"{path}: not readable: {e}") from None
    first = data.find(b"\n")
    head_line = data[:first] if first >= 0 else b""
    if head_line.endswith(TENSORS_OPEN.encode()):
        try:  # strict, as every read: a line it refuses sends the file to the full parse, which says why
            head = loads(head_line[:-len(TENSORS_OPEN)] + b"}", str(path))
        except JsonFileError:
            head = None
        if isinstance(head, dict) and head.get("kind") == INDEX_KIND and head.get("schema_version") == INDEX_SCHEMA_VERSION:
            needle = b'"key":' + json.dumps(key, ensure_ascii=False).encode("utf-8") + b","
            at = data.find(needle, first)
            while at >= 0:  # the device key, or a source key of the same name: parse the line to tell
                start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
                line = data[start:end if end >= 0 else len(data)]
                try:
                    e = loads(line[:-1] if line.endswith(b",") else line, str(path))
                except JsonFileError:
                    break  # not one entry per line after all: parse the whole file
                if e.get("rank") == rank and e.get("key") == key:
                    check_relpath(e.get("file"), f"{path}: the entry of {key!r} on rank {rank}: file")
                    return head, e
                at = data.find(needle, end if end >= 0 else len(data))
    index = read_index(path)
    return {k: v for k, v in index.items() if k != "tensors"}, find_entry(index, rank, key)
