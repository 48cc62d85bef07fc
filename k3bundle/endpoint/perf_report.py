"""``k3bundle perf``'s reports: ``performance.json`` (the checklist's evidence, docs/bring-up.md)
and ``performance.html`` (tables and charts of the sweep). Both are rendered before either is
written, each written atomically: a run that stops early leaves no report.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from k3bundle.endpoint.errors import EndpointError
from k3bundle.endpoint.perf import NOT_REPORTED, Level
from k3bundle.endpoint.workloads import Workload
from k3bundle.io.files import write_atomic
from k3bundle.pages.html import COLOURS, esc, meta, page, sci, table
from k3bundle.pages.svg import Axis, Series, line_chart, y_range

PERFORMANCE_KIND = "k3bundle.performance"  # the kind the checklist reads (checklist.stages)
SCHEMA_VERSION = 1
JSON_NAME, HTML_NAME = "performance.json", "performance.html"


def to_json(endpoint: str, model: str, w: Workload, target: str | None, levels: Sequence[Level]) -> dict:
    """The report: ``runs`` in the checklist's format (one per level: batch, context, P50 TPOT and
    TTFT, plus the P99s, throughputs and ``ttft_batch``), and every level in full."""
    runs = []
    for lv in levels:
        s = lv.stats
        if s["tpot_p50_s"] is None:
            raise EndpointError(f"concurrency {lv.concurrency}: no request streamed 2 or more tokens, so there is no "
                                "TPOT; does the endpoint honour max_tokens and ignore_eos?")
        runs.append({"batch": lv.concurrency, "ttft_batch": 1, "context": max(1, round(s["prompt_tokens_median"])),
                     "tpot_s": s["tpot_p50_s"], "ttft_s": s["ttft_p50_s"], "tpot_p99_s": s["tpot_p99_s"],
                     "ttft_p99_s": s["ttft_p99_s"], "request_throughput_per_s": s["request_throughput_per_s"],
                     "output_throughput_tokens_per_s": s["output_throughput_tokens_per_s"], "workload": w.name,
                     "requests": s["requests"]})
    return {"kind": PERFORMANCE_KIND, "schema_version": SCHEMA_VERSION, "written_by": "k3bundle perf",
            "endpoint": endpoint, "model": model, "target": target, "workload": w.to_dict(), "runs": runs,
            "levels": [lv.to_dict() for lv in levels]}


def _chart(levels: Sequence[Level], title: str, unit: str, series: list[tuple[str, list[float | None], str, str, str]],
           log: bool = True) -> str:
    xs = [lv.concurrency for lv in levels]
    ss = [Series(name, [(x, v) for x, v in zip(xs, vals) if v is not None], colour, dash, marker)
          for name, vals, colour, dash, marker in series if any(v is not None for v in vals)]
    lo, hi = y_range([v for s in ss for _, v in s.points], [], log)
    x = Axis(min(xs) - 0.5 if len(xs) == 1 else min(xs), max(xs) + 0.5 if len(xs) == 1 else max(xs),
             label="concurrency (clients at once)", ticks=[(c, [str(c)]) for c in xs])
    svg = line_chart(ss, x, Axis(lo, hi, log=log, label=unit), title=title, h=300)
    return f"<figure class='chart'>{svg}<figcaption>{esc(title)}</figcaption></figure>"


def _spec_cell(spec) -> str:
    if not isinstance(spec, dict):
        return esc(spec)
    return esc(f"{spec['tokens_per_step']:.2f} tokens/step, acceptance {spec['acceptance_rate']:.0%}, "
               f"{spec['tpot_per_step_s'] * 1e3:.2f} ms/step, {spec['tpot_per_drafted_token_s'] * 1e3:.2f} ms/drafted "
               f"({spec['source']})")


def to_html(doc: dict, levels: Sequence[Level]) -> str:
    w = doc["workload"]
    ms = lambda v: "–" if v is None else f"{v * 1e3:.2f} ms"  # noqa: E731
    ratio = lambda v: "–" if v is None else f"{v:,.1f}×"  # noqa: E731
    rows = []
    for lv in levels:
        s, b = lv.stats, lv.bounds
        rows.append([str(lv.concurrency), str(s["requests"]), f"{s['prompt_tokens_median']:,.0f}",
                     f"{s['ttft_p50_s']:.3f} s", f"{s['ttft_p99_s']:.3f} s", ms(s["tpot_p50_s"]), ms(s["tpot_p99_s"]),
                     f"{s['request_throughput_per_s']:.3g}", f"{s['output_throughput_tokens_per_s']:.4g}"])
    summary = table(["concurrency", "requests", "prompt tokens (median)", "TTFT P50", "TTFT P99", "TPOT P50",
                     "TPOT P99", "requests/s", "output tokens/s"], rows, num=range(9))
    bound_rows = [[str(lv.concurrency), f"{lv.bounds['context']:,}", sci(lv.bounds["ttft_bound_s"]) + " s",
                   ratio(lv.bounds["ttft_p50_ratio"]), ratio(lv.bounds["ttft_p99_ratio"]),
                   sci(lv.bounds["tpot_bound_s"]) + " s", ratio(lv.bounds.get("tpot_p50_ratio")),
                   ratio(lv.bounds.get("tpot_p99_ratio")), sci(lv.bounds["output_throughput_bound_tokens_per_s"]),
                   sci(lv.bounds.get("output_throughput_ratio"))] for lv in levels if lv.bounds]
    spec_rows = [[str(lv.concurrency), _spec_cell(lv.spec)] for lv in levels]
    target = doc.get("target")
    roof = (f"<h2>Against the roofline of <code>{esc(target)}</code></h2>"
            "<p>Each measured figure over the checklist's lower bound for this target (docs/bring-up.md "
            "\"Roofline\"): TPOT at batch = concurrency, TTFT at batch 1 (a request's first token needs only its own "
            "prompt), both at the median prompt length. A ratio of 1× would be the hardware's limit; below 1× the "
            "measurement is broken.</p>"
            + table(["concurrency", "context", "TTFT ≥", "P50 /", "P99 /", "TPOT ≥", "P50 /", "P99 /",
                     "tokens/s ≤", "measured /"], bound_rows, num=range(10))
            if bound_rows else "<h2>Roofline</h2><p class='muted'>No --target given: no bound to hold the figures "
                               "against.</p>")
    per = lambda key: [lv.stats[key] for lv in levels]  # noqa: E731
    bnd = lambda key: [lv.bounds.get(key) for lv in levels]  # noqa: E731
    charts = [
        _chart(levels, "Time to first token per request: P50, P99 and the roofline bound", "seconds (log)",
               [("TTFT P50", per("ttft_p50_s"), COLOURS["added"], "", "circle"),
                ("TTFT P99", per("ttft_p99_s"), COLOURS["inherited"], "6 3", "square"),
                ("bound", bnd("ttft_bound_s"), COLOURS["limit"], "2 3", "diamond")]),
        _chart(levels, "Time per output token: P50, P99 and the roofline bound", "seconds (log)",
               [("TPOT P50", per("tpot_p50_s"), COLOURS["added"], "", "circle"),
                ("TPOT P99", per("tpot_p99_s"), COLOURS["inherited"], "6 3", "square"),
                ("bound", bnd("tpot_bound_s"), COLOURS["limit"], "2 3", "diamond")]),
        _chart(levels, "Output-token throughput over all requests in flight", "tokens/s",
               [("output tokens/s", per("output_throughput_tokens_per_s"), COLOURS["router"], "", "circle")], log=False),
    ]
    spec_note = ("<h3>Speculative decoding</h3>" + table(["concurrency", "per step, per drafted token, acceptance"],
                                                         spec_rows, num=(0,))
                 if any(isinstance(lv.spec, dict) for lv in levels) else
                 f"<p class='muted'>Speculative decoding: {esc(NOT_REPORTED)} (no spec_decode counters at /metrics "
                 "and no --draft-tokens).</p>")
    head = [f"<h1>Performance: {esc(w['name'])}</h1>",
            f"<p class='sub'>{esc(w['description'])}</p>",
            meta([("endpoint", f"<code>{esc(doc['endpoint'])}</code>"), ("model", esc(doc["model"])),
                  ("target", esc(target or "none (no roofline)")),
                  ("workload", esc(f"{w['file']}, scale {w['scale']:g}: {w['input_tokens']:,} input tokens (median "
                                   f"over turns), {w['output_tokens']:,} output, {w['turns']} turn(s) per session "
                                   f"(first {w['first_turn_input_tokens']:,}, +{w['step_tokens']:,} per turn), "
                                   f"{w['sessions_per_client']} session(s) per client, prompts as {w['prompt']}")),
                  ("measured", "streamed /v1/completions, greedy, ignore_eos; TTFT: send to first output chunk; TPOT: "
                               "first to last chunk over the tokens after the first; throughput over each level's "
                               "wall time")])]
    body = "\n".join(head + ["<h2>Per concurrency level</h2>", summary, spec_note, *charts, roof])
    return page(f"Performance: {w['name']}", body)


def write_report(doc: dict, levels: Sequence[Level], out: Path) -> tuple[Path, Path]:
    files = {out / JSON_NAME: json.dumps(doc, indent=2, ensure_ascii=False) + "\n", out / HTML_NAME: to_html(doc, levels)}
    out.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        write_atomic(path, text)
    return out / JSON_NAME, out / HTML_NAME
