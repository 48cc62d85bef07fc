"""Build a bundle's ``manifest.json`` (its fields: ``k3bundle.bundle.manifest``, docs/bundle-format.md)."""

from __future__ import annotations

from k3bundle import __version__
from k3bundle.bundle.manifest import MANIFEST_KIND, MANIFEST_SCHEMA_VERSION
from k3bundle.convert.sources import SourceFiles
from k3bundle.io.files import sha256_file
from k3bundle.plan import Plan


def _source_files(files: SourceFiles, read: dict[str, tuple[str, int]]) -> list[dict]:
    if files.doc is not None:
        out = []
        for e in sorted(files.doc["files"], key=lambda e: e["path"]):
            row = {"path": e["path"], "size": e["size"], "sha256": e["sha256"], "read_by_convert": e["path"] in read}
            for k in ("url", "lfs", "git_blob_sha1"):
                if e.get(k) is not None:
                    row[k] = e[k]
            out.append(row)
        return out
    out = []
    for p in sorted(files.dir.iterdir()):
        if not p.is_file() or p.name.startswith("."):
            continue
        sha, size = read[p.name] if p.name in read else sha256_file(p)
        out.append({"path": p.name, "size": size, "sha256": sha, "read_by_convert": p.name in read})
    return out


def build_manifest(plan: Plan, files: SourceFiles, read: dict[str, tuple[str, int]],
                   bundle_files: dict[str, tuple[str, int]], requantized: list[dict]) -> dict:
    """The manifest document (see the module docstring)."""
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "kind": MANIFEST_KIND,
        "k3bundle_version": __version__,
        "target": plan.layout.name,
        "source": {
            "provenance": files.provenance(),
            "source_json": files.source_json_digest(),
            "checked_against_source_json": files.doc is not None,
            "files": _source_files(files, read),
        },
        "layout": {"path": "device_weights/layout.yaml",
                   "sha256": plan.layout.sha256, "resolved": plan.layout.to_dict()},
        "options": {"target": plan.layout.name, "text_prefix": plan.schema.prefix},
        "plan": {"world": len(plan.ranks), "rank_weight_bytes": plan.rank_bytes,
                 "usable_bytes_per_card": plan.usable_bytes, "fits": plan.fits},
        "nvfp4_requantized": requantized,
        "files": [{"path": p, "sha256": sha, "size": size} for p, (sha, size) in sorted(bundle_files.items())],
    }
