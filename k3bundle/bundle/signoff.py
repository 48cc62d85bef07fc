"""The sign-off report's format version and its one reader (``reports/signoff.json``).

``validate`` writes the report (``validate.report``); the checklist ticks its numerics stages from
it and ``report diff`` compares two of them, both through ``read_signoff``.
"""

from __future__ import annotations

from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.errors import JsonFileError
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
