"""SVG charts drawn from data: a line chart with limit lines and markers, and stacked bars.

Legends sit in their own band above the plot, never over the data. Every limit line is labelled
in the plot margin. Values that are NaN or infinite are drawn at the top edge with a ring so a
broken layer cannot vanish from a log plot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from k3bundle.pages.html import esc

FONT = "font-family='system-ui,-apple-system,Segoe UI,Roboto,Arial,sans-serif'"
MARKERS = ("circle", "square", "diamond", "triangle")


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    colour: str
    dash: str = ""  # stroke-dasharray; "" solid
    marker: str = "circle"
    line: bool = True


@dataclass
class Limit:
    """A horizontal limit line; ``xs`` restricts it to a span of x (None: the whole axis)."""

    value: float
    label: str
    colour: str
    xs: tuple[float, float] | None = None


@dataclass
class Mark:
    """A vertical marker at ``x`` (a first failure), labelled above the plot."""

    x: float
    label: str
    colour: str


@dataclass
class Axis:
    lo: float
    hi: float
    log: bool = False
    label: str = ""
    ticks: list[tuple[float, list[str]]] = field(default_factory=list)  # (x, lines of text); empty: automatic


def _finite(v: float) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    span = hi - lo or 1.0
    step = 10 ** math.floor(math.log10(span / n))
    for m in (1, 2, 2.5, 5, 10):
        if span / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt_tick(v: float, log: bool) -> str:
    if log:
        return f"1e{round(v)}"
    return f"{v:g}" if abs(v) < 1e5 else f"{v:.0e}"


def _marker(shape: str, x: float, y: float, colour: str, r: float = 3.2, fill: str | None = None) -> str:
    f = fill or colour
    if shape == "square":
        return f"<rect x='{x - r:.1f}' y='{y - r:.1f}' width='{2 * r:.1f}' height='{2 * r:.1f}' fill='{f}' stroke='{colour}'/>"
    if shape == "diamond":
        d = r * 1.3
        return f"<path d='M{x:.1f} {y - d:.1f}L{x + d:.1f} {y:.1f}L{x:.1f} {y + d:.1f}L{x - d:.1f} {y:.1f}Z' fill='{f}' stroke='{colour}'/>"
    if shape == "triangle":
        d = r * 1.3
        return f"<path d='M{x:.1f} {y - d:.1f}L{x + d:.1f} {y + d * .8:.1f}L{x - d:.1f} {y + d * .8:.1f}Z' fill='{f}' stroke='{colour}'/>"
    return f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{r:.1f}' fill='{f}' stroke='{colour}'/>"


def y_range(values: list[float], limits: list[float], log: bool) -> tuple[float, float]:
    """An axis range covering the finite values and the limits (log: whole decades)."""
    vals = [v for v in values + limits if _finite(v) and (v > 0 or not log)]
    if not vals:
        return (-6.0, 0.0) if log else (0.0, 1.0)
    if log:
        lo, hi = math.floor(math.log10(min(vals))), math.ceil(math.log10(max(vals)))
        return (lo, hi if hi > lo else lo + 1)
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.1 or 1.0
    return lo - pad, hi + pad


def line_chart(series: list[Series], x: Axis, y: Axis, limits: list[Limit] = (), marks: list[Mark] = (),
               bands: list[tuple[float, float, str]] = (), rug: list[float] = (), title: str = "",
               w: int = 1000, h: int = 330) -> str:
    """A chart of ``series`` over ``x`` and ``y`` (``y.log``: lo/hi are decades).

    ``bands``: (x0, x1, fill) backgrounds (layer types); ``rug``: x positions ticked under the axis
    (sampled positions).
    """
    n_tick_lines = max((len(t[1]) for t in x.ticks), default=1)
    left, right, top = 74, 150, 40
    bottom = 30 + 14 * n_tick_lines + (16 if x.label else 0) + (8 if rug else 0)
    pw, ph = w - left - right, h - top - bottom
    span = (x.hi - x.lo) or 1.0
    sx = lambda v: left + (v - x.lo) / span * pw  # noqa: E731
    ylo, yhi = y.lo, y.hi

    def sy(v: float) -> float:
        t = (math.log10(v) if v > 0 else ylo) if y.log else v  # exact zeros sit on the bottom edge
        t = min(max(t, ylo), yhi)
        return top + ph - (t - ylo) / ((yhi - ylo) or 1) * ph

    o = [f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {w} {h}' width='{w}' height='{h}' role='img' "
         f"aria-label='{esc(title)}' {FONT} font-size='12'>", f"<rect width='{w}' height='{h}' fill='#fff'/>"]
    for x0, x1, fill in bands:
        o.append(f"<rect x='{sx(x0):.1f}' y='{top}' width='{max(sx(x1) - sx(x0), 0.5):.1f}' height='{ph}' fill='{fill}'/>")
    # y grid and labels
    yt = list(range(int(ylo), int(yhi) + 1)) if y.log else _nice_ticks(ylo, yhi)
    for t in yt:
        py = top + ph - (t - ylo) / ((yhi - ylo) or 1) * ph
        o.append(f"<line x1='{left}' x2='{left + pw}' y1='{py:.1f}' y2='{py:.1f}' stroke='#e4e7eb'/>")
        o.append(f"<text x='{left - 8}' y='{py + 4:.1f}' text-anchor='end' fill='#444'>{_fmt_tick(t, y.log)}</text>")
    if y.label:
        o.append(f"<text transform='translate(16 {top + ph / 2:.0f}) rotate(-90)' text-anchor='middle' "
                 f"fill='#333'>{esc(y.label)}</text>")
    # x ticks
    ticks = x.ticks or [(t, [_fmt_tick(t, False)]) for t in _nice_ticks(x.lo, x.hi)]
    for tx, lines in ticks:
        px = sx(tx)
        o.append(f"<line x1='{px:.1f}' x2='{px:.1f}' y1='{top + ph}' y2='{top + ph + 4}' stroke='#888'/>")
        for i, line in enumerate(lines):
            o.append(f"<text x='{px:.1f}' y='{top + ph + 17 + 14 * i}' text-anchor='middle' "
                     f"fill='{'#333' if i == 0 else '#666'}' font-size='{11 if i == 0 else 10}'>{esc(line)}</text>")
    for r in rug:
        px = sx(r)
        o.append(f"<line x1='{px:.1f}' x2='{px:.1f}' y1='{top + ph + 2}' y2='{top + ph + 8}' stroke='#0b5394' "
                 "stroke-width='1' class='rug'/>")
    if x.label:
        o.append(f"<text x='{left + pw / 2:.0f}' y='{h - 6}' text-anchor='middle' fill='#333'>{esc(x.label)}</text>")
    o.append(f"<rect x='{left}' y='{top}' width='{pw}' height='{ph}' fill='none' stroke='#9aa3ad'/>")
    # limit lines, labelled in the right margin
    used: list[float] = []
    for lim in limits:
        if not _finite(lim.value) or (y.log and lim.value <= 0):
            continue
        py = sy(lim.value)
        x0, x1 = (sx(lim.xs[0]), sx(lim.xs[1])) if lim.xs else (left, left + pw)
        o.append(f"<line class='limit' x1='{x0:.1f}' x2='{x1:.1f}' y1='{py:.1f}' y2='{py:.1f}' stroke='{lim.colour}' "
                 f"stroke-width='1.6' stroke-dasharray='7 4'/>")
        ly = py + 4
        while any(abs(ly - u) < 13 for u in used):
            ly += 13
        used.append(ly)
        o.append(f"<text x='{left + pw + 6}' y='{ly:.1f}' fill='{lim.colour}' font-size='11'>{esc(lim.label)}</text>")
    # first-failure markers
    for m in marks:
        px = sx(m.x)
        o.append(f"<line class='mark' x1='{px:.1f}' x2='{px:.1f}' y1='{top}' y2='{top + ph}' stroke='{m.colour}' "
                 "stroke-width='2'/>")
        anchor = "end" if px > left + pw * 0.7 else "start"
        dx = -5 if anchor == "end" else 5
        o.append(f"<text x='{px + dx:.1f}' y='{top + 13}' text-anchor='{anchor}' fill='{m.colour}' "
                 f"font-weight='600'>{esc(m.label)}</text>")
    # data
    for s in series:
        pts = [(sx(a), sy(b) if _finite(b) else top, _finite(b)) for a, b in s.points]
        if s.line and len(pts) > 1:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _ in pts)
            o.append(f"<polyline fill='none' stroke='{s.colour}' stroke-width='2' stroke-dasharray='{s.dash}' "
                     f"points='{path}'/>")
        for px, py, ok in pts:
            o.append(_marker(s.marker, px, py, s.colour) if ok else
                     f"<circle cx='{px:.1f}' cy='{py:.1f}' r='6' fill='none' stroke='#D55E00' stroke-width='2'/>")
    # legend band above the plot
    lx = left
    for s in series:
        o.append(f"<line x1='{lx}' x2='{lx + 22}' y1='16' y2='16' stroke='{s.colour}' stroke-width='2' "
                 f"stroke-dasharray='{s.dash}'/>" + _marker(s.marker, lx + 11, 16, s.colour))
        o.append(f"<text x='{lx + 28}' y='20' fill='#333'>{esc(s.name)}</text>")
        lx += 40 + 7 * len(s.name)
    if limits:
        o.append(f"<line x1='{lx}' x2='{lx + 22}' y1='16' y2='16' stroke='#444' stroke-width='1.6' "
                 "stroke-dasharray='7 4'/>")
        o.append(f"<text x='{lx + 28}' y='20' fill='#333'>limit</text>")
    o.append("</svg>")
    return "".join(o)


def stacked_bars(rows: list[tuple[str, list[tuple[float, str, str]], str]], total: float, marks: list[Mark] = (),
                 legend: list[tuple[str, str]] = (), unit: float = 1e9, unit_name: str = "GB",
                 w: int = 1000) -> str:
    """Horizontal stacked bars: ``rows`` of (label, [(value, colour, segment name)], note on the right)
    on 0..``total``.

    ``marks`` draw vertical lines over every bar (a margin threshold) at their x in value units.
    """
    left, right, top, bar, gap = 130, 110, 44, 18, 6
    pw = w - left - right
    h = top + len(rows) * (bar + gap) + 40
    sx = lambda v: left + max(v, 0) / (total or 1) * pw  # noqa: E731
    o = [f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {w} {h}' width='{w}' height='{h}' role='img' "
         f"{FONT} font-size='12'>", f"<rect width='{w}' height='{h}' fill='#fff'/>"]
    lx = left
    for name, colour in legend:
        o.append(f"<rect x='{lx}' y='8' width='14' height='14' fill='{colour}' stroke='#777' stroke-width='.5'/>"
                 f"<text x='{lx + 20}' y='19' fill='#333'>{esc(name)}</text>")
        lx += 34 + 7 * len(name)
    for i, (label, segs, note) in enumerate(rows):
        y = top + i * (bar + gap)
        o.append(f"<text x='{left - 8}' y='{y + bar - 5}' text-anchor='end' fill='#333'>{esc(label)}</text>"
                 f"<text x='{left + pw + 8}' y='{y + bar - 5}' fill='#333'>{esc(note)}</text>")
        acc = 0.0
        for value, colour, name in segs:
            if value <= 0:
                continue
            x0, x1 = sx(acc), sx(acc + value)
            o.append(f"<rect class='seg' x='{x0:.1f}' y='{y}' width='{max(x1 - x0, .5):.1f}' height='{bar}' "
                     f"fill='{colour}' stroke='#fff' stroke-width='.5'><title>{esc(name)}: "
                     f"{value / unit:,.2f} {unit_name}</title></rect>")
            acc += value
    ybot = top + len(rows) * (bar + gap)
    for t in _nice_ticks(0, total / unit):
        px = sx(t * unit)
        o.append(f"<line x1='{px:.1f}' x2='{px:.1f}' y1='{ybot}' y2='{ybot + 4}' stroke='#888'/>"
                 f"<text x='{px:.1f}' y='{ybot + 17}' text-anchor='middle' fill='#444'>{t:g} {unit_name}</text>")
    for m in marks:
        px = sx(m.x)
        o.append(f"<line class='mark' x1='{px:.1f}' x2='{px:.1f}' y1='{top - 6}' y2='{ybot}' stroke='{m.colour}' "
                 f"stroke-width='2' stroke-dasharray='5 3'/><text x='{px - 4:.1f}' y='{top - 9}' text-anchor='end' "
                 f"fill='{m.colour}' font-size='11'>{esc(m.label)}</text>")
    o.append("</svg>")
    return "".join(o)
