"""``manifest.json``: written last; a bundle without it is incomplete.

It chains source to output: the source's provenance (from ``source.json``: repo, revision, commit,
license) and the sha256 + size of every source file; the resolved layout and its sha256; the
options; the NVFP4 blocks that could not be transcoded losslessly; and the sha256 + size of every
bundle file (all but ``manifest.json`` itself, sorted by path). No timestamps, no absolute paths:
the same source, layout and k3bundle version give the same bytes. ``k3bundle.convert.manifest``
builds it; this module names it and reads it back.
"""

from __future__ import annotations

from pathlib import Path

from k3bundle.bundle.common import check_relpath, read_json
from k3bundle.bundle.errors import BundleError
from k3bundle.file_names import MANIFEST

MANIFEST_SCHEMA_VERSION = 1
MANIFEST_KIND = "k3bundle.manifest"


def read_manifest(bundle: str | Path) -> dict:
    """A bundle's manifest, checked for kind and schema version."""
    path = Path(bundle) / MANIFEST
    if not path.exists():
        raise BundleError(f"{bundle}: no {MANIFEST}: not a bundle, or its conversion did not finish "
                          "(rerun the same convert command to resume it)")
    doc = read_json(path, MANIFEST_KIND, MANIFEST_SCHEMA_VERSION)
    if not isinstance(doc.get("files"), list):
        raise BundleError(f"{path}: 'files' is missing or not a list")
    source_files = (doc.get("source") or {}).get("files") or []
    for table, rows in (("files", doc["files"]), ("source.files", source_files)):
        for i, f in enumerate(rows):
            check_relpath(f.get("path") if isinstance(f, dict) else None, f"{path}: {table}[{i}].path")
    return doc


__all__ = ["MANIFEST_KIND", "MANIFEST_SCHEMA_VERSION", "read_manifest"]
