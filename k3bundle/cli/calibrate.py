"""``k3bundle calibrate``: measure a device's clean noise and its fault detection; write the
tolerance file that judges it (``validate --tolerances FILE``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.calibrate.faults import FAULTS
from k3bundle.calibrate.run import calibrate as run_calibration
from k3bundle.cli._common import JsonOpt, Output, exit_with
from k3bundle.validate.margin import show

EXAMPLES = [
    "k3bundle calibrate --out /tmp/cal --preset tiny-trained:0-4 --preset tiny:0-4 --layout b300-tp8",
    "k3bundle calibrate --out /data/cal-h100 --device cuda --preset tiny-trained:0-9 --layout b300-tp8 --workers 4",
    "k3bundle calibrate --out /data/cal-fla --device cuda --backend fla --preset tiny-trained:0-4 --layout b300-tp8",
    "k3bundle validate /data/k3-bundle --device cuda --tolerances /data/cal-h100/tolerances.yaml",
]


def _progress(line: str) -> None:
    """Progress lines go to stderr, with --json too: long work says where it is."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def calibrate(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for records.jsonl (appended as each case is judged; a rerun runs only what it lacks) and the calibrated tolerances.yaml.")],
    preset: Annotated[list[str], typer.Option("--preset", metavar="PRESET[:SEEDS]", help="Synthetic model and seeds, repeatable: tiny-trained:0-4 (the seed draws the prompts), tiny:0,2 (the seed draws the weights).")],
    layout: Annotated[list[str], typer.Option("--layout", metavar="LAYOUT", help="Layout to convert each model with, repeatable (b300-tp8, mi355x-tp8, ... or a .yaml).")],
    device: Annotated[str, typer.Option(help="Torch device under calibration: cpu, cuda, cuda:1, ...")] = "cpu",
    backend: Annotated[str | None, typer.Option("--backend", help="Kernel backend the device runs (fla, torch, a module; docs/kernels.md); every run, clean and faulted, uses it.")] = None,
    faults: Annotated[str, typer.Option("--faults", metavar="all|none|NAME[,NAME...]", help="Faults of the catalogue to plant (docs/validation.md \"The fault catalogue\"): " + ", ".join(FAULTS) + ".")] = "all",
    tolerances: Annotated[str | None, typer.Option("--tolerances", help="Tolerance file to calibrate: bf16, fp8, mxfp4 or a .yaml (default: the layouts' shipped file). Its limits are kept, widened where this device's clean runs need it.")] = None,
    cases: Annotated[Path | None, typer.Option(help="Folder of golden case files (default: the shipped golden/cases).")] = None,
    long_tokens: Annotated[int, typer.Option(help="Length of the long-context case.")] = 512,
    workers: Annotated[int, typer.Option(help="Jobs run in parallel (processes).")] = 1,
    threads: Annotated[int, typer.Option(help="Torch threads per job.")] = 2,
    golden_device: Annotated[str, typer.Option(help="Where the float32 goldens are made.")] = "cpu",
    run: Annotated[str | None, typer.Option(help="Text recorded as the calibration's run (default: what was run).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Judge clean bundles and the fault catalogue on a device; write a tolerance file with its calibration section (clean worst, least severe located fault, rates). Exit 0: every fault located and every check separates clean from faulted; 1: the file is written but not so; 2: bad input.

    Each job (preset, seed, layout) synthesises a model, converts it, makes float32 goldens, judges every case of the clean bundle, then each fault's case on a faulted copy of it (or on the clean bundle with the device side done wrong). A tiny job takes a few minutes on 2 CPU cores; progress goes to stderr."""
    names = None if faults == "all" else [] if faults == "none" else [n for n in faults.split(",") if n]
    say = Output(json_)
    cal = run_calibration(out, preset, layout, device=device, backend=backend, faults=names, tolerances=tolerances,
                          long_tokens=long_tokens, cases=cases, workers=workers, threads=threads,
                          golden_device=golden_device, run=run, progress=_progress)
    r = cal.rates
    lines = [f"wrote {cal.tolerance_file} (records: {cal.records})",
             f"  clean: {r['clean_bundles']} bundle(s), {r['clean_cases']} case(s), "
             f"{r['clean_bundle_failures']} bundle(s) failing under the base limits"]
    for name, v in sorted(r["faults"].items()):
        miss = cal.not_located.get(name)
        lines.append(f"  fault {name:<22} {v['located']}/{v['runs']} located, {v['detected']}/{v['runs']} detected"
                     + (f" — {miss}" if miss else ""))
    for key, (old, new) in cal.widened.items():
        m = key.rsplit("/", 1)[1]
        lines.append(f"  widened {key}: {show(m, old)} -> {show(m, new)}")
    for key in cal.not_separated:
        lines.append(f"  not separated: {key}: the widened limit passes the least severe fault located there")
    lines.append(f"use it: k3bundle validate BUNDLE --device {device} --tolerances {cal.tolerance_file}")
    say.result("\n".join(lines), {"tolerance_file": str(cal.tolerance_file), "records": str(cal.records),
                                  "rates": r, "widened": cal.widened, "not_separated": cal.not_separated,
                                  "not_located": cal.not_located})
    exit_with(cal.exit_code)
