"""``k3bundle demo``: the whole chain on the embedded tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import JsonOpt, Output, exit_with

EXAMPLES = ["k3bundle demo", "k3bundle demo --out /tmp/k3-demo --force"]


def demo(
    out: Annotated[Path, typer.Option("--out", "-o", help="Working directory for every artifact.")] = Path("k3bundle-demo"),
    force: Annotated[bool, typer.Option(help="Replace an existing demo directory.")] = False,
    long_tokens: Annotated[int, typer.Option(help="Length of the long-context golden case in the demo.")] = 1024,
    device: Annotated[str, typer.Option(help="Torch device for golden and validate: cpu, cuda, ...")] = "cpu",
    json_: JsonOpt = False,
) -> None:
    """synth tiny-trained → pull → plan → convert b300-tp8 → verify → golden → validate → checklist."""
    from k3bundle.demo import run_demo

    o = Output(json_)

    def say(s):
        o.info(f"[{s.seconds:5.1f} s] {s.name:<9} {s.detail}\n            -> {s.artifact}")

    r = run_demo(out, long_tokens=long_tokens, force=force, say=say, device=device)
    total = sum(s.seconds for s in r.steps)
    o.result(f"demo {'PASSED' if r.passed else 'FAILED'} in {total:.1f} s; everything is under {r.out}",
             {"out": str(r.out), "passed": r.passed, "seconds": round(total, 2),
              "steps": [s.__dict__ for s in r.steps]})
    exit_with(0 if r.passed else 1)
