"""``k3bundle inspect``: check a checkpoint directory or one safetensors file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output
from k3bundle.errors import SafetensorsError
from k3bundle.io import read_header
from k3bundle.checkpoint import SourceCheckpoint

EXAMPLES = [
    "k3bundle inspect /ckpt/Kimi-K3",
    "k3bundle inspect /ckpt/Kimi-K3/model-00002-of-000096.safetensors --json",
]


def inspect(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory or a .safetensors file.")],
    json_: JsonOpt = False,
) -> None:
    """Validate a checkpoint (config, index, every shard header, the tensor schema) or one file."""
    out = Output(json_)
    if not path.exists():
        raise SafetensorsError(f"{path}: no such file or directory")
    if path.is_dir():
        with SourceCheckpoint(path) as src:
            t = src.schema.totals
            out.result(
                f"{path}: OK — {len(src.index.shards)} shards, {len(src.index.weight_map):,} tensors, "
                f"{src.index.total_size:,} bytes; every name, shape and dtype matches the Kimi K3 schema",
                {"path": str(path), "shards": src.index.shards, "tensors": len(src.index.weight_map),
                 "total_size": src.index.total_size, "schema_tensors": t.tensors},
            )
        return
    h = read_header(path)
    rows = [f"{k}\t{v.dtype}\t{list(v.shape)}\t{v.nbytes}" for k, v in h.tensors.items()]
    out.result(f"{path}: OK — {len(h.tensors)} tensors, {h.buffer_size:,} data bytes\n" + "\n".join(rows),
               {"path": str(path), "tensors": {k: {"dtype": v.dtype, "shape": list(v.shape),
                                                   "nbytes": v.nbytes} for k, v in h.tensors.items()},
                "metadata": h.metadata})
