"""``k3bundle golden``: high-precision golden intermediates over the case suite."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output, progress_bar
from k3bundle.golden.generate import generate_goldens

EXAMPLES = [
    "k3bundle golden /tmp/k3-tiny",
    "k3bundle golden /data/k3-small --dtype float64 --out /data/k3-small-golden",
    "k3bundle golden /ckpt/Kimi-K3 --device cuda --long-tokens 131072",
]


def golden(
    source: Annotated[Path, typer.Argument(help="Checkpoint directory (config.json, shards, tokenizer).")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Output directory (default SOURCE/validation).")] = None,
    cases: Annotated[Path | None, typer.Option(help="Directory of case files (default: the shipped golden/cases).")] = None,
    dtype: Annotated[str, typer.Option(help="float32 (default) or float64 (exact on small models).")] = "float32",
    device: Annotated[str, typer.Option(help="Any torch device: cpu, cuda, ...")] = "cpu",
    tolerances: Annotated[str, typer.Option(help="Tolerance set to copy: bf16, fp8, mxfp4, or a .yaml path.")] = "bf16",
    long_tokens: Annotated[int | None, typer.Option(help="Length of the long-context case (default: the case file's).")] = None,
    noise: Annotated[bool, typer.Option(help="Also run each case in BF16 and store the reference's own BF16 noise, "
                                             "which free-running limits widen to (docs/validation.md); about 1.5x the time.")] = True,
    seed: Annotated[int, typer.Option(help="Seed recorded with the goldens.")] = 0,
    forms: Annotated[str, typer.Option(help="fast (default): the executor's batched exact forms; readable: the "
                                            "equations as written, one chunk and one expert at a time (slower; "
                                            "the same function, docs/executor.md \"Forms\").")] = "fast",
    schedule: Annotated[str, typer.Option(help="case: one case after another; layer: every case together, "
                                               "layer-major, each layer read once per pass for all (streamed "
                                               "weights); auto (default): layer where the weights stream. Same bytes.")] = "auto",
    json_: JsonOpt = False,
) -> None:
    """Run every case teacher-forced and greedy; write golden inputs, intermediates and tolerances."""
    if schedule not in ("auto", "case", "layer"):
        raise typer.BadParameter(f"--schedule must be auto, case or layer, got {schedule!r}")
    if forms not in ("fast", "readable"):
        raise typer.BadParameter(f"--forms must be fast or readable, got {forms!r}")
    if dtype not in ("float32", "float64"):
        raise typer.BadParameter(f"--dtype must be float32 or float64 for goldens, got {dtype!r}")
    with progress_bar("golden", enabled=not json_, stages=True) as update:
        r = generate_goldens(source, out=out, cases_dir=cases, dtype=dtype, device=device,
                             tolerance=tolerances, long_tokens=long_tokens, seed=seed, noise=noise,
                             progress=update, forms=forms, schedule=schedule)
    lines = [f"wrote {r.out}: {r.bytes_intermediates:,} bytes of intermediates, content hash {r.content_hash[:16]}…",
             f"  weights {r.weights}, peak {'GPU memory' if device.startswith('cuda') else 'RSS'} "
             f"{r.peak_device_bytes / 2**30:.2f} GiB"
             + next((f", every case together (layer-major) {c['seconds_all_cases']:.1f} s"
                     for c in r.cases if "seconds_all_cases" in c), "")]
    for c in r.cases:
        if c["status"] == "ok":
            lines.append(f"  {c['name']:<13} {c['kind']:<13} {c['tokens']:>6} tokens, "
                         f"{c['tapped_positions']} tapped positions, {c['steps']} greedy steps"
                         + (f", {c['seconds']:.1f} s" if "seconds" in c else ""))
        else:
            lines.append(f"  {c['name']:<13} {c['kind']:<13} not run: {c['reason']}")
    Output(json_).result("\n".join(lines), {"out": str(r.out), "content_hash": r.content_hash,
                                            "bytes_intermediates": r.bytes_intermediates, "cases": r.cases,
                                            "peak_device_bytes": r.peak_device_bytes, "weights": r.weights})
