"""The pull state file: which files in ``--out`` this k3bundle has already verified.

``--out/.k3bundle-pull.json`` maps each verified path to its size, sha256 (and git blob
sha1 when the Hub gave one), and the file's stat identity right after it was renamed into
place: ``[size, mtime_ns, ctime_ns, inode]``; for local copies also the source file's
identity. A rerun *keeps* a file without reading it when all of that still holds and the
hash the pull expects now equals the recorded one. Any change (rewritten, touched,
chmod'ed, copied elsewhere, restored from backup) changes ctime or the inode, so the file is
hashed again once. The state is only a cache: losing it costs one re-hash, never a wrong
answer. ``--recheck`` ignores it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from k3bundle.pull.paths import STATE_FILE
from k3bundle.errors import JsonFileError
from k3bundle.io.files import write_atomic
from k3bundle.io.strict_json import read_json

STATE_VERSION = 1


def stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


@dataclass(frozen=True)
class Verified:
    size: int
    sha256: str
    git_blob_sha1: str | None
    stat: list[int]
    src_stat: list[int] | None = None


class PullState:
    """Thread-safe view of the state file; every ``put`` rewrites it atomically."""

    def __init__(self, out: Path):
        self.path = Path(out) / STATE_FILE
        self._lock = threading.Lock()
        self._files: dict[str, Verified] = {}
        try:
            d = read_json(self.path)
            if d.get("version") == STATE_VERSION:
                for k, v in d.get("files", {}).items():
                    self._files[k] = Verified(**v)
        except (JsonFileError, TypeError, AttributeError):
            self._files = {}  # missing or unreadable: start over, files get re-hashed once

    def get(self, name: str) -> Verified | None:
        with self._lock:
            return self._files.get(name)

    def put(self, name: str, v: Verified) -> None:
        with self._lock:
            self._files[name] = v
            self._save()

    def drop(self, name: str) -> None:
        with self._lock:
            if self._files.pop(name, None) is not None:
                self._save()

    def _save(self) -> None:
        d = {"version": STATE_VERSION, "files": {k: asdict(v) for k, v in sorted(self._files.items())}}
        write_atomic(self.path, json.dumps(d, indent=1, sort_keys=True) + "\n")
