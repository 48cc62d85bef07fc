"""The sign-off report's format version, its one reader (``reports/validate/RUN_KEY/signoff.json``)
and what binds it to the bundle it judged.

``validate`` writes the report (``validate.report``); the checklist ticks its numerics stages from
it and ``report diff`` compares two of them, both through ``read_signoff``.

A verdict names what it judged (``binding``): the sha256 of the bundle's ``manifest.json`` (None
for a checkpoint), the goldens' content hash, the sha256 of the goldens' ``tolerances.yaml`` and
the goldens' case list (and the path of the tolerance file ``validate --tolerances`` named, whose
sha256 it then is). The checklist ticks from a sign-off only while ``stale_because`` finds
all of them equal to the bundle as it is now, and while the run marker of its run key
(``validate_run_marker``, written by ``validate`` before it judges) names the same run as the
sign-off: a later run of that key that could not replace the reports (``reports/`` unwritable, a
kill) leaves a marker naming itself, so the earlier sign-off of that key no longer ticks. Runs of
other keys (``bundle.signoff_runs``) have markers of their own and leave it ticking.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.errors import JsonFileError
from k3bundle.file_names import GOLDEN_TOLERANCES, MANIFEST, VALIDATION_DIR, validate_run_marker
from k3bundle.io.files import sha256_file, write_atomic
from k3bundle.io.strict_json import read_json

SIGNOFF_SCHEMA_VERSION = 1


def read_signoff(path: str | Path) -> dict:
    """The sign-off report in the file ``path``, read strictly; a ``BundleError`` naming the file when
    it is not readable JSON or not a k3bundle sign-off of this schema version."""
    try:
        doc = read_json(path)
    except JsonFileError as e:
        raise BundleError(f"{e.file}: not readable JSON ({e.problem})") from None
    if not isinstance(doc, dict) or doc.get("schema_version") != SIGNOFF_SCHEMA_VERSION \
            or not isinstance(doc.get("cases"), list):
        raise BundleError(f"{path}: not a k3bundle sign-off report of schema version {SIGNOFF_SCHEMA_VERSION}")
    for i, c in enumerate(doc["cases"]):  # its readers use these fields of every case
        if not (isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("status"), str)
                and isinstance(c.get("results", []), list) and all(isinstance(r, dict) for r in c.get("results", []))):
            raise BundleError(f"{path}: cases[{i}] is not a case report (an object with a name, a status and a "
                              f"list of results), got {str(c)[:60]}")
    return doc


#: The sign-off's fields that bind it to what it judged, in the order a stale report names them.
BINDING_FIELDS = {"bundle_manifest_sha256": MANIFEST, "golden_content_hash": "the goldens (content hash)",
                  "tolerances_sha256": "the goldens' tolerances.yaml", "case_list": "the goldens' case list"}


def file_digest(path: str | Path) -> str | None:
    """sha256 of the file ``path``; None when there is none."""
    p = Path(path)
    return sha256_file(p)[0] if p.is_file() else None


def manifest_digest(bundle: str | Path) -> str | None:
    """sha256 of a bundle's ``manifest.json`` (None for a checkpoint): which bundle was judged."""
    return file_digest(Path(bundle) / MANIFEST)


def binding(bundle: str | Path, golden_meta: dict, tolerances_file: str | Path) -> dict:
    """What a verdict on ``bundle`` against these goldens judges, as it is on disk now."""
    return {"bundle_manifest_sha256": manifest_digest(bundle),
            "golden_content_hash": golden_meta.get("content_hash"),
            "tolerances_sha256": file_digest(tolerances_file),
            "case_list": [e.get("name") for e in golden_meta.get("cases", []) if isinstance(e, dict)]}


def _short(v) -> str:
    return f"{v[:16]}…" if isinstance(v, str) and len(v) > 16 else ("none" if v is None else str(v))


def judged_tolerances(bundle: str | Path, signoff: dict) -> Path:
    """The tolerance file a sign-off judged by: the one ``validate --tolerances`` named (recorded
    as ``tolerances_file``), else the goldens' own ``tolerances.yaml``."""
    own = signoff.get("tolerances_file")
    return Path(own) if isinstance(own, str) and own else Path(bundle) / VALIDATION_DIR / GOLDEN_TOLERANCES


def stale_because(signoff: dict, now: dict, marker: dict | None) -> str:
    """'' when ``signoff`` judged exactly ``now`` (``binding``) and is the last run the marker names,
    else "stale: the bundle changed after this sign-off (what changed)"."""
    changed = []
    for key, what in BINDING_FIELDS.items():
        if key == "tolerances_sha256" and signoff.get("tolerances_file"):
            what = f"the tolerance file {signoff['tolerances_file']}"
        if key not in signoff:
            return f"stale: the sign-off does not record {what} it judged (an older k3bundle wrote it); rerun validate"
        if signoff[key] != now[key]:
            changed.append(f"{what}: judged {_short(signoff[key])}, now {_short(now[key])}")
    if changed:
        return "stale: the bundle changed after this sign-off (" + "; ".join(changed) + ")"
    if marker is not None and marker.get("run_id") != signoff.get("run_id"):
        return (f"stale: a later validate run (started {marker.get('started', '?')}) did not write its reports; "
                "rerun validate")
    return ""


def write_run_marker(bundle: str | Path, run_key: str, run_id: str, started: str) -> None:
    """Name the run of ``run_key`` now judging ``bundle`` (before it writes anything), so that a
    sign-off of an earlier run of that key stops ticking even where this run cannot remove it. No
    goldens folder: nothing to tick, no marker. An ``OSError`` when the marker cannot be written."""
    if not (Path(bundle) / VALIDATION_DIR).is_dir():
        return
    write_atomic(Path(bundle) / validate_run_marker(run_key),
                 json.dumps({"run_key": run_key, "run_id": run_id, "started": started}) + "\n")


def read_run_marker(bundle: str | Path, run_key: str) -> dict | None:
    """The run marker of ``run_key`` (None: no run of that key has written one); an unreadable one
    names no run."""
    p = Path(bundle) / validate_run_marker(run_key)
    if not p.is_file():
        return None
    try:
        doc = read_json(p)
    except JsonFileError:
        return {"run_id": None, "started": "unknown: the marker is unreadable"}
    return doc if isinstance(doc, dict) else {"run_id": None}
