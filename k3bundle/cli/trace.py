"""``k3bundle trace``: the source file, key, slice and scale behind a device tensor or byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.provenance.trace import trace as run_trace
from k3bundle.cli._common import JsonOpt, Output

EXAMPLES = [
    "k3bundle trace /bundles/k3-b300 3 language_model.model.layers.5.self_attn.q_proj.weight",
    "k3bundle trace /bundles/k3-b300 0 language_model.model.layers.1.block_sparse_moe.experts.w2.weight_packed --offset 123456",
]


def trace(
    bundle: Annotated[Path, typer.Argument(help="A bundle directory.")],
    rank: Annotated[int, typer.Argument(help="Device rank.")],
    key: Annotated[str, typer.Argument(help="Device tensor name on that rank (see weights.index.json).")],
    offset: Annotated[int | None, typer.Option("--offset", help="A byte offset inside the tensor's data.")] = None,
    json_: JsonOpt = False,
) -> None:
    """Which source file, key, slice (and scale slice) produced this device tensor, or this byte of it."""
    r = run_trace(bundle, rank, key, offset)
    s = r["source"]
    key_text = s.get("key") or f"{s['key_template']} (experts {s['experts'][0]}..{s['experts'][1] - 1})"
    lines = [f"rank {r['rank']} {r['key']}: {r['dtype']} {r['shape']} in {r['file']} bytes {r['byte_range']}",
             f"  from {s['file']} (sha256 {s['sha256']})",
             f"  source {key_text}: rows {s['rows']} cols {s['cols']} of {s['logical_shape']}"
             + "".join(f", {k} {s[k]}" for k in ("pad_rows", "pad_cols") if k in s),
             f"  storage {r['storage']} part {r['part']}, transform {r['transform']}"]
    if "scale" in s:
        sc = s["scale"]
        lines.append(f"  scale {sc.get('key') or sc['key_template']}: rows {sc['rows']} blocks {sc['cols']}")
    if "device_scale" in r:
        lines.append(f"  device scale {json.dumps(r['device_scale'])}")
    if "byte" in r:
        b = r["byte"]
        head = f"  byte {b['offset']} (file offset {b['file_offset']})" + (f", expert {b['expert']}" if "expert" in b else "")
        if b.get("padding"):
            lines.append(head + ": padding (zero; no source)")
        else:
            lines.append(head + f", device element {b['device_element']} <- {json.dumps(b['source'])}")
            if "scale" in b:
                lines.append(f"    scale {json.dumps(b['scale'])}")
    Output(json_).result("\n".join(lines), r)
