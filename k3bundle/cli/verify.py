"""``k3bundle verify``: re-hash a bundle against its manifest; with --source, re-derive it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.provenance.verify import verify as run_verify
from k3bundle.cli._common import JsonOpt, Output, exit_with, progress_bar

EXAMPLES = [
    "k3bundle verify /bundles/k3-b300",
    "k3bundle verify /bundles/k3-b300 --source /ckpt/Kimi-K3 --json",
    "k3bundle verify /bundles/k3-b300 --source /ckpt/Kimi-K3 --workers 8",
]


def verify(
    bundle: Annotated[Path, typer.Argument(help="A bundle directory (written by k3bundle convert).")],
    source: Annotated[Path | None, typer.Option("--source", help="The source checkpoint: re-derive every rank file and reassemble every pass-through tensor.")] = None,
    workers: Annotated[int, typer.Option("--workers", help="With --source: source files re-derived at once (worker processes, as convert).")] = 1,
    json_: JsonOpt = False,
) -> None:
    """Check every bundle file against the manifest; with --source, prove the bundle is what the source gives.

    Exits 0 when everything holds, 1 when something does not (each problem is listed).
    """
    if workers < 1:
        raise typer.BadParameter(f"--workers must be at least 1, got {workers}")
    o = Output(json_)
    with progress_bar("verify", enabled=not json_ and source is not None) as update:
        r = run_verify(bundle, source, progress=update, workers=workers)
    lines = [f"{bundle}: {'OK' if r.ok else 'FAILED'} — {r.files} files ({r.bytes:,} bytes) match the manifest"
             if r.ok else f"{bundle}: FAILED — {len(r.problems)} problem(s) in {r.files} files checked"]
    if r.source_checked:
        lines.append(f"source: {r.source_files} source files re-hashed, {r.rederived_files} rank files re-derived "
                     f"byte for byte, {r.reassembled_tensors} pass-through tensors reassembled from "
                     f"{r.reassembled_slices} rank slices")
    lines += [f"  {p}" for p in r.problems]
    o.result("\n".join(lines), {"bundle": str(bundle), "ok": r.ok, "files": r.files, "bytes": r.bytes,
                                "source_checked": r.source_checked, "source_files": r.source_files,
                                "rederived_files": r.rederived_files, "reassembled_tensors": r.reassembled_tensors,
                                "reassembled_slices": r.reassembled_slices, "problems": r.problems})
    exit_with(0 if r.ok else 1)
