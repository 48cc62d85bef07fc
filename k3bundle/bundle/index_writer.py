"""Writes ``weights.index.json`` (the format: ``bundle.index``) from a plan: one entry per device tensor."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from k3bundle.bundle.index import INDEX_KIND, INDEX_SCHEMA_VERSION, TENSORS_OPEN
from k3bundle.formats import mxfp4
from k3bundle.io.files import atomic_output
from k3bundle.plan import Plan
from k3bundle.plan.files import DeviceTensor, OutFile, shard_files
from k3bundle.plan.storage import storage_name
from k3bundle.schema import Format


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def tensor_entry(plan: Plan, f: OutFile, d: DeviceTensor, offset: int) -> dict:
    """The index entry of one device tensor at data offset ``offset`` of file ``f``."""
    t, dp, schema = d.target, d.part, plan.schema
    logical = list(schema.logical_shape(t.role))
    rows = [t.start, t.stop] if t.split in ("rows", "none") else [0, logical[0]]
    if t.role.padded and t.split == "none":
        rows = [0, schema.dims[t.role.unit]]
    cols = [t.start, t.stop] if t.split == "cols" else ([0, logical[1]] if len(logical) > 1 else None)
    storage = storage_name(t.rule, t.role)
    src_part = dp.source_part
    src: dict = {"file": f.shard, "logical_shape": logical, "rows": rows, "cols": cols}
    if t.split == "rows" and t.pad:
        src["pad_rows"] = t.pad
    if t.split == "cols" and t.pad:
        src["pad_cols"] = t.pad
    mx_source = t.role.fmt is Format.MXFP4  # read from the release's MXFP4 pair: the scale is named too
    suffixes = {"packed": ".weight_packed", "scale": ".weight_scale"}
    if d.stacked:
        src["key_template"] = schema.expert_name_template(t.role, t.layer, suffixes[src_part])
        src["experts"] = list(t.experts)
        src["expert_stride"] = dp.nbytes
        if mx_source:
            src["scale"] = {"key_template": schema.expert_name_template(t.role, t.layer, suffixes["scale"])}
    else:
        specs = {s.part: s for s in schema.specs(t.role, t.layer, d.expert)}
        src["key"] = specs[src_part].name
        if mx_source:
            src["scale"] = {"key": specs["scale"].name}
    if mx_source:
        c0, c1 = cols
        src["scale"].update({"rows": rows, "cols": [c0 // mxfp4.BLOCK, c1 // mxfp4.BLOCK]})
    entry = {
        "rank": f.rank, "file": f.path, "key": d.name, "dtype": d.dtype, "shape": list(d.shape),
        "byte_range": [f.data_start + offset, f.data_start + offset + d.nbytes],
        "role": t.role.role, "layer": t.layer, "storage": storage, "part": dp.part,
        "transform": dp.transform, "source": src,
    }
    if dp.part in ("packed", "weight"):  # a data part names its scale parts, if the format has any
        names = {p.part: p for p in plan.parts(t)}
        scale = {field: schema.device_name(t.role, t.layer, None if d.stacked else d.expert, names[part].suffix,
                                           stacked=d.stacked)
                 for part, field in (("scale", "device_key"), ("global_scale", "device_global_key")) if part in names}
        if scale:
            entry["scale"] = scale
    return entry


def iter_entries(plan: Plan, files: Iterable[OutFile]) -> Iterator[dict]:
    for f in files:
        for d, off in zip(f.tensors, f.offsets):
            yield tensor_entry(plan, f, d, off)


def write_index(path: str | Path, plan: Plan, source_files: dict[str, dict]) -> tuple[int, int]:
    """Write ``weights.index.json`` atomically, streaming its entries; return (entries, bytes)."""
    path = Path(path)
    files = sorted((f for shard in plan.shards for f in shard_files(plan, shard)),
                   key=lambda f: (f.rank, f.path))
    head = {"schema_version": INDEX_SCHEMA_VERSION, "kind": INDEX_KIND,
            "target": plan.layout.name, "world": len(plan.ranks),
            "source_files": {k: source_files[k] for k in sorted(source_files)}}
    n = 0
    with atomic_output(path) as out:
        text = _dumps(head)
        out.write((text[:-1] + TENSORS_OPEN + "\n").encode("utf-8"))
        for entry in iter_entries(plan, files):
            out.write((("" if n == 0 else ",\n") + _dumps(entry)).encode("utf-8"))
            n += 1
        out.write(b"\n]}\n")
    return n, path.stat().st_size
