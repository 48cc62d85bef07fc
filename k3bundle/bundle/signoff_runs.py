"""The validate runs a bundle keeps sign-offs of, keyed by what each validated, and which one a
reader takes.

``validate BUNDLE`` writes its reports into ``reports/validate/KEY/`` (``file_names.signoff_run_dir``),
KEY naming what it validated (``run_key``), then names that run in ``reports/validate/latest.json``
(replaced atomically, no link). A later run of the same key replaces that key's reports; runs of
other keys keep theirs. The checklist and ``report diff`` read the latest run unless given a key
(``choose_run``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.signoff import read_signoff
from k3bundle.errors import JsonFileError
from k3bundle.file_names import SIGNOFF_LATEST, SIGNOFF_RUNS_DIR, signoff_path
from k3bundle.io.files import write_atomic
from k3bundle.io.strict_json import read_json

#: characters a run key keeps; any other run of characters becomes one "-"
_UNSAFE = re.compile(r"[^A-Za-z0-9._]+")
KEY_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def _part(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-.") or "unnamed"


def run_key(device: str = "cpu", ranks: str = "merged", backend: str | None = None,
            dumps: str | Path | None = None) -> str:
    """What a validate run judges, as its reports folder's name (``reports/validate/KEY``).

    ``dumps-NAME``: an external runtime's dumps in the folder named NAME; else ``builtin-DEVICE``
    (the built-in executor on the reference's kernels) or ``backend-BACKEND-DEVICE`` (on a
    backend's), with ``-distributed`` for one process per rank. Characters other than letters,
    digits, ``.`` and ``_`` become ``-``: ``--device cuda:1 --backend planted:x`` is
    ``backend-planted-x-cuda-1``.

    Example:
        >>> run_key("cuda", "distributed")
        'builtin-cuda-distributed'
    """
    if dumps is not None:
        return "dumps-" + _part(Path(os.path.abspath(dumps)).name)  # abspath: "." names its folder
    head = "builtin" if backend is None else "backend-" + _part(backend)
    return "-".join([head, _part(device)] + (["distributed"] if ranks == "distributed" else []))


def describe_run(run: dict) -> str:
    """A sign-off's ``run`` record as a reader says it: what was validated, where."""
    if not run:
        return "what was validated is not recorded"
    if run.get("dumps"):
        text = f"dumps of {run['dumps']} (emulated on {run.get('device')})"
    else:
        text = f"built-in executor on {run.get('device')}" + (f", backend {run['backend']}" if run.get("backend")
                                                                 else ", reference kernels")
        if run.get("ranks") == "distributed":
            text += ", one process per rank"
    return text


@dataclass(frozen=True)
class SignoffRun:
    """One run key's sign-off in a bundle: its report, or why it cannot be read."""

    key: str
    doc: dict | None
    why: str = ""

    @property
    def path(self) -> str:
        return signoff_path(self.key)

    @property
    def run(self) -> dict:
        r = (self.doc or {}).get("run")
        return r if isinstance(r, dict) else {}

    @property
    def finished(self) -> str:
        return str(self.run.get("finished") or "unknown")

    def summary(self) -> str:
        """``KEY (built-in executor on cpu, reference kernels; finished T; PASS)``."""
        if self.doc is None:
            return f"{self.key} ({self.why})"
        verdict = "PASS" if self.doc.get("passed") is True else "FAIL"
        return f"{self.key} ({describe_run(self.run)}; finished {self.finished}; {verdict})"


def write_latest(bundle: str | Path, key: str, run_id: str, finished: str) -> None:
    """Name the run of ``key`` the latest, after its reports are written."""
    write_atomic(Path(bundle) / SIGNOFF_LATEST,
                 json.dumps({"run_key": key, "run_id": run_id, "finished": finished,
                             "signoff": signoff_path(key)}, sort_keys=True) + "\n")


def read_latest(bundle: str | Path) -> tuple[str | None, str]:
    """(the key ``latest.json`` names, '') or (None, why there is none)."""
    p = Path(bundle) / SIGNOFF_LATEST
    if not p.is_file():
        return None, f"no {SIGNOFF_LATEST}"
    try:
        doc = read_json(p)
    except JsonFileError as e:
        return None, f"{SIGNOFF_LATEST}: not readable JSON ({e.problem})"
    key = doc.get("run_key") if isinstance(doc, dict) else None
    if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
        return None, f"{SIGNOFF_LATEST}: names no run key"
    return key, ""


def _read(bundle: Path, key: str) -> SignoffRun:
    p = bundle / signoff_path(key)
    if not p.is_file():
        return SignoffRun(key, None, f"no {signoff_path(key)}: the last run of this key wrote no sign-off")
    try:
        return SignoffRun(key, read_signoff(p))
    except BundleError as e:
        return SignoffRun(key, None, str(e))


def signoff_runs(bundle: str | Path) -> list[SignoffRun]:
    """Every run key with a folder in ``reports/validate/``, the newest finished first."""
    root = Path(bundle) / SIGNOFF_RUNS_DIR
    if not root.is_dir():
        return []
    runs = [_read(Path(bundle), p.name) for p in sorted(root.iterdir())
            if p.is_dir() and not p.is_symlink() and KEY_PATTERN.fullmatch(p.name)]
    return sorted(runs, key=lambda r: r.finished if r.doc is not None else "", reverse=True)


def choose_run(bundle: str | Path, key: str | None = None) -> tuple[SignoffRun | None, str, list[SignoffRun]]:
    """(the run a reader takes, how it was chosen or why there is none, every run).

    ``key`` given: that run (a ``BundleError`` naming the keys there are when there is no such
    run). Else the run ``latest.json`` names; where it names none, the newest readable sign-off.
    """
    runs = signoff_runs(bundle)
    by_key = {r.key: r for r in runs}
    if key is not None:
        if key not in by_key:
            have = ", ".join(by_key) or "none"
            raise BundleError(f"{Path(bundle) / SIGNOFF_RUNS_DIR}: no run {key!r} (runs there: {have})")
        return by_key[key], "chosen with --run", runs
    latest, why = read_latest(bundle)
    if latest in by_key:
        return by_key[latest], f"the latest run ({SIGNOFF_LATEST})", runs
    readable = [r for r in runs if r.doc is not None]
    if readable:
        gone = why or f"{SIGNOFF_LATEST} names {latest!r}, which has no folder"
        return readable[0], f"the newest sign-off by its finish time ({gone})", runs
    if not runs:
        return None, f"no sign-off in {SIGNOFF_RUNS_DIR}/", runs
    return None, "; ".join(f"{r.path}: {r.why}" for r in runs), runs
