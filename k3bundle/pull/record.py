"""``source.json``: what was pulled, from where, at which commit, with every file's size and sha256.

Other commands (plan, convert, verify) read this file, so its keys are a contract::

    {"schema_version": 1, "k3bundle_version": str, "kind": "hub" | "local",
     "repo_id": str | null, "revision": str, "commit": str | null, "license": str | null,
     "files": [{"path": str, "size": int, "sha256": str, "lfs": bool,
                "git_blob_sha1": str | null, "url": str | null}, ...],   # sorted by path
     "include": [str], "exclude": [str], "complete": bool}

It is written deterministically (sorted keys, indent 2, trailing newline, no timestamps), so
two pulls of the same commit give byte-identical files, and atomically (temp file, fsync,
rename), after every listed file has been verified.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3bundle import __version__
from k3bundle.errors import JsonFileError
from k3bundle.io.files import write_atomic
from k3bundle.io.strict_json import read_json
from k3bundle.pull.errors import PullError
from k3bundle.pull.paths import SOURCE_JSON, check_name

SCHEMA_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class FileEntry:
    """One verified file: relative POSIX path, size, sha256 of its bytes, and where it came from."""

    path: str
    size: int
    sha256: str
    lfs: bool = False
    git_blob_sha1: str | None = None
    url: str | None = None


@dataclass(frozen=True)
class SourceRecord:
    kind: str                      # "hub" or "local"
    repo_id: str | None
    revision: str                  # as asked ("main", a tag, a sha); "" for a local pull
    commit: str | None             # 40-hex commit sha for hub pulls, None for local ones
    license: str | None
    files: tuple[FileEntry, ...]
    k3bundle_version: str = __version__
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    complete: bool = True          # False when --include/--exclude left some listed file out
    schema_version: int = SCHEMA_VERSION
    extra: dict = field(default_factory=dict, compare=False)  # unknown keys kept on read

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["files"] = [asdict(f) for f in sorted(self.files, key=lambda f: f.path)]
        d["include"] = list(self.include)
        d["exclude"] = list(self.exclude)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def write_source(directory: str | Path, record: SourceRecord) -> Path:
    """Write ``directory/source.json`` atomically; return its path."""
    directory = Path(directory)
    path = directory / SOURCE_JSON
    write_atomic(path, record.to_json())
    return path


def read_source(path: str | Path) -> SourceRecord:
    """Read and check a ``source.json`` (or the one in a directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / SOURCE_JSON
    try:
        d = read_json(path, version=SCHEMA_VERSION)
    except JsonFileError as e:
        raise PullError(f"{path}: not found; run `k3bundle pull` first" if e.cause == "missing" else str(e)) from None

    def bad(msg: str) -> PullError:
        return PullError(f"{path}: {msg}")

    for key, types in (("k3bundle_version", str), ("kind", str), ("repo_id", (str, type(None))),
                       ("revision", str), ("commit", (str, type(None))), ("license", (str, type(None))),
                       ("files", list)):
        if key not in d:
            raise bad(f"missing key {key!r}")
        if not isinstance(d[key], types):
            raise bad(f"{key!r} has type {type(d[key]).__name__}")
    if d["kind"] not in ("hub", "local"):
        raise bad(f"kind {d['kind']!r} is neither 'hub' nor 'local'")
    if d["kind"] == "hub" and not (d["commit"] and _HEX40.match(d["commit"])):
        raise bad(f"commit {d['commit']!r} is not a 40-hex sha")
    files = []
    for i, f in enumerate(d["files"]):
        try:
            e = FileEntry(path=check_name(f["path"]), size=int(f["size"]), sha256=f["sha256"],
                          lfs=bool(f["lfs"]), git_blob_sha1=f["git_blob_sha1"], url=f["url"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"files[{i}] is malformed: {exc!r}") from None
        if not isinstance(e.sha256, str) or not _HEX64.match(e.sha256) or e.size < 0:
            raise bad(f"{e.path}: bad sha256 or size")
        files.append(e)
    paths = [f.path for f in files]
    if paths != sorted(paths) or len(set(paths)) != len(paths):
        raise bad("files are not sorted by path or repeat a path")
    known = {"schema_version", "k3bundle_version", "kind", "repo_id", "revision", "commit", "license",
             "files", "include", "exclude", "complete"}
    return SourceRecord(kind=d["kind"], repo_id=d["repo_id"], revision=d["revision"], commit=d["commit"],
                        license=d["license"], files=tuple(files), k3bundle_version=d["k3bundle_version"],
                        include=tuple(d.get("include", ())), exclude=tuple(d.get("exclude", ())),
                        complete=bool(d.get("complete", True)),
                        extra={k: v for k, v in d.items() if k not in known})


def is_ours(path: Path) -> bool:
    """True if ``path`` is a source.json that k3bundle wrote (safe to replace)."""
    try:
        d = read_json(path)
    except JsonFileError:
        return False
    return isinstance(d, dict) and {"schema_version", "k3bundle_version", "kind", "files"} <= d.keys()
