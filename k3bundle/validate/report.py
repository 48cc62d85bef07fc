"""The sign-off report: ``reports/signoff.json`` (machines), ``.md`` (people), ``.html`` (plots).

Every failure line names the case, mode, tap, metric values and limits, Polygraphy-style; each
case names its first failing layer and tap. The HTML embeds two SVG plots per case (error per
layer, KL divergence by position) and needs no network or JavaScript.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from k3bundle import __version__
from k3bundle.io.files import write_atomic
from k3bundle.validate.errors import ValidateError

SCHEMA_VERSION = 1


def _clean(v):
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return v


def _result(r) -> dict:
    return {"tap": r.tap, "layer": r.layer, "mode": r.mode, "passed": r.passed,
            "values": {k: _clean(v) for k, v in r.values.items()}, "limits": r.limits,
            "min_required": {k: _clean(v) for k, v in r.min_required.items()}}


def to_json(rep) -> dict:
    cases = []
    for c in rep.cases:
        d = {"name": c.name, "kind": c.kind, "status": c.status, "reason": c.reason,
             "layer_checks": c.layer_checks or "ran"}
        if c.status != "not run":
            ff = c.first_failure
            d.update({
                "first_failure": None if ff is None else {"layer": ff.layer, "tap": ff.tap, "mode": ff.mode,
                                                          "line": ff.line()},
                "checks": len(c.results), "failed": sum(not r.passed for r in c.results),
                "greedy": None if c.greedy is None else c.greedy.__dict__,
                "state_drift_max": max((max(v) for v in c.drift.values() if v), default=0.0),
                "state_drift_limit": c.drift_limit,
                "kld_by_position": c.kld_by_position,
                "results": [_result(r) for r in c.results],
            })
        cases.append(d)
    return {"schema_version": SCHEMA_VERSION, "k3bundle_version": __version__, "bundle": rep.bundle,
            "mode": rep.mode, "device": rep.device, "tolerances": rep.tolerances.name,
            "golden_content_hash": rep.golden_meta.get("content_hash"), "passed": rep.passed,
            "exit_code": rep.exit_code, "seconds": round(rep.seconds, 2), "cases": cases}


def _per_layer(c, mode: str) -> dict[int, float]:
    worst: dict[int, float] = {}
    for r in c.results:
        if r.mode == mode and r.layer is not None and "nmse" in r.values:
            worst[r.layer] = max(worst.get(r.layer, 0.0), r.values["nmse"])
    return worst


def to_markdown(rep) -> str:
    verdict = "PASS" if rep.passed else "FAIL"
    lines = [f"# Sign-off: {verdict}", "",
             f"- bundle: `{rep.bundle}`", f"- device under test: {rep.mode} ({rep.device})",
             f"- tolerances: `{rep.tolerances.name}` ({rep.tolerances.path})",
             f"- goldens: content hash `{rep.golden_meta.get('content_hash', '?')[:16]}…`, "
             f"dtype {rep.golden_meta.get('dtype')}, k3bundle {rep.golden_meta.get('k3bundle_version')}",
             f"- k3bundle {__version__}, {rep.seconds:.1f} s", "",
             "| case | kind | status | checks failed | first failing layer / tap | greedy | state drift max |",
             "|---|---|---|---|---|---|---|"]
    for c in rep.cases:
        if c.status == "not run":
            lines.append(f"| {c.name} | {c.kind} | not run | – | {c.reason} | – | – |")
            continue
        ff = c.first_failure
        where = "–" if ff is None else f"layer {ff.layer}: `{ff.tap}` ({ff.mode})"
        g = c.greedy
        greedy = "–" if g is None else (f"{g.matched}/{g.total} equal" + ("" if g.first_divergence is None
                                        else f", first divergence at step {g.first_divergence}"
                                        + (" (near tie)" if g.near_tie else " (NOT a near tie)")))
        drift = max((max(v) for v in c.drift.values() if v), default=0.0)
        failed = sum(not r.passed for r in c.results)
        lines.append(f"| {c.name} | {c.kind} | {c.status.upper()} | {failed}/{len(c.results)} | {where} | "
                     f"{greedy} | {drift:.2e} (limit {c.drift_limit:.1e}) |")
    for c in rep.cases:
        bad = [r for r in c.results if not r.passed]
        if bad or c.layer_checks:
            lines += ["", f"## {c.name}", ""]
            if c.layer_checks:
                lines.append(f"- teacher-forced layer checks skipped: {c.layer_checks}")
            lines += [f"    {r.line()}" for r in bad[:40]]
            if len(bad) > 40:
                lines.append(f"    … and {len(bad) - 40} more failing checks (signoff.json has all)")
    return "\n".join(lines) + "\n"


def _svg_lines(series: dict[str, list[tuple[float, float]]], title: str, log: bool = True,
               w: int = 560, h: int = 220) -> str:
    pts = [p for s in series.values() for p in s]
    if not pts:
        return ""
    f = (lambda v: math.log10(max(v, 1e-30))) if log else (lambda v: v)
    xs, ys = [p[0] for p in pts], [f(p[1]) for p in pts]
    x0, x1 = min(xs), max(xs) or 1
    y0, y1 = min(ys), max(ys)
    y1 = y1 if y1 > y0 else y0 + 1
    sx = lambda x: 50 + (x - x0) / ((x1 - x0) or 1) * (w - 70)
    sy = lambda y: h - 30 - (f(y) - y0) / (y1 - y0) * (h - 50)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img">',
           f'<text x="{w / 2}" y="14" text-anchor="middle" font-size="12">{html.escape(title)}</text>',
           f'<line x1="50" y1="{h - 30}" x2="{w - 20}" y2="{h - 30}" stroke="#999"/>',
           f'<line x1="50" y1="20" x2="50" y2="{h - 30}" stroke="#999"/>',
           f'<text x="4" y="28" font-size="10">{"1e%.0f" % y1 if log else "%.3g" % y1}</text>',
           f'<text x="4" y="{h - 32}" font-size="10">{"1e%.0f" % y0 if log else "%.3g" % y0}</text>']
    for i, (name, s) in enumerate(series.items()):
        c = colors[i % len(colors)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{path}"/>')
        out.append(f'<text x="{w - 150}" y="{30 + 14 * i}" font-size="11" fill="{c}">{html.escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def to_html(rep) -> str:
    md = to_markdown(rep)
    parts = ["<!doctype html><meta charset='utf-8'><title>k3bundle sign-off</title>",
             "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}pre{white-space:pre-wrap}"
             ".pass{color:#2ca02c}.fail{color:#d62728}</style>",
             f"<h1 class='{'pass' if rep.passed else 'fail'}'>Sign-off: {'PASS' if rep.passed else 'FAIL'}</h1>",
             f"<pre>{html.escape(md)}</pre>"]
    for c in rep.cases:
        if c.status == "not run":
            continue
        parts.append(f"<h2>{html.escape(c.name)} — {c.status}</h2>")
        series = {m: sorted(_per_layer(c, m).items()) for m in ("added", "inherited", "emulation")}
        series = {f"{m} NMSE (worst tap)": s for m, s in series.items() if s}
        parts.append(_svg_lines(series, "error per layer (log10 NMSE)"))
        if c.kld_by_position:
            parts.append(_svg_lines({"KL(golden || device)": list(enumerate(c.kld_by_position))},
                                    "KL divergence by tapped position (log10 nats)"))
    return "\n".join(parts) + "\n"


REPORT_NAMES = ("signoff.json", "signoff.md", "signoff.html")


def remove_reports(out_dir: str | Path) -> None:
    """Remove an earlier run's reports: a run that could not be judged must not leave them in place."""
    out = Path(out_dir)
    if out.is_dir() and not out.is_symlink():
        for name in REPORT_NAMES:
            p = out / name
            if p.is_file() or p.is_symlink():
                p.unlink()


def write_reports(rep, out_dir: str | Path) -> list[Path]:
    """Write the three reports (each atomically). Never through a link; on a failure (a full disk)
    none of them is left, so an old report cannot pass for this run's."""
    out = Path(out_dir)
    if out.is_symlink():
        raise ValidateError(f"{out}: is a symbolic link; reports are never written through links")
    files = {"signoff.json": (json.dumps(to_json(rep), indent=2, sort_keys=True) + "\n").encode(),
             "signoff.md": to_markdown(rep).encode(), "signoff.html": to_html(rep).encode()}
    try:
        out.mkdir(parents=True, exist_ok=True)
        remove_reports(out)
        for name, data in files.items():
            write_atomic(out / name, data)
    except OSError as e:
        remove_reports(out)
        raise ValidateError(f"{out}: cannot write the reports: {e.strerror or e}") from None
    return [out / n for n in files]
