"""``k3bundle faults``: the fault paths an endpoint can be driven into, run and recorded (docs/endpoint.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.checklist.faults import FAULT_PATHS
from k3bundle.checklist.stages import EVIDENCE_SCHEMA_VERSION, FAULTS_KIND
from k3bundle.cli._common import JsonOpt, Output, exit_with
from k3bundle.cli._target import (ApiKeyOpt, BundleArg, CasesOpt, DeviceOpt, EndpointOpt, ModelOpt, WatchdogOpt,
                                  check_one, connect, endpoint_url, named_requests, report_dir, require_client)
from k3bundle.endpoint import EndpointError
from k3bundle.golden.cases import load_cases
from k3bundle.io.files import write_atomic

EXAMPLES = [
    "k3bundle faults --endpoint http://127.0.0.1:8000/v1 --out /tmp/faults",
    "k3bundle faults /data/k3-bundle --device cuda",
    "k3bundle faults --endpoint http://gpu-host:8000/v1 --out /data/k3-bundle/reports",
]
#: where k3bundle itself exercises part of a hardware fault path (run on the bundle, not the endpoint)
LOCAL = {"bad_page": "; k3bundle's own check of the cache and KDA state a server resumes from: "
                     "`k3bundle validate BUNDLE --serving`, and `k3bundle faults BUNDLE` plants a corrupted cache "
                     "page / KDA snapshot there"}


def faults(
    source: BundleArg = None,
    endpoint: EndpointOpt = None,
    device: DeviceOpt = "cpu",
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Report folder: faults.json and faults.md (default: "
                                                                 "BUNDLE/reports, where the checklist reads it; "
                                                                 "with --endpoint, ./reports).")] = None,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Completion tokens of the reference request.")] = 16,
    timeout: WatchdogOpt = 120.0,
    case: Annotated[str, typer.Option(help="The golden case sent as the reference request.")] = "greedy",
    cases: CasesOpt = None,
    api_key: ApiKeyOpt = None,
    rank_faults: Annotated[float | None, typer.Option("--rank-faults", metavar="SECONDS", help="With BUNDLE: also stall, then kill, rank 1 of `validate --ranks distributed` on it with this collective timeout (rank_stall, rank_death), then rerun it clean (docs/validation.md).")] = None,
    json_: JsonOpt = False,
) -> None:
    """Provoke each fault, re-validate after it; exit 0 when none failed, 1 when one did, 2 bad input or unreachable."""
    o = Output(json_)
    require_client("faults")
    from k3bundle.endpoint import faults as F
    from k3bundle.endpoint.replay import golden_requests

    check_one("faults", endpoint, source)
    if rank_faults is not None and source is None:
        raise EndpointError("--rank-faults runs validate --ranks distributed on a bundle: give BUNDLE, not --endpoint")
    out = report_dir(out, source, Path("reports"))
    req = named_requests(golden_requests(load_cases(cases))[0], [case], "faults")[0]
    not_run = [(f.key, f"on the target: {f.inject}; then record the outcome (clear error: {f.clear_error})"
                + LOCAL.get(f.key, "")) for f in FAULT_PATHS]
    say = lambda s: sys.stderr.write(s + "\n")  # noqa: E731
    with endpoint_url(endpoint, source, device, say) as url:
        ep = connect(url, model, api_key)
        results = F.run(ep, req, max_tokens=max_tokens, timeout_s=timeout, not_run=not_run, say=say)
    if source is not None:
        results += cache_faults(source, device, cases, say)
    if rank_faults is not None:
        results += rank_fault_results(source, device, rank_faults, say)
    doc = {"kind": FAULTS_KIND, "schema_version": EVIDENCE_SCHEMA_VERSION, "endpoint": ep.base_url,
           "model": ep.model, "faults": [r.to_dict() for r in results]}
    out.mkdir(parents=True, exist_ok=True)
    j, m = out / "faults.json", out / "faults.md"
    write_atomic(j, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    rows = [f"| {r.fault} | {r.outcome} | {r.revalidated} | {(r.error or r.detail or r.run).replace('|', '/')} |"
            for r in results]
    write_atomic(m, "\n".join([f"# Faults: {ep.base_url} ({ep.model})", "",
                               "| fault | outcome | re-validated | error / how to run |", "|---|---|---|---|"]
                              + rows) + "\n")
    failed = [r for r in results if r.outcome == F.FAILED]
    lines = [f"{r.fault}: {r.outcome}" + (f" — {r.error or r.detail}" if r.outcome != F.NOT_RUN else "")
             for r in results]
    lines.append(f"faults: {'FAIL' if failed else 'no failure'} ({sum(r.outcome != F.NOT_RUN for r in results)} run, "
                 f"{sum(r.outcome == F.NOT_RUN for r in results)} not run); report {j}, {m}")
    o.result("\n".join(lines), {**doc, "report": [str(j), str(m)]})
    exit_with(1 if failed else 0)


def cache_faults(source: Path, device: str, cases: Path | None, say) -> list:
    """A corrupted cache page and KDA snapshot planted on ``source``'s serving path (``validate
    --serving``'s restore checks, in this process): each ``detected`` where the first failing check
    is on the array it corrupts and the clean path passed, else ``failed``."""
    from k3bundle.bundle.open_weights import open_weights
    from k3bundle.endpoint.faults import DETECTED, FAILED, FaultResult
    from k3bundle.validate.devices import DEVICE_POLICY
    from k3bundle.validate.serving_faults import CASE, case_ids, run_planted

    try:
        ids = case_ids(source, cases)
    except ValueError as e:
        raise EndpointError(str(e)) from None
    say(f"faults: corrupted cache page / KDA snapshot planted on the serving path ({CASE}, {DEVICE_POLICY} on {device})")
    out = []
    for x in run_planted(open_weights(source, DEVICE_POLICY, device), ids):
        where = f"layer {x.layer}, {x.tap}" if x.tap else "nowhere"
        out.append(FaultResult(x.key, DETECTED if x.detected else FAILED, error=x.line, revalidated=x.clean_passed,
                               detail=f"{x.title}: first failing check at {where}; the clean save/load "
                                      f"{'passed' if x.clean_passed else 'FAILED'} the same checks; the decode "
                                      f"after it moved by {x.moved:.3g} in the logits"))
    return out


def rank_fault_results(source: Path, device: str, timeout_s: float, say) -> list:
    """Rank 1 of ``validate --ranks distributed`` stalled, then killed (``validate.rank_faults``):
    ``clean_error`` with validate's line naming the rank and the seconds it took to exit."""
    from k3bundle.endpoint.faults import CLEAN, FAILED, FaultResult
    from k3bundle.validate.rank_faults import run_rank_faults

    return [FaultResult(r.key, CLEAN if r.clean else FAILED, error=r.line, revalidated=r.revalidated,
                        detail=f"validate exited {r.seconds:.1f} s after it started (collective timeout "
                               f"{timeout_s:g} s); the clean rerun {'passed' if r.revalidated else 'did NOT pass'}")
            for r in run_rank_faults(source, device, timeout_s, say=say)]
