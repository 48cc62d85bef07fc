"""The source side of a conversion: which files are read, copied or only recorded, and their hashes.

``k3bundle pull`` writes ``source.json`` beside a pulled checkpoint: ``{"schema_version": 1,
"kind": "hub"|"local", "repo_id", "revision", "commit", "license", "files": [{"path", "size",
"sha256", "lfs", "git_blob_sha1", "url"}]}``. When it is present, every file convert reads must
be listed in it with the same size, and its sha256 is checked while the file is read (shards in
the worker, as they stream; the small files as they are copied). When it is absent, convert
hashes every top-level file of SOURCE itself (each read once) and records what it found.

Copied into the bundle as data (never imported): ``config.json`` (byte-identical, at the root),
``tokenizer/`` (``tiktoken.model``, ``tokenizer_config.json``, ``generation_config.json``, the
tokenization and chat-encoding sources ``tokenization_*.py`` / ``encoding_*.py``) and
``processor/`` (``preprocessor_config.json``, ``processor_config.json``, ``*processing*.py``).
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass
from pathlib import Path

from k3bundle.convert.errors import ConvertError
from k3bundle.errors import JsonFileError
from k3bundle.file_names import CONFIG, SOURCE_RECORD as SOURCE_JSON
from k3bundle.io.strict_json import read_json

#: (pattern, bundle directory, required)
COPY_RULES: tuple[tuple[str, str, bool], ...] = (
    (CONFIG, "", True),
    ("tiktoken.model", "tokenizer", True),
    ("tokenizer_config.json", "tokenizer", True),
    ("generation_config.json", "tokenizer", False),
    ("tokenization_*.py", "tokenizer", False),
    ("encoding_*.py", "tokenizer", False),
    ("preprocessor_config.json", "processor", False),
    ("processor_config.json", "processor", False),
    ("*processing*.py", "processor", False),
)


@dataclass(frozen=True)
class Copy:
    source: str  # file name in SOURCE
    dest: str  # path in the bundle


def read_source_json(directory: Path) -> dict | None:
    """``source.json`` of a pulled checkpoint, checked; None when absent."""
    path = directory / SOURCE_JSON
    if not path.is_file():
        return None
    try:
        doc = read_json(path)
    except JsonFileError as e:
        raise ConvertError(str(e)) from None
    if not isinstance(doc, dict) or doc.get("schema_version") != 1 or not isinstance(doc.get("files"), list):
        raise ConvertError(f"{path}: not a k3bundle source.json (schema_version 1 with a files list)")
    if doc.get("complete") is False:
        raise ConvertError(f"{path}: the pull that wrote it did not finish (complete: false); rerun "
                           "`k3bundle pull` to complete it, then convert")
    for i, f in enumerate(doc["files"]):
        ok = (isinstance(f, dict) and isinstance(f.get("path"), str) and isinstance(f.get("size"), int)
              and isinstance(f.get("sha256"), str) and len(f["sha256"]) == 64)
        if not ok:
            raise ConvertError(f"{path}: files[{i}] lacks path, size or a sha256")
    return doc


def copies(directory: Path) -> list[Copy]:
    """The files copied into the bundle, by ``COPY_RULES``; missing required ones raise."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))
    out: list[Copy] = []
    for pattern, dest, required in COPY_RULES:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if required and not hits:
            raise ConvertError(f"{directory}: {pattern} is missing; a bundle needs it (it is copied into "
                               f"{dest or 'the bundle root'}/)")
        for n in hits:
            if all(c.source != n for c in out):
                out.append(Copy(n, f"{dest}/{n}" if dest else n))
    return out


class SourceFiles:
    """The files of SOURCE a conversion reads, and what ``source.json`` says about them."""

    def __init__(self, directory: Path, shards: list[str], index_name: str):
        self.dir = directory
        self._small: dict[str, bytes] = {}
        self.doc = read_source_json(directory)
        self.listed = {f["path"]: f for f in self.doc["files"]} if self.doc else {}
        self.copies = copies(directory)
        self.shards = shards
        self.index_name = index_name
        read = shards + [index_name] + [c.source for c in self.copies]
        if self.doc is not None:
            problems = []
            for name in read:
                entry = self.listed.get(name)
                size = (directory / name).stat().st_size
                if entry is None:
                    problems.append(f"{name} is not listed")
                elif entry["size"] != size:
                    problems.append(f"{name} is {size} bytes, source.json says {entry['size']}")
            if problems:
                raise ConvertError(f"{directory / SOURCE_JSON}: {len(problems)} problem(s): "
                                   + "; ".join(problems[:5]))

    def expected_sha256(self, name: str) -> str | None:
        entry = self.listed.get(name)
        return entry["sha256"] if entry else None

    def check(self, name: str, sha256: str) -> None:
        want = self.expected_sha256(name)
        if want is not None and want != sha256:
            raise ConvertError(f"{self.dir / name}: sha256 {sha256} does not match source.json ({want}); "
                               "the file changed or is corrupt since it was pulled: pull it again")

    def read_small(self, name: str) -> bytes:
        """A small source file (config, index, tokenizer...), read once, checked against source.json."""
        got = self._small.get(name)
        if got is None:
            data = (self.dir / name).read_bytes()
            self.check(name, hashlib.sha256(data).hexdigest())
            got = self._small[name] = data
        return got

    def small_digest(self, name: str) -> tuple[str, int]:
        data = self.read_small(name)
        return hashlib.sha256(data).hexdigest(), len(data)

    def source_json_digest(self) -> dict | None:
        path = self.dir / SOURCE_JSON
        if self.doc is None:
            return None
        data = path.read_bytes()
        return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    def provenance(self) -> dict | None:
        if self.doc is None:
            return None
        return {k: self.doc.get(k) for k in ("kind", "repo_id", "revision", "commit", "license",
                                             "k3bundle_version")}
