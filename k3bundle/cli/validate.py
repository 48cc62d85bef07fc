"""``k3bundle validate``: judge a device run against the goldens; write the sign-off report."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from k3bundle.provenance.verify import LEVELS
from k3bundle.cli._common import JsonOpt, Output, exit_with, progress_bar, sigterm_raises
from k3bundle.validate.errors import Terminated
from k3bundle.validate.findings import finding
from k3bundle.validate.report import discard_reports, publish_reports, start_run, to_json
from k3bundle.validate.run import validate as run_validate
from k3bundle.validate.device_options import open_device

EXAMPLES = [
    "k3bundle validate /tmp/k3-bundle",
    "k3bundle validate /data/k3-bundle --device cuda",
    "k3bundle validate /data/k3-bundle --ranks distributed --nproc 2",
    "k3bundle validate /tmp/k3-bundle --serving",
    "k3bundle validate /data/k3-bundle --dumps /data/vllm-dumps",
    "k3bundle validate /data/k3-bundle --dumps /data/vllm-dumps --cases greedy",
    "k3bundle validate /data/k3-bundle --device cuda --tolerances /data/cal-h100/tolerances.yaml",
]


def validate(
    bundle: Annotated[Path, typer.Argument(help="A bundle (or a source checkpoint) with validation/ goldens.")],
    device: Annotated[str, typer.Option(help="Torch device for the built-in executor: cpu, cuda, ...")] = "cpu",
    backend: Annotated[str | None, typer.Option("--backend", help="Run the built-in executor on these kernels (fla, torch, planted:<bug>, a module; docs/kernels.md); teacher-forced checks then locate a kernel bug to its layer.")] = None,
    dumps: Annotated[Path | None, typer.Option(help="Judge intermediates dumped by an external runtime instead (docs/dump-format.md).")] = None,
    ranks: Annotated[str, typer.Option(help="merged: one process reads every rank; distributed: one torch.distributed process per TP/EP rank.")] = "merged",
    nproc: Annotated[int | None, typer.Option(help="Processes for --ranks distributed (default: the layout's TP x EP).")] = None,
    rank_results: Annotated[Path | None, typer.Option(help="With --ranks distributed: judge what `torchrun -m k3bundle.validate.worker` already wrote there (several hosts; docs/validation.md).")] = None,
    collective_timeout: Annotated[float, typer.Option("--collective-timeout", metavar="SECONDS", help="With --ranks distributed: a rank waiting longer than this on a peer gives up, and the run ends naming the rank that stalled or died (exit 2, no verdict).")] = 300.0,
    tolerances: Annotated[str | None, typer.Option("--tolerances", help="Judge by this tolerance file (bf16, fp8, mxfp4, or a .yaml, e.g. the one `k3bundle calibrate` wrote for this device) instead of the goldens' own; the sign-off records its path and sha256.")] = None,
    cases: Annotated[list[str] | None, typer.Option("--cases", metavar="NAME[,NAME...]", help="Judge only these golden cases (comma-separated or repeated: --cases greedy,tool_call); the others are reported 'not run', and a --dumps folder needs only their files.")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Report directory (default BUNDLE/reports/validate/RUN_KEY, RUN_KEY naming what was validated: builtin-cpu, backend-torch-cuda, dumps-NAME, ...; docs/validation.md).")] = None,
    verify: Annotated[str, typer.Option("--verify", help="How the bundle's files are checked against its manifest first: sample (default: every file the run reads, i.e. the weights for the built-in device, plus the metadata and a seeded 2%), full (every byte), manifest (sizes only).")] = "sample",
    verify_seed: Annotated[int, typer.Option("--verify-seed", help="Seed of the --verify sample subset.")] = 0,
    serving: Annotated[bool, typer.Option("--serving", help="Also run the serving paths on the built-in device: prefix-cache resume at a chunk and a turn boundary, a prefill/decode handoff through the cache's bytes to another process, each equal to the uninterrupted run, and the prompt batched with shorter requests, each equal to itself run alone (docs/validation.md 'Serving paths').")] = False,
    json_: JsonOpt = False,
) -> None:
    """Compare per tap, per layer (teacher-forced) and end to end; exit 0 pass, 1 numerical fail, 2 bad input."""
    if verify not in LEVELS:
        raise typer.BadParameter(f"--verify must be one of {', '.join(LEVELS)}, got {verify!r}")
    if ranks not in ("merged", "distributed"):
        raise typer.BadParameter(f"--ranks must be merged or distributed, got {ranks!r}")
    # the reports of this run key (or --out) are gone before this run judges anything
    run = start_run(bundle, out, device=device, ranks=ranks, backend=backend, dumps=dumps)
    try:
        with sigterm_raises(lambda: Terminated("stopped by SIGTERM; no verdict written: rerun validate")):
            dut = open_device(bundle, device=device, ranks=ranks, nproc=nproc, dumps=dumps,
                              rank_results=rank_results, backend=backend, serving=serving,
                              collective_timeout=collective_timeout)
            with progress_bar("validate", enabled=not json_, stages=True) as update:
                rep = run_validate(bundle, dut, progress=update, verify_level=verify, verify_seed=verify_seed,
                                   cases=[n for c in cases or () for n in c.split(",") if n], tolerances=tolerances)
            rep.backend = backend
            files = publish_reports(rep, run, bundle)
    except BaseException:
        discard_reports(run.reports)  # no verdict outlives a run that could not be judged (Ctrl-C, SIGTERM too)
        raise
    lines = [f"{'PASS' if rep.passed else 'FAIL'}: {rep.mode} ({dut.name}) against {rep.tolerances.name} tolerances, "
             f"{rep.seconds:.1f} s"]
    for c in rep.cases:
        if c.status == "not run":
            lines.append(f"  {c.name:<13} not run: {c.reason}")
            continue
        ff = c.first_failure
        where = "" if ff is None else f" — first failure: {finding(ff, c.kernel_ops, rep.kernels)}"
        failed = sum(not r.passed for r in c.results)
        lines.append(f"  {c.name:<13} {c.status.upper():<5} {len(c.results) - failed}/{len(c.results)} checks{where}")
    for c in rep.cases:
        for p in c.serving:
            ff = p.first_failure
            extra = f", {p.nbytes:,} B per request" if p.path == "handoff" and p.nbytes else ""
            where = f" — first failure: {ff.line()}" if ff is not None else (f": {p.reason}" if p.reason else "")
            lines.append(f"  serving {c.name} {p.path} {p.status.upper()}{extra}{where}")
    lines.append(f"bundle files: {rep.integrity}")
    lines.append(f"reports (run {run.key}): " + ", ".join(str(f) for f in files))
    Output(json_).result("\n".join(lines), {**to_json(rep), "reports": [str(f) for f in files]})
    exit_with(rep.exit_code)
