"""``k3bundle synth``: write a synthetic, release-faithful checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output, progress_bar
from k3bundle.synth import write_synthetic

EXAMPLES = [
    "k3bundle synth --preset tiny --out /tmp/k3-tiny",
    "k3bundle synth --preset small --out /data/k3-small --seed 7",
]


def synth(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write (must not exist unless --force).")],
    preset: Annotated[str, typer.Option(help="tiny (random, seconds), tiny-trained (the shipped trained tiny: demo, validate tests) small (~1 GB, benchmarks) full-depth (the release's 497,220 tensors and 96 shards at narrow widths, ~1.2 GB: scale tests) or full-width (the release's widths at 4 layers and 32 experts, ~7 GB: real kernels at real shapes).")] = "tiny",
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives byte-identical files.")] = 0,
    force: Annotated[bool, typer.Option(help="Replace an existing output directory.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Write a synthetic Kimi K3 checkpoint: release names, dtypes, shards and MXFP4 experts, toy size."""
    out_ = Output(json_)
    with progress_bar(f"synth {preset}", enabled=not json_) as update:
        r = write_synthetic(out, preset=preset, seed=seed, force=force, progress=update)
    out_.result(
        f"wrote {r.out}: preset {r.preset}, seed {r.seed}, {len(r.files)} files, "
        f"{r.tensors} tensors, {r.total_size:,} tensor bytes",
        {"out": str(r.out), "preset": r.preset, "seed": r.seed, "files": r.files,
         "tensors": r.tensors, "total_size": r.total_size},
    )
