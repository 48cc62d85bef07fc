"""The soak as the checklist reads it: ``soak.json`` (docs/bring-up.md's format), ``soak.md`` and
``soak.html`` (the run over time: latency per request, host memory, the engine's gauges).

The checklist's keys come first (``hours``, ``host_memory_growth_bytes``,
``device_memory_growth_bytes``, ``golden_rechecks``, ``golden_recheck_failures``, ``hangs``);
the rest extends the format: ``complete`` (false for a run stopped early), ``verdict``, the
request counts, every named failure, the latency windows, the memory samples' slopes. What was
not measured is null, never a made-up zero: device memory (the soak has no view of it), golden
re-checks (``k3bundle validate --dumps`` runs them, not the soak).
"""

from __future__ import annotations

import json
from pathlib import Path

from k3bundle.endpoint.soak import SoakRun, after_warmup, host_growth, latency, slope_per_hour, windows
from k3bundle.io.files import write_atomic
from k3bundle.pages.html import COLOURS, esc, meta, page
from k3bundle.pages.svg import Axis, Limit, Series, line_chart, y_range

JSON_NAME, MD_NAME, HTML_NAME = "soak.json", "soak.md", "soak.html"
MAX_POINTS = 2000  # per plotted series: an hours-long run keeps its shape, the report stays small


def thin(points: list, most: int = MAX_POINTS) -> list:
    """At most ``most`` evenly spaced points, the first and the last always kept."""
    if len(points) <= most:
        return list(points)
    step = (len(points) - 1) / (most - 1)
    return [points[round(i * step)] for i in range(most)]


def timeline(run: SoakRun) -> dict:
    """The series the page plots: answered requests as [started_s, ttft_s, tpot_s], memory and
    gauge samples as [s, value]; each thinned to ``MAX_POINTS``."""
    ok = [[s.started_s, s.ttft_s, s.tpot_s] for s in run.sent if s.ok]
    return {"requests": thin(ok), "requests_answered": len(ok),
            "host_memory": thin([list(p) for p in run.memory]),
            "gauges": {k: thin([list(p) for p in v]) for k, v in run.gauges.items()}}


def verdict(run: SoakRun) -> str:
    if run.failures:
        return "FAIL"
    return "PASS" if run.complete else "INCOMPLETE"


def to_json(run: SoakRun, *, kind: str, schema_version: int, endpoint: str, model: str, max_tokens: int,
            timeout_s: float, skipped: dict[str, str], host_limit_bytes: int, per_pass: int) -> dict:
    count = {k: sum(f.kind == k for f in run.failures) for k in ("determinism", "hang", "error", "leak")}
    first, last = windows(run.sent, run.elapsed_s, per_pass)
    lat_first, lat_last = latency(first), latency(last)
    drift = {k: (lat_last[k] / lat_first[k] if lat_first[k] and lat_last[k] else None) for k in ("ttft_s", "tpot_s")}
    gauges = {}
    for name, pts in run.gauges.items():
        late = after_warmup(pts, run.elapsed_s)
        gauges[name] = {"first": pts[0][1], "last": pts[-1][1], "samples": len(pts),
                        "slope_per_hour": slope_per_hour(late)}
    mem = after_warmup(run.memory, run.elapsed_s)
    return {
        "kind": kind, "schema_version": schema_version,
        "hours": run.elapsed_s / 3600.0,
        "host_memory_growth_bytes": host_growth(run),
        "device_memory_growth_bytes": None,
        "golden_rechecks": None, "golden_recheck_failures": None,
        "hangs": count["hang"],
        "complete": run.complete, "verdict": verdict(run),
        "endpoint": endpoint, "model": model, "max_tokens": max_tokens, "timeout_s": timeout_s,
        "passes": run.passes, "requests": len(run.sent), "errors": count["error"],
        "error_rate": count["error"] / len(run.sent) if run.sent else None,
        "determinism_failures": count["determinism"],
        "failures": [f.to_dict() for f in run.failures],
        "latency": {"first_window": lat_first, "last_window": lat_last, "drift": drift},
        "host_memory": {"source": run.memory_source, "samples": len(run.memory),
                        "first_bytes": run.memory[0][1] if run.memory else None,
                        "last_bytes": run.memory[-1][1] if run.memory else None,
                        "slope_bytes_per_hour": slope_per_hour(mem), "limit_bytes": host_limit_bytes},
        "metrics": gauges,
        "skipped_cases": skipped,
        "timeline": timeline(run),
        "reference_outputs": {k: {"token_ids": v.token_ids, "text": v.text, "finish_reason": v.finish_reason}
                              for k, v in run.first.items()},
    }


def _num(v, fmt: str = "{:.4g}") -> str:
    return "–" if v is None else fmt.format(v)


def to_markdown(doc: dict) -> str:
    lat, mem = doc["latency"], doc["host_memory"]
    lines = [f"# Soak: {doc['verdict']}", "",
             f"Endpoint `{doc['endpoint']}`, model `{doc['model']}`, {doc['hours'] * 60:.2f} min "
             f"({'complete' if doc['complete'] else 'interrupted: incomplete'}), {doc['passes']} passes, "
             f"{doc['requests']} requests, max_tokens {doc['max_tokens']}, watchdog {doc['timeout_s']:g} s.", "",
             "| measure | value |", "|---|---|",
             f"| errors | {doc['errors']} (rate {_num(doc['error_rate'])}) |",
             f"| hangs | {doc['hangs']} |",
             f"| determinism failures | {doc['determinism_failures']} |",
             f"| TTFT first / last window (s) | {_num(lat['first_window']['ttft_s'])} / "
             f"{_num(lat['last_window']['ttft_s'])} (x{_num(lat['drift']['ttft_s'], '{:.3f}')}) |",
             f"| TPOT first / last window (s) | {_num(lat['first_window']['tpot_s'])} / "
             f"{_num(lat['last_window']['tpot_s'])} (x{_num(lat['drift']['tpot_s'], '{:.3f}')}) |",
             f"| host memory ({mem['source'] or 'not measured'}) | {_num(mem['first_bytes'], '{:,}')} → "
             f"{_num(mem['last_bytes'], '{:,}')} B, slope {_num(mem['slope_bytes_per_hour'], '{:,.0f}')} B/h, "
             f"fitted growth {_num(doc['host_memory_growth_bytes'], '{:,}')} B (limit {mem['limit_bytes']:,} B) |"]
    for name, g in doc["metrics"].items():
        lines.append(f"| {name} | {g['first']:.4g} → {g['last']:.4g}, slope {_num(g['slope_per_hour'])} /h |")
    if doc["skipped_cases"]:
        lines += ["", "Not sent: " + "; ".join(f"{k} ({v})" for k, v in doc["skipped_cases"].items()) + "."]
    fails = doc["failures"]
    lines += ["", "## Failures", ""] + [f"- {f['kind']}: {f['request']} at {f['at_s']:.1f} s: {f['detail']}"
                                        for f in fails] if fails else ["", "No failures."]
    return "\n".join(lines) + "\n"


def _over_time(title: str, unit: str, series: list[tuple[str, list, str, str]], span_s: float, log: bool,
               limits: list[Limit] = ()) -> str:
    ss = [Series(name, [(p[0], p[1]) for p in pts if p[1] is not None and (p[1] > 0 or not log)], colour, dash)
          for name, pts, colour, dash in series]
    ss = [x for x in ss if x.points]
    if not ss:
        return f"<p class='muted'>{esc(title)}: nothing measured.</p>"
    lo, hi = y_range([v for x in ss for _, v in x.points], [lim.value for lim in limits], log)
    svg = line_chart(ss, Axis(0.0, max(span_s, 1e-9), label="seconds since the soak began"),
                     Axis(lo, hi, log=log, label=unit), limits=list(limits), title=title, h=280)
    return f"<figure class='chart'>{svg}<figcaption>{esc(title)}</figcaption></figure>"


def to_html(doc: dict) -> str:
    """The run over time: every answered request's TTFT and TPOT, host memory, the engine's gauges."""
    tl, span = doc["timeline"], doc["hours"] * 3600.0
    reqs = tl["requests"]
    charts = [
        _over_time("Time to first token and time per output token of every answered request", "seconds (log)",
                   [("TTFT", [[r[0], r[1]] for r in reqs], COLOURS["added"], ""),
                    ("TPOT", [[r[0], r[2]] for r in reqs], COLOURS["inherited"], "6 3")], span, log=True),
        _over_time(f"Host memory ({doc['host_memory']['source'] or 'not measured'})", "MiB",
                   [("resident", [[t, b / 2 ** 20] for t, b in tl["host_memory"]], COLOURS["router"], "")], span,
                   log=False),
    ]
    charts += [_over_time(f"Engine gauge {name} (from /metrics)", name, [(name, pts, COLOURS["added"], "")], span,
                          log=False) for name, pts in tl["gauges"].items()]
    md = to_markdown(doc).split("\n", 2)[2]  # the summary table and failures, without the title
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| measure")]
    summary = meta([(c[0].strip(), esc(c[1].strip())) for c in (r.strip("|").split("|", 1) for r in rows)])
    fails = "".join(f"<li>{esc(f['kind'])}: {esc(f['request'])} at {f['at_s']:.1f} s: {esc(f['detail'])}</li>"
                    for f in doc["failures"]) or "<li>none</li>"
    shown = f"{len(reqs):,} of {tl['requests_answered']:,} answered requests plotted"
    body = "\n".join([f"<h1>Soak: {esc(doc['verdict'])}</h1>",
                       f"<p class='sub'>{esc(doc['endpoint'])}, model {esc(doc['model'])}, "
                       f"{doc['hours'] * 60:.2f} min, {doc['passes']} passes, {doc['requests']} requests "
                       f"({esc(shown)})</p>", summary, "<h2>Failures</h2>", f"<ul>{fails}</ul>",
                       "<h2>Over time</h2>", *charts])
    return page(f"Soak: {doc['verdict']}", body)


def write(doc: dict, out: Path) -> tuple[Path, Path]:
    files = {out / JSON_NAME: json.dumps(doc, indent=2, ensure_ascii=False) + "\n", out / MD_NAME: to_markdown(doc),
             out / HTML_NAME: to_html(doc)}  # all rendered before any is written
    out.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        write_atomic(path, text)
    return out / JSON_NAME, out / MD_NAME
