"""``k3bundle perf``: a serving workload swept over concurrency against an endpoint, held to the roofline."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from k3bundle.cli._common import ConfigOpt, JsonOpt, Output
from k3bundle.cli._target import (ApiKeyOpt, BundleArg, DeviceOpt, EndpointOpt, ModelOpt, check_one, connect,
                                  endpoint_url, report_dir, require_client)
from k3bundle.endpoint.errors import EndpointError
from k3bundle.endpoint.workloads import load_workload

EXAMPLES = [
    "k3bundle perf --endpoint http://127.0.0.1:8000/v1 --workload 1k-1k --scale 0.01 --concurrency 1,2 --out /tmp/perf",
    "k3bundle perf --endpoint http://gpu-host:8000/v1 --workload agentic --concurrency 1,4,16,64 --target b300-tp8 "
    "--bundle /bundles/k3-b300",
    "k3bundle perf /bundles/k3-b300 --device cuda --workload 1k-1k --concurrency 1,2",
    "k3bundle perf --endpoint http://gpu-host:8000 --workload 8k-1k --target b300-tp8 --draft-tokens 3 --out perf",
]


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise EndpointError(f"--concurrency {text!r}: give positive integers separated by commas, e.g. 1,2,4")
    return levels


def perf(
    workload: Annotated[str, typer.Option(help="A shipped workload (agentic, 8k-1k, 1k-1k) or a workload YAML file.")],
    source: BundleArg = None,
    endpoint: EndpointOpt = None,
    device: DeviceOpt = "cpu",
    concurrency: Annotated[str, typer.Option(help="Concurrency levels, comma-separated.")] = "1,2,4",
    target: Annotated[str | None, typer.Option(help="The layout whose roofline bounds the figures (a name or a "
                                                    "layout YAML); none: no ratios.")] = None,
    bundle: Annotated[Path | None, typer.Option(help="The bundle being served: its model for the bound, and the "
                                                     "report goes to its reports/ (where the checklist reads it).")] = None,
    config: ConfigOpt = None,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Report folder (default: BUNDLE/reports).")] = None,
    scale: Annotated[float | None, typer.Option(help="Multiply the workload's token counts and turns (default: "
                                                     "the file's scale).")] = None,
    draft_tokens: Annotated[int | None, typer.Option(help="Tokens the engine drafts per step, where it does not "
                                                          "report speculative decoding at /metrics.")] = None,
    model: ModelOpt = None,
    api_key: ApiKeyOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Run the workload at each concurrency: TTFT and TPOT P50/P99, throughput, each over its roofline bound;
    writes performance.json (the checklist's evidence) and performance.html. Exit 0, or 2 on bad input or an
    unreachable endpoint."""
    o = Output(json_)
    require_client("perf")
    from k3bundle.endpoint.perf import sweep
    from k3bundle.endpoint.perf_report import to_json, write_report

    check_one("perf", endpoint, source)
    levels = _levels(concurrency)
    bundle = bundle if bundle is not None else source
    if draft_tokens is not None and draft_tokens < 1:
        raise EndpointError(f"--draft-tokens must be at least 1, got {draft_tokens}")
    out = report_dir(out, bundle)
    w = load_workload(workload).scaled(scale)
    bounds = None
    if target is not None:  # the plan's imports (torch among them) only when there is a bound to take
        from k3bundle.checklist.build import performance_bounds

        bounds = performance_bounds(target, config=config, bundle=bundle)
    say = lambda s: sys.stderr.write(s + "\n")  # noqa: E731
    with endpoint_url(endpoint, source, device, say) as url:
        ep = connect(url, model, api_key)
        result = sweep(ep, w, levels, bounds, draft_tokens, say=say)
    doc = to_json(ep.base_url, ep.model, w, target, result)
    j, h = write_report(doc, result, out)
    lines = []
    for lv in result:
        s, b = lv.stats, lv.bounds
        vs = (f"; {b['ttft_p50_ratio']:,.1f}× / {b['tpot_p50_ratio']:,.1f}× the bound" if "tpot_p50_ratio" in b else "")
        lines.append(f"concurrency {lv.concurrency}: TTFT P50 {s['ttft_p50_s']:.3f} s P99 {s['ttft_p99_s']:.3f} s, "
                     f"TPOT P50 {s['tpot_p50_s'] * 1e3:.2f} ms P99 {s['tpot_p99_s'] * 1e3:.2f} ms, "
                     f"{s['request_throughput_per_s']:.3g} req/s, {s['output_throughput_tokens_per_s']:.4g} tok/s{vs}")
    lines.append(f"perf: {w.name} at scale {w.scale:g}, {len(result)} level(s); report {j}, {h}")
    o.result("\n".join(lines), {"report": [str(j), str(h)], "runs": doc["runs"], "workload": doc["workload"]})
