"""The sign-off as a page: a summary table linking to each case, then per case the error per
layer against its limits, KL divergence by position, router agreement per layer and every check.

Colours keep one meaning on every case (``pages.html.COLOURS``): added error blue and solid,
inherited error orange and dashed, failures vermillion. Layer types on the x axis come from the
bundle's ``config.json`` (``TextConfig.is_mla`` / ``is_moe``); without one the axis shows indices.
"""

from __future__ import annotations

import math
from pathlib import Path

from k3bundle import __version__
from k3bundle.config import load_config
from k3bundle.errors import K3Error
from k3bundle.file_names import CONFIG
from k3bundle.golden.tolerances import METRICS
from k3bundle.pages.html import COLOURS, badge, esc, meta, page, sci, table
from k3bundle.pages.svg import Axis, Limit, Mark, Series, line_chart, y_range
from k3bundle.validate.findings import failures, finding
from k3bundle.validate.margin import NEAR, margins, show, show_use
from k3bundle.validate.serving import NOT_RUN, SECTION_HEAD, SECTION_NOTE, section_rows

MODES = ("added", "emulation", "inherited")
STYLE = {"added": ("", "circle"), "emulation": ("2 3", "triangle"), "inherited": ("6 4", "square")}
MLA_BAND = "#eef1f8"


def layer_types(bundle: str) -> list[tuple[str, str]] | None:
    """[(mixer, ffn)] per layer — ("KDA" | "MLA", "MoE" | "dense") — from the bundle's config."""
    path = Path(bundle) / CONFIG
    if not path.is_file():
        return None
    try:
        text = load_config(path).text
    except K3Error:
        return None
    return [("MLA" if text.is_mla(l) else "KDA", "MoE" if text.is_moe(l) else "dense")
            for l in range(text.num_hidden_layers)]


def drift_max(c) -> float:
    return max((max(v) for v in c.drift.values() if v), default=0.0)


def greedy_text(g) -> str:
    if g is None:
        return "–"
    if g.first_divergence is None:
        return f"{g.matched}/{g.total} equal"
    return f"{g.matched}/{g.total} equal, diverges at step {g.first_divergence} {tie_text(g)}"


def tie_text(g) -> str:
    """Why a divergence is or is not a near tie: the golden top-1/top-2 gap against the margin."""
    why = "" if g.gap is None else f": gap {g.gap:.3g} {'<' if g.near_tie else '≥'} margin {g.margin:.3g}"
    return f"(near tie{why})" if g.near_tie else f"(NOT a near tie{why})"


def _code(tap: str) -> str:
    return f"<code>{esc(tap)}</code>"


def _anchor(name: str) -> str:
    return "case-" + "".join(ch if ch.isalnum() else "-" for ch in name)


def _margin(r, metric: str) -> tuple[str, str]:
    """(use of the limit, what limit would have passed) for one metric of one check."""
    v, lim = r.values.get(metric), r.limits[metric]
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return "–", "none (not finite)"
    if METRICS[metric] == "max":
        use = ("–" if not lim else f"{v / lim:.0%} of limit" if v / lim < 10 else f"{v / lim:.3g}× the limit")
        need = "" if r.passed or metric not in r.min_required else f"≤ {sci(v)}"
    else:
        use = f"{v - lim:+.4g}"
        need = "" if r.passed or metric not in r.min_required else f"≥ {sci(v)}"
    return use, need


def _check_rows(results) -> tuple[list[list[str]], list[str]]:
    rows, cls = [], []
    for r in results:
        for metric in r.limits:
            if metric not in r.values:
                continue
            use, need = _margin(r, metric)
            op = "≥" if METRICS[metric] == "min" else "≤"
            bad = metric in r.min_required or (not r.passed and not r.min_required)
            rows.append([badge("fail" if bad else "pass"), esc(r.mode), "–" if r.layer is None else str(r.layer),
                         f"<code>{esc(r.tap)}</code>", esc(metric), sci(r.values[metric]), f"{op} {sci(r.limits[metric])}",
                         use, need])
            cls.append("bad" if bad else "")
    return rows, cls


def _layer_axis(n: int, types: list[tuple[str, str]] | None, highlight: int | None) -> Axis:
    ticks = []
    full = n <= 24
    for l in range(n):
        show = full or (l % 5 == 0 and n - 1 - l >= 3) or l == highlight or l == n - 1
        mixer, ffn = types[l] if types and l < len(types) else ("", "")
        lines = [str(l) if show else ""]
        if types:
            lines += [mixer if full else mixer[0], ffn if full else ("d" if ffn == "dense" else "")]
        ticks.append((l, lines))
    label = "decoder layer (index, mixer KDA / MLA, FFN MoE / dense)" if types else "decoder layer"
    return Axis(-0.5, n - 0.5, label=label, ticks=ticks)


def _bands(n: int, types) -> list[tuple[float, float, str]]:
    return [(l - 0.5, l + 0.5, MLA_BAND) for l in range(n) if types and l < len(types) and types[l][0] == "MLA"]


def _limit_steps(per_layer: dict[int, float], label: str, colour: str) -> list[Limit]:
    """Consecutive layers with one limit as one line; the first labelled."""
    out: list[Limit] = []
    for l in sorted(per_layer):
        v = per_layer[l]
        if out and out[-1].value == v and out[-1].xs[1] == l - 0.5:
            out[-1].xs = (out[-1].xs[0], l + 0.5)
        else:
            out.append(Limit(v, label if not out else "", colour, (l - 0.5, l + 0.5)))
    return out


def error_chart(c, n: int, types) -> str:
    """Worst NMSE per layer (the tap nearest its limit), per mode, with each mode's limits."""
    series, limits, values, lims = [], [], [], []
    failing = []
    for mode in MODES:
        worst: dict[int, tuple[float, float]] = {}  # layer -> (value, limit) of the tap nearest its limit
        for r in c.results:
            if r.mode != mode or r.layer is None or "nmse" not in r.values or "nmse" not in r.limits:
                continue
            v, lim = r.values["nmse"], r.limits["nmse"]
            ratio = v / lim if math.isfinite(v) and lim else math.inf
            if r.layer not in worst or ratio > worst[r.layer][0] / (worst[r.layer][1] or 1) or not math.isfinite(v):
                worst[r.layer] = (v, lim)
            if not r.passed:
                failing.append((r.layer, v))
        if not worst:
            continue
        dash, marker = STYLE[mode]
        series.append(Series(f"{mode} (worst tap)", [(l, worst[l][0]) for l in sorted(worst)], COLOURS[mode],
                             dash, marker))
        limits += _limit_steps({l: worst[l][1] for l in worst}, f"{mode} limit", COLOURS[mode])
        values += [v for v, _ in worst.values()]
        lims += [lim for _, lim in worst.values()]
    if not series:
        return ""
    if failing:
        series.append(Series("failing check", sorted(set(failing)), COLOURS["fail"], marker="diamond", line=False))
    ff = c.first_failure
    marks = [Mark(ff.layer, f"first failure: layer {ff.layer} {ff.tap.rsplit('.', 1)[-1]} ({ff.mode})",
                  COLOURS["fail"])] if ff is not None and ff.layer is not None else []
    lo, hi = y_range(values, lims, log=True)
    svg = line_chart(series, _layer_axis(n, types, ff.layer if ff else None), Axis(lo, hi, log=True, label="NMSE"),
                     limits, marks, _bands(n, types), title=f"{c.name}: error per layer")
    note = " Shaded columns are MLA layers." if types and any(t[0] == "MLA" for t in types) else ""
    return (f"<figure class='chart error'>{svg}<figcaption>Error per layer: for each layer the NMSE of the tap "
            f"nearest its limit. <b>added</b>: the error the layer adds on golden inputs (teacher-forced); "
            f"<b>inherited</b>: the error the free-running stack carries to it. Dashed lines: the limits.{note}"
            f"</figcaption></figure>")


def kld_chart(c, tokens: int | None, logits_limits: dict) -> str:
    if not c.kld_by_position:
        return ""
    pos = c.positions if len(c.positions) == len(c.kld_by_position) else list(range(len(c.kld_by_position)))
    sampled = tokens is not None and len(pos) < tokens
    hi_x = (tokens - 1) if tokens else max(pos)
    pts = list(zip(pos, c.kld_by_position))
    lims = [Limit(logits_limits[k], f"{k} limit", COLOURS[col]) for k, col in
            (("kld_p99", "limit"), ("kld_mean", "kld")) if k in logits_limits]
    lo, hi = y_range(c.kld_by_position, [l.value for l in lims], log=True)
    svg = line_chart([Series("KL(golden ‖ device) per position", pts, COLOURS["kld"], line=not sampled or len(pts) < 80)],
                     Axis(-0.5, max(hi_x, 1) + 0.5, label="prompt position (token index)"),
                     Axis(lo, hi, log=True, label="KL divergence (nats)"), lims,
                     rug=pos if sampled else [], title=f"{c.name}: KL divergence by position", h=300)
    note = (f" Long context: {len(pos):,} of {tokens:,} positions are sampled (ticks under the axis); the "
            "others are not compared." if sampled else "")
    return f"<figure class='chart kld'>{svg}<figcaption>KL divergence per tapped position.{note}</figcaption></figure>"


def router_chart(c, n: int, types) -> str:
    pts = sorted((r.layer, r.values["expert_set"]) for r in c.results
                 if r.mode == "router" and r.layer is not None and "expert_set" in r.values)
    if not pts:
        return ""
    limit = next(r.limits["expert_set"] for r in c.results if r.mode == "router" and "expert_set" in r.limits)
    series = [Series("expert-set agreement", pts, COLOURS["router"], marker="square")]
    bad = [(l, v) for l, v in pts if v < limit]
    if bad:
        series.append(Series("below limit", bad, COLOURS["fail"], marker="diamond", line=False))
    lo = min(min(v for _, v in pts), limit)
    lo = max(0.0, lo - max((1 - lo) * 0.15, 0.002))
    svg = line_chart(series, _layer_axis(n, types, None), Axis(lo, 1.0 + (1 - lo) * 0.05, label="agreement"),
                     [Limit(limit, "limit", COLOURS["limit"])], bands=_bands(n, types),
                     title=f"{c.name}: router agreement", h=280)
    return (f"<figure class='chart router'>{svg}<figcaption>Share of tokens whose set of experts equals the golden's, "
            "per MoE layer (flips at golden near ties are exempt).</figcaption></figure>")


def _summary(rep) -> str:
    rows, cls = [], []
    for c in rep.cases:
        link = f"<a href='#{_anchor(c.name)}'>{esc(c.name)}</a>"
        status = "not run" if c.status == "not run" else c.status
        if c.status == "not run":
            rows.append([link, esc(c.kind), badge(status), "–", esc(c.reason), "–", "–"])
            cls.append("")
            continue
        ff = c.first_failure
        where = "–" if ff is None else finding(ff, c.kernel_ops, rep.kernels, _code, esc)
        if ff is None and c.status == "fail":
            where = esc(c.reason)
        failed = sum(not r.passed for r in c.results)
        d, dl = c.drift_worst
        dcell = (f"<span style='color:{'var(--fail)' if d > dl else 'inherit'}'>{sci(d)}</span> "
                 f"<span class='muted'>/ {sci(dl)}</span>") if c.drift else "–"
        rows.append([link, esc(c.kind), badge(status),
                     f"<span data-sort='{failed}'>{failed} / {len(c.results)}</span>", where,
                     esc(greedy_text(c.greedy)), dcell])
        cls.append("bad" if c.status == "fail" else "")
    return table(["case", "kind", "status", "checks failed", "first failing layer / tap", "greedy agreement",
                  "state drift max / limit"], rows, cls="sortable summary", num=(3,), row_cls=cls)


def _margin_table(rows, total: int) -> str:
    body, cls = [], []
    for m in rows:
        over = m.use > 1 or m.use != m.use
        bc = m.beyond_clean
        body.append([badge("fail" if over else "pass"), esc(m.mode), f"<code>{esc(m.tap)}</code>", esc(m.metric),
                     esc(show(m.metric, m.value)), esc(show(m.metric, m.limit)), esc(m.limit_from),
                     esc(show_use(m.use)), "–" if m.clean_worst is None else esc(show(m.metric, m.clean_worst)),
                     "–" if bc is None else f"{bc:.3g}×"])
        cls.append("bad" if over else "")
    more = f" ({total - len(rows)} more in signoff.json)" if total > len(rows) else ""
    return (f"<h3>Nearest the limit</h3><p class='muted'>Checks at {NEAR:.0%} of their limit or beyond{more}. "
            "<b>× clean worst</b>: the value relative to the worst the same check reached on clean bundles "
            "in the calibration run that set the limits; above 1× it is worse than any clean bundle seen, "
            "near or below 1× an unlucky clean case. <b>limit from</b>: the tolerance file's fixed limit, or "
            "a factor × the reference's own BF16 noise at that check where that is looser "
            "(docs/validation.md, the limit as a formula).</p>"
            + table(["", "mode", "tap", "metric", "value", "limit", "limit from", "use of limit",
                     "calibrated clean worst", "× clean worst"], body, cls="checks near", num=(4, 5, 7, 8, 9),
                    row_cls=cls))


def _case(rep, c, n: int, types, tokens: int | None) -> str:
    head = (f"<h2 id='{_anchor(c.name)}'>{esc(c.name)} <span class='muted' style='font-weight:400;font-size:15px'>"
            f"{esc(c.kind)}</span> {badge(c.status)}</h2>")
    if c.status == "not run":
        return head + f"<p class='muted'>Not run: {esc(c.reason)}</p>"
    parts = [head]
    ff = c.first_failure
    bad = failures(c.results)  # the ones that locate the fault first
    if c.status == "fail":
        what = (f"First failure: {finding(ff, c.kernel_ops, rep.kernels, _code, esc)} — "
                + ", ".join(f"{esc(k)} {sci(v)} vs limit {sci(ff.limits.get(k))}" for k, v in ff.values.items()
                            if k in ff.limits)) if ff is not None else esc(c.reason)
        parts.append(f"<div class='callout'>{what}. {len(bad)} of {len(c.results)} checks fail.</div>")
    else:
        parts.append(f"<div class='callout ok'>All {len(c.results)} checks pass.</div>")
    if c.layer_checks:
        parts.append(f"<p class='muted'>Teacher-forced layer checks skipped: {esc(c.layer_checks)}</p>")
    facts = [("greedy", esc(greedy_text(c.greedy)))]
    if c.drift:
        facts.append(("state drift", f"max {sci(drift_max(c))} over {len(c.drift)} states (limit {sci(c.drift_worst[1])} at the worst state)"))
    parts.append(meta(facts))
    parts += [error_chart(c, n, types), kld_chart(c, tokens, rep.tolerances.logits), router_chart(c, n, types)]
    near = margins(c, rep.tolerances)
    if near:
        parts.append(_margin_table(near[:30], len(near)))
    if bad:
        rows, cls = _check_rows(bad[:200])
        parts.append("<h3>Failing checks</h3>" + table(
            ["", "mode", "layer", "tap", "metric", "value", "limit", "use of limit", "would pass at"], rows,
            cls="checks failing", num=(2, 5, 6), row_cls=cls))
        if len(bad) > 200:
            parts.append(f"<p class='muted'>… and {len(bad) - 200} more failing checks (signoff.json has all)</p>")
    rows, cls = _check_rows(c.results)
    parts.append(f"<details><summary>Every check ({len(c.results)} checks, {len(rows)} limits)</summary>"
                 + table(["", "mode", "layer", "tap", "metric", "value", "limit", "use of limit", "would pass at"],
                         rows, cls="sortable checks all", num=(2, 5, 6), row_cls=cls) + "</details>")
    return "\n".join(p for p in parts if p)


def _nonfinite(rep) -> str:
    """The non-finite section: every tap or greedy step with NaN/Inf, or that there was none."""
    found = rep.nonfinite()
    if not found:
        return "<h2>Non-finite values</h2><p class='muted'>none: every compared value was finite on both sides</p>"
    items = "".join(f"<li><b>{esc(f['case'])}</b> ({esc(f['mode'])}): <code>{esc(f['text'])}</code></li>"
                    for f in found)
    return f"<h2>Non-finite values</h2><ul class='nonfinite'>{items}</ul>"


def _serving(rep) -> str:
    """The serving paths (``validate --serving``), or that they did not run."""
    rows = section_rows(rep)
    if not rows:
        return f"<h2>Serving paths</h2><p class='muted'>{esc(NOT_RUN)}</p>"
    return (f"<h2>Serving paths</h2><p>{esc(SECTION_NOTE)}</p>"
            + table(list(SECTION_HEAD), [[esc(v) for v in r] for r in rows], cls="serving"))


def to_html(rep) -> str:
    """The sign-off page of ``rep`` (``validate.run.Report``)."""
    types = layer_types(rep.bundle)
    layers_seen = [r.layer for c in rep.cases for r in c.results if r.layer is not None]
    n = len(types) if types else (max(layers_seen) + 1 if layers_seen else 0)
    tokens = {e.get("name"): e.get("tokens") for e in rep.golden_meta.get("cases", [])}
    verdict = "PASS" if rep.passed else "FAIL"
    gm = rep.golden_meta
    body = [f"<h1><span class='verdict {verdict.lower()}'>{verdict}</span>Sign-off</h1>",
            f"<p class='sub'>{sum(c.status == 'pass' for c in rep.cases)} of {len(rep.cases)} cases pass · "
            f"{sum(c.status == 'fail' for c in rep.cases)} fail · {sum(c.status == 'not run' for c in rep.cases)} "
            "not run</p>",
            meta([("bundle", f"<code>{esc(rep.bundle)}</code>"),
                  ("device under test", f"{esc(rep.mode)} ({esc(rep.device)})"),
                  ("tolerances", f"<code>{esc(rep.tolerances.name)}</code> <span class='muted'>"
                                 f"{esc(rep.tolerances.path)}</span>"),
                  ("goldens", f"content hash <code>{esc(str(gm.get('content_hash', '?'))[:16])}…</code>, dtype "
                              f"{esc(gm.get('dtype'))}, k3bundle {esc(gm.get('k3bundle_version'))}"),
                  ("limits calibrated", esc(rep.tolerances.calibration_run or "no calibration recorded")),
                  ("exact check", esc(rep.exact or "not run")),
                  ("bundle files", esc(rep.integrity or "not checked")),
                  ("report", f"k3bundle {esc(__version__)}, {rep.seconds:.1f} s")]),
            "<h2>Cases</h2>", _summary(rep), _serving(rep), _nonfinite(rep)]
    body += [_case(rep, c, n, types, tokens.get(c.name)) for c in rep.cases]
    return page(f"k3bundle sign-off: {verdict}", "\n".join(body))
