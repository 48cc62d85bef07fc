"""``k3bundle soak``: golden requests replayed against an endpoint for minutes or hours (docs/endpoint.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.checklist.faults import SOAK_HOST_GROWTH_LIMIT_BYTES
from k3bundle.checklist.stages import EVIDENCE_SCHEMA_VERSION, SOAK_KIND
from k3bundle.cli._common import JsonOpt, Output, exit_with
from k3bundle.cli._target import (ApiKeyOpt, BundleArg, CasesOpt, DeviceOpt, EndpointOpt, ModelOpt, WatchdogOpt,
                                  check_one, connect, endpoint_url, named_requests, report_dir, require_client)
from k3bundle.endpoint import EndpointError, metrics_text
from k3bundle.golden.cases import load_cases

EXAMPLES = [
    "k3bundle soak --endpoint http://127.0.0.1:8000/v1 --minutes 10 --out /tmp/soak",
    "k3bundle soak /data/k3-bundle --device cuda --minutes 30",
    "k3bundle soak --endpoint http://gpu-host:8000/v1 --hours 24 --server-pid 4242 --out /data/k3-bundle/reports",
]


def host_memory_of(pid: int):
    """RssAnon + VmSwap of ``pid`` from /proc (the checklist's host-memory measure), or None once it is gone."""
    path = Path(f"/proc/{pid}/status")

    def read() -> int | None:
        try:
            fields = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
        except OSError:
            return None
        kb = [int(fields[k].split()[0]) for k in ("RssAnon", "VmSwap") if k in fields]
        return sum(kb) * 1024 if kb else None

    if read() is None:
        raise EndpointError(f"--server-pid {pid}: no {path} to read (not a running local process on Linux)")
    return read


def soak(
    source: BundleArg = None,
    endpoint: EndpointOpt = None,
    device: DeviceOpt = "cpu",
    minutes: Annotated[float | None, typer.Option(help="Run for this many minutes.")] = None,
    hours: Annotated[float | None, typer.Option(help="Run for this many hours (the sign-off needs 24-72).")] = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Report folder: soak.json and soak.md (default: "
                                                                 "BUNDLE/reports, where the checklist reads it; "
                                                                 "with --endpoint, ./reports).")] = None,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option(help="Completion tokens per request.")] = 64,
    timeout: WatchdogOpt = 120.0,
    server_pid: Annotated[int | None, typer.Option(help="The local server's process id: its host memory is "
                                                        "sampled from /proc.")] = None,
    metrics: Annotated[str | None, typer.Option(help="Prometheus metrics URL (default: the endpoint's /metrics, "
                                                     "where it has one).")] = None,
    case: Annotated[list[str] | None, typer.Option("--case", help="Only this golden case (repeatable).")] = None,
    cases: CasesOpt = None,
    api_key: ApiKeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Replay the golden cases greedily; exit 0 pass, 1 a named failure, 130 interrupted, 2 bad input or unreachable."""
    o = Output(json_)
    require_client("soak")
    from k3bundle.endpoint import soak_report
    from k3bundle.endpoint.replay import golden_requests

    check_one("soak", endpoint, source)
    out = report_dir(out, source, Path("reports"))
    if (minutes is None) == (hours is None):
        raise EndpointError("give one of --minutes M or --hours H")
    duration = (minutes or 0) * 60 + (hours or 0) * 3600
    if duration <= 0 or max_tokens < 1 or timeout <= 0:
        raise EndpointError("--minutes/--hours, --max-tokens and --timeout must be positive")
    requests, skipped = golden_requests(load_cases(cases))
    requests = named_requests(requests, case, "soak")
    say = lambda s: sys.stderr.write(s + "\n")  # noqa: E731
    with endpoint_url(endpoint, source, device, say) as url:
        run, ep = _soak(url, requests, duration, model, api_key, max_tokens, timeout,
                        # served here: the server's host memory is this process's own
                        os.getpid() if source is not None and server_pid is None else server_pid, metrics, say)
    doc = soak_report.to_json(run, kind=SOAK_KIND, schema_version=EVIDENCE_SCHEMA_VERSION, endpoint=ep.base_url,
                              model=ep.model, max_tokens=max_tokens, timeout_s=timeout, skipped=skipped,
                              host_limit_bytes=SOAK_HOST_GROWTH_LIMIT_BYTES, per_pass=len(requests))
    j, m = soak_report.write(doc, out)
    lines = [f"  {f['kind']}: {f['request']}: {f['detail']}" for f in doc["failures"]]
    lines.append(f"soak: {doc['verdict']} ({doc['requests']} requests in {doc['hours'] * 60:.1f} min); report {j}, {m}")
    o.result("\n".join(lines), {**doc, "report": [str(j), str(m)]})
    exit_with({"PASS": 0, "FAIL": 1}.get(doc["verdict"], 130))


def _soak(url, requests, duration, model, api_key, max_tokens, timeout, server_pid, metrics, say):
    """The run against ``url``: (the soak's run, the endpoint)."""
    from k3bundle.endpoint import soak as S

    ep = connect(url, model, api_key)  # before the clock starts
    memory = host_memory_of(server_pid) if server_pid is not None else None
    murl = metrics or ep.base_url.removesuffix("/v1") + "/metrics"
    scrape = (lambda: metrics_text.scrape(murl)) if metrics_text.scrape(murl) is not None else None
    if metrics is not None and scrape is None:
        raise EndpointError(f"--metrics {metrics}: no Prometheus metrics there")
    say(f"soak: {len(requests)} requests per pass against {ep.base_url} ({ep.model}) for {duration / 60:g} min"
        + (f", metrics {murl}" if scrape else ", no /metrics"))
    run = S.run(ep, requests, duration, max_tokens=max_tokens, timeout_s=timeout, host_memory=memory,
                metrics=scrape, host_limit_bytes=SOAK_HOST_GROWTH_LIMIT_BYTES, say=say)
    return run, ep
