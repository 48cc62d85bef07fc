"""The resume journal of an unfinished conversion: ``BUNDLE/.k3bundle-convert.journal``.

JSON lines. The first line names the plan (``plan_id``: a hash of the k3bundle version, the
resolved layout, config.json, the source index and source.json); each further line records one
finished unit: the source file (sha256, size, mtime) and every output (path, sha256, size).
On a rerun, a unit is skipped only if the plan is the same, its source file's size and mtime are
unchanged, and every output re-hashes to the recorded sha256 — the journal is a claim, never
trusted on its own. Before the small files (config, tokenizer, indexes) are written, a line
lists them too, so that ``--force`` knows every file a partial run may have left. The journal is
deleted only after ``manifest.json`` is in place: a crash between the two leaves both, and a
rerun resumes (every unit re-verified, the same manifest rewritten). The run's lock is a
``flock`` on the bundle folder itself (``convert.run``), taken before the journal is opened.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from k3bundle.io.files import sha256_file
from k3bundle.convert.errors import ConvertError
from k3bundle.convert.unit import UnitResult, disk_error
from k3bundle.errors import JsonFileError
from k3bundle.file_names import CONVERT_JOURNAL as JOURNAL
from k3bundle.io.strict_json import loads


class Journal:
    def __init__(self, out: Path, plan_id: str):
        self.path = out / JOURNAL
        self.plan_id = plan_id
        self.entries: dict[str, dict] = {}
        self.files: set[str] = set()  # small files a run announced before writing them
        try:
            self._f = open(self.path, "a+", encoding="utf-8")
        except OSError as e:
            raise disk_error(e, JOURNAL) from None
        self._f.seek(0)
        lines = self._f.read().splitlines()
        if lines and lines[0].endswith("}"):
            self._load(out, lines)
        else:  # new, or killed before its first line was complete: nothing was recorded
            self._f.truncate(0)
            self._append({"schema_version": 1, "kind": "k3bundle.convert-journal", "plan_id": plan_id})

    def _load(self, out: Path, lines: list[str]) -> None:
        try:
            head = loads(lines[0], str(self.path))
        except JsonFileError:
            head = {}
        if head.get("plan_id") != self.plan_id:
            self.close()
            raise ConvertError(f"{out}: holds a partial conversion of a different plan (target, source or "
                               "options differ); use another --out, or --force to start over")
        for line in lines[1:]:
            try:
                e = loads(line, str(self.path))
            except JsonFileError:  # a line cut short by a kill
                continue
            if "files" in e:
                self.files.update(e["files"])
            elif "unit" in e:
                self.entries[e["unit"]] = e

    def _append(self, doc: dict) -> None:
        try:
            self._f.seek(0, os.SEEK_END)
            self._f.write(json.dumps(doc, sort_keys=True) + "\n")
            self._f.flush()
        except OSError as e:
            raise disk_error(e, JOURNAL) from None

    def record_files(self, paths: list[str]) -> None:
        """Announce the small files about to be written (so ``--force`` can remove them later)."""
        self.files.update(paths)
        self._append({"files": sorted(paths)})

    def record(self, r: UnitResult) -> None:
        doc = {"unit": r.shard, "sha256": r.sha256, "size": r.size, "mtime_ns": r.mtime_ns,
               "outputs": [list(o) for o in r.outputs], "nvfp4_requantized": r.nvfp4_requantized}
        self.entries[r.shard] = doc
        self._append(doc)

    def verified(self, shard: str, source: Path, out: Path, outputs: list[str],
                 expected_sha256: str | None) -> UnitResult | None:
        """The recorded result of ``shard`` if it still holds (outputs re-hashed), else None."""
        e = self.entries.get(shard)
        if e is None:
            return None
        st = os.stat(source / shard)
        if (st.st_size, st.st_mtime_ns) != (e["size"], e["mtime_ns"]):
            return None
        if expected_sha256 is not None and e["sha256"] != expected_sha256:
            return None
        if sorted(o[0] for o in e["outputs"]) != sorted(outputs):
            return None
        for path, sha, size in e["outputs"]:
            p = out / path
            if not p.is_file() or p.stat().st_size != size or sha256_file(p)[0] != sha:
                return None
        return UnitResult(shard, e["sha256"], e["size"], e["mtime_ns"], [tuple(o) for o in e["outputs"]],
                          e["nvfp4_requantized"])

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


def recorded(out: Path) -> tuple[str | None, set[str]]:
    """What a journal in ``out`` records without opening it for writing: (plan id, every path its
    units and small files wrote). Lines cut short by a kill are skipped."""
    try:
        lines = (out / JOURNAL).read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return None, set()
    plan, paths = None, set()
    for i, line in enumerate(lines):
        try:
            e = loads(line, str(out / JOURNAL))
        except JsonFileError:
            continue
        if not isinstance(e, dict):
            continue
        if i == 0:
            plan = e.get("plan_id")
        paths.update(o[0] for o in e.get("outputs", ()) if isinstance(o, list) and o)
        paths.update(p for p in e.get("files", ()) if isinstance(p, str))
    return plan, paths
