"""``k3bundle convert``: stream a checkpoint into a per-device bundle for one target layout."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output, progress_bar
from k3bundle.convert import convert as run_convert

EXAMPLES = [
    "k3bundle convert /ckpt/Kimi-K3 --target b300-tp8 --out /bundles/k3-b300 --workers 8",
    "k3bundle convert /tmp/k3-tiny --target h200-tp16-ep16 --out /tmp/k3-tiny-h200",
    "k3bundle convert /ckpt/Kimi-K3 --target b300-tp8 --out /bundles/k3-b300   # rerun after a kill: resumes",
]


def convert(
    source: Annotated[Path, typer.Argument(help="Checkpoint directory (k3bundle pull output, or any release-layout copy).")],
    target: Annotated[str, typer.Option("--target", "-t", help="Layout name (layouts/NAME.yaml) or a path to a layout YAML.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Bundle directory: new, empty, or a partial run of the same plan.")],
    workers: Annotated[int, typer.Option(help="Worker processes (one source file each); the output does not depend on it.")] = 1,
    force: Annotated[bool, typer.Option(help="Replace an existing bundle (or another plan's partial run) in --out.")] = False,
    json_: JsonOpt = False,
) -> None:
    """Convert a checkpoint into a bundle: per-rank safetensors, index, graph manifest, manifest (written last)."""
    o = Output(json_)
    with progress_bar(f"convert -> {target}", enabled=not json_) as update:
        r = run_convert(source, target, out, workers=workers, force=force, progress=update)
    rate = r.source_bytes / r.seconds / 1e6 if r.seconds else 0.0
    reused = f"; {r.units_reused} of {r.units} source files reused after re-verification" if r.units_reused else ""
    nv = f"; {r.nvfp4_requantized_blocks} NVFP4 blocks re-quantized (listed in manifest.json)" \
        if r.nvfp4_requantized_blocks else ""
    o.result(
        f"wrote {r.out}: target {r.target}, {r.world} ranks, {r.files} files, {r.bundle_bytes:,} bytes from "
        f"{r.source_bytes:,} source bytes in {r.seconds:.1f} s ({rate:,.0f} MB/s){reused}{nv}\n"
        f"manifest sha256 {r.manifest_sha256}",
        {"out": str(r.out), "target": r.target, "world": r.world, "files": r.files, "bundle_bytes": r.bundle_bytes,
         "source_bytes": r.source_bytes, "units": r.units, "units_reused": r.units_reused,
         "seconds": round(r.seconds, 3), "nvfp4_requantized_blocks": r.nvfp4_requantized_blocks,
         "manifest_sha256": r.manifest_sha256},
    )
