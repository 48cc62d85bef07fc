"""``k3bundle run``: run the built-in executor on a source checkpoint or a bundle (greedy decode)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from k3bundle.cli._common import JsonOpt, Output
from k3bundle.bundle.open_weights import open_weights
from k3bundle.executor import POLICIES, Executor, ExecutorError

EXAMPLES = [
    "k3bundle run /tmp/k3-tiny --ids 1,2,3",
    "k3bundle run /tmp/k3-tiny --ids 1,2,3 --steps 8 --dtype float64 --out /tmp/logits.npz",
    "k3bundle run /data/k3-small --ids 5,6,7 --dtype bfloat16 --device cuda --json",
]
TOP = 5


def _parse_ids(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ExecutorError("--ids: give at least one token id, e.g. --ids 1,2,3")
    try:
        return [int(p) for p in parts]
    except ValueError:
        bad = next(p for p in parts if not p.lstrip("-").isdigit())
        raise ExecutorError(f"--ids: {bad!r} is not an integer token id (use e.g. --ids 1,2,3)") from None


def run(
    source: Annotated[Path, typer.Argument(help="Source checkpoint directory (config.json + safetensors shards) "
                                                  "or a bundle (its ranks merged).")],
    ids: Annotated[str, typer.Option("--ids", help="Prompt token ids, comma-separated.")],
    steps: Annotated[int, typer.Option(help="Greedy tokens to generate after the prompt.")] = 4,
    dtype: Annotated[str, typer.Option(help="float32 (golden), bfloat16 (device emulation) or float64.")] = "float32",
    device: Annotated[str, typer.Option(help="Any torch device: cpu, cuda, cuda:1, ...")] = "cpu",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write prefill logits and the continuation (.npz).")] = None,
    resident: Annotated[bool, typer.Option(help="Keep every layer's weights after first use (small models).")] = False,
    json_: JsonOpt = False,
) -> None:
    """Prefill the prompt, decode greedily, print the top tokens of every step."""
    out_ = Output(json_)
    if dtype not in POLICIES:
        raise ExecutorError(f"--dtype {dtype!r} is not one of {', '.join(POLICIES)}")
    if steps < 0:
        raise ExecutorError(f"--steps must be >= 0, got {steps}")
    prompt = _parse_ids(ids)
    weights = open_weights(source, dtype, device, resident=resident)
    gen = Executor(weights).generate(prompt, steps)

    rows = gen.step_logits if steps else gen.prefill_logits[-1:]
    table, lines = [], [f"{source}: {len(prompt)} prompt tokens, dtype {dtype}, device {weights.device}"]
    for i, row in enumerate(rows):
        vals, idx = row.float().topk(TOP)
        top = [[int(t), round(float(v), 4)] for t, v in zip(idx, vals)]
        token = gen.tokens[i] if i < len(gen.tokens) else None
        table.append({"step": i, "position": len(prompt) - 1 + i, "token": token, "top": top})
        shown = "  ".join(f"{t}:{v:.3f}" for t, v in top)
        lines.append(f"step {i} (pos {len(prompt) - 1 + i}): {'-' if token is None else token:>6}  top {shown}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:  # np.savez on a handle keeps the exact name (no ".npz" added)
            np.savez(f, prompt_ids=np.asarray(prompt, dtype=np.int64),
                     prefill_logits=gen.prefill_logits.cpu().numpy(),  # FP32 (FP64 for --dtype float64)
                     tokens=np.asarray(gen.tokens, dtype=np.int64),
                     step_logits=gen.step_logits.cpu().numpy(),
                     dtype=np.asarray(dtype))
        lines.append(f"wrote {out}: prefill_logits {tuple(gen.prefill_logits.shape)}, tokens {gen.tokens}")
    out_.result("\n".join(lines), {"source": str(source), "prompt_ids": prompt, "dtype": dtype,
                                   "device": str(weights.device), "tokens": gen.tokens, "steps": table,
                                   "out": str(out) if out else None})
