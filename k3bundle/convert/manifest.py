"""Build a bundle's ``manifest.json`` (its fields: ``k3bundle.bundle.manifest``, docs/bundle-format.md)
and the quantization description its layout's convention reads (``convention_file``)."""

from __future__ import annotations

import json
import re

from k3bundle import __version__
from k3bundle.bundle.common import json_bytes
from k3bundle.bundle.manifest import MANIFEST_KIND, MANIFEST_SCHEMA_VERSION
from k3bundle.convert.source_files import SourceFiles
from k3bundle.file_names import DEVICE_DIR, LAYOUT
from k3bundle.io.files import sha256_file
from k3bundle.plan import Plan
from k3bundle.plan.storage import storage_format
from k3bundle.schema import Format, Role
from k3bundle.schema.roles import Scope
from k3bundle.storage import CONVENTIONS, MODELOPT, STORAGE


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
        "layout": {"path": LAYOUT,
                   "sha256": plan.layout.sha256, "resolved": plan.layout.to_dict()},
        "options": {"target": plan.layout.name, "text_prefix": plan.schema.prefix},
        "plan": {"world": len(plan.ranks), "rank_weight_bytes": plan.rank_bytes,
                 "usable_bytes_per_card": plan.usable_bytes, "fits": plan.fits},
        "nvfp4_requantized": requantized,
        "files": [{"path": p, "sha256": sha, "size": size} for p, (sha, size) in sorted(bundle_files.items())],
    }


# ------------------------------------------------------------------------------------------
# The convention's quantization description, beside the device weights (docs/bundle-format.md
# "Conventions"). config.json stays the release's byte for byte; this file says what the device
# tensors hold, in the layout's convention's own format.


def _module_glob(plan: Plan, role: Role, layer: int | str = "*") -> str:
    """The module names of ``role``'s instances on the device as a glob (``*`` = any layer / expert)."""
    stacked = plan.layout.stack_experts and role.scope is Scope.EXPERT
    return plan.schema.device_name(role, layer, None if stacked else "*", "", stacked=stacked)


def _ct_regex(glob: str) -> str:
    return "re:^" + re.escape(glob).replace(r"\*", "[0-9]+") + "$"


def _module_globs(plan: Plan) -> dict[str, list[str]]:
    """Storage name -> globs of the modules stored in it. Roles of different layer kinds may share
    a module name (``self_attn.g_proj`` in KDA and MLA layers); where such roles are stored
    differently, their globs name each layer."""
    layers: dict[str, set] = {}
    roles: dict[str, Role] = {}
    for role, layer in plan.schema.instances():
        if role.fmt is not Format.MXFP4 and not role.template.endswith(".weight"):
            continue  # not a module's weight (A_log, dt_bias, ...): no module to name
        roles[role.role] = role
        layers.setdefault(role.role, set()).add(layer)
    storage = {name: storage_format(plan.layout.rule_for(r), r).name for name, r in roles.items()}
    by_glob: dict[str, set[str]] = {}
    for name, r in roles.items():
        by_glob.setdefault(_module_glob(plan, r), set()).add(storage[name])
    out: dict[str, list[str]] = {}
    for name in sorted(roles):
        r, glob = roles[name], _module_glob(plan, roles[name])
        if len(by_glob[glob]) == 1:
            out.setdefault(storage[name], []).append(glob)
        else:
            out.setdefault(storage[name], []).extend(_module_glob(plan, r, x) for x in sorted(layers[name]))
    return {k: sorted(set(v)) for k, v in out.items()}


def convention_file(plan: Plan) -> tuple[str, bytes]:
    """(bundle path, bytes) of the quantization description the layout's convention reads."""
    conv = CONVENTIONS[plan.layout.convention]
    by = _module_globs(plan)
    quantized = {name: globs for name, globs in by.items() if STORAGE[name].described}
    if conv.name == MODELOPT:
        algos = {json.dumps(STORAGE[name].described[conv.name], sort_keys=True) for name in quantized}
        algo = json.loads(algos.pop()) if len(algos) == 1 else {"quant_algo": None}
        kept = sorted(g for name, globs in by.items() if name not in quantized for g in globs)
        doc = {"producer": {"name": "k3bundle", "version": __version__},
               "quantization": {**algo, "kv_cache_quant_algo": None, "exclude_modules": kept}}
    else:
        groups = {}
        for name in sorted(quantized):
            d = STORAGE[name].described[conv.name]
            groups[f"group_{len(groups)}"] = {
                "targets": [_ct_regex(g) for g in quantized[name]],
                "weights": d["weights"], "input_activations": None, "output_activations": None,
                "format": d["format"]}
        formats = {g["format"] for g in groups.values()}
        doc = {"quant_method": "compressed-tensors",
               "format": formats.pop() if len(formats) == 1 else "mixed-precision",
               "quantization_status": "compressed", "config_groups": groups, "ignore": [],
               "kv_cache_scheme": None}
    return f"{DEVICE_DIR}/{conv.file}", json_bytes(doc)
