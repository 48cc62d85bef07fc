"""Two sign-offs side by side: which checks moved, by how much, per layer.

Bring-up is a loop of "change a kernel, re-validate, compare". ``diff_signoffs`` pairs the checks
of two ``signoff.json`` documents by (case, mode, tap, metric) and keeps those whose status
changed or whose value moved by more than ``rel`` of the larger of the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from k3bundle.bundle.errors import BundleError
from k3bundle.bundle.signoff import read_signoff
from k3bundle.bundle.signoff_runs import choose_run
from k3bundle.file_names import REPORTS_DIR, SIGNOFF_NAME
from k3bundle.pages.html import COLOURS, badge, esc, meta, page, table
from k3bundle.pages.svg import Axis, Limit, Series, line_chart, y_range
from k3bundle.validate.errors import ValidateError


def load_signoff(path: str | Path) -> tuple[Path, dict]:
    """A ``signoff.json``, given itself, the folder holding it, or a bundle (or its ``reports/``):
    then the latest validate run's (``bundle.signoff_runs.choose_run``)."""
    p = Path(path)
    bundle = p.parent if p.name == REPORTS_DIR and not (p / SIGNOFF_NAME).is_file() else p
    for cand in (p, p / SIGNOFF_NAME):
        if cand.is_file():
            break
    else:
        run, why, _ = choose_run(bundle) if bundle.is_dir() else (None, "not a folder", [])
        if run is None or run.doc is None:
            raise ValidateError(f"{p}: no {SIGNOFF_NAME} here, in {p / SIGNOFF_NAME} or in a validate run of a "
                                f"bundle ({why if run is None else run.why}); run `k3bundle validate BUNDLE` first")
        cand = bundle / run.path
    try:
        return cand, read_signoff(cand)
    except BundleError as e:
        raise ValidateError(str(e)) from None


def _num(v) -> float:
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)  # "nan" / "inf" as written by to_json
    except (TypeError, ValueError):
        return math.nan


@dataclass(frozen=True)
class Moved:
    case: str
    mode: str
    tap: str
    layer: int | None
    metric: str
    a: float
    b: float
    limit: float | None
    passed_a: bool
    passed_b: bool

    @property
    def factor(self) -> float:
        """b / a (inf when a is 0 and b is not)."""
        if self.a == self.b:
            return 1.0
        return self.b / self.a if self.a else math.inf

    @property
    def change(self) -> str:
        if self.passed_a != self.passed_b:
            return "now fails" if self.passed_a else "now passes"
        return "worse" if self.worse else "better"

    @property
    def worse(self) -> bool:
        smaller_is_better = self.metric not in ("cosine", "top1", "top5", "expert_set")
        return (self.b > self.a) if smaller_is_better else (self.b < self.a)

    def to_dict(self) -> dict:
        return {**{k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                   for k, v in self.__dict__.items()}, "change": self.change}


@dataclass
class Diff:
    a: str
    b: str
    cases: list[tuple[str, str, str]]  # (case, status in a, status in b)
    moved: list[Moved] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)  # "case mode tap" present in a only
    only_b: list[str] = field(default_factory=list)
    docs: tuple[dict, dict] = (None, None)  # type: ignore[assignment]

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b,
                "cases": [{"case": c, "a": sa, "b": sb} for c, sa, sb in self.cases],
                "moved": [m.to_dict() for m in self.moved], "only_a": self.only_a, "only_b": self.only_b}


def _checks(doc: dict) -> dict[tuple[str, str, str], dict]:
    return {(c["name"], r.get("mode", ""), r.get("tap", "")): r for c in doc["cases"] for r in c.get("results", [])}


def diff_signoffs(a: dict, b: dict, rel: float = 0.25, names: tuple[str, str] = ("A", "B")) -> Diff:
    """The checks that moved from sign-off ``a`` to ``b``: status changed, or a metric value moved by
    more than ``rel`` of the larger magnitude (NaN on one side only always counts)."""
    ca, cb = _checks(a), _checks(b)
    status_a = {c["name"]: c.get("status", "") for c in a["cases"]}
    status_b = {c["name"]: c.get("status", "") for c in b["cases"]}
    order = list(status_a) + [n for n in status_b if n not in status_a]
    d = Diff(names[0], names[1], [(n, status_a.get(n, "–"), status_b.get(n, "–")) for n in order], docs=(a, b))
    d.only_a = sorted(" ".join(k) for k in ca.keys() - cb.keys())
    d.only_b = sorted(" ".join(k) for k in cb.keys() - ca.keys())
    for key in [k for k in ca if k in cb]:
        ra, rb = ca[key], cb[key]
        for metric in sorted(set(ra.get("values", {})) & set(rb.get("values", {}))):
            va, vb = _num(ra["values"][metric]), _num(rb["values"][metric])
            flipped = bool(ra.get("passed")) != bool(rb.get("passed"))
            nan_a, nan_b = math.isnan(va), math.isnan(vb)
            if nan_a and nan_b:
                moved = False
            elif nan_a or nan_b:
                moved = True
            else:
                scale = max(abs(va), abs(vb))
                moved = scale > 0 and abs(vb - va) > rel * scale
            if moved or (flipped and metric in (ra.get("limits") or {})):
                d.moved.append(Moved(key[0], key[1], key[2], ra.get("layer"), metric, va, vb,
                                     (rb.get("limits") or {}).get(metric), bool(ra.get("passed")),
                                     bool(rb.get("passed"))))
    d.moved.sort(key=lambda m: (m.passed_a == m.passed_b, -abs(math.log10(m.factor)) if 0 < m.factor < math.inf
                                else -math.inf, m.case, m.layer if m.layer is not None else -1, m.tap))
    return d


def _f(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.3e}" if v != 0 and math.isfinite(v) and (abs(v) < 1e-2 or abs(v) >= 1e5) else f"{v:.4g}"


def to_text(d: Diff, limit: int = 40) -> str:
    lines = [f"A: {d.a}", f"B: {d.b}", "", f"{'case':<16} {'A':<8} {'B':<8}"]
    lines += [f"{c:<16} {sa.upper():<8} {sb.upper():<8}" + ("  <- changed" if sa != sb else "") for c, sa, sb in d.cases]
    lines += ["", f"{len(d.moved)} check metric(s) moved"
              + (f" (first {limit} shown; --json has all)" if len(d.moved) > limit else "") + ":"]
    for m in d.moved[:limit]:
        fac = "" if not (0 < m.factor < math.inf) else f" ({m.factor:.3g}x)"
        lines.append(f"  {m.change:<10} {m.case} | {m.mode} | layer {'–' if m.layer is None else m.layer} | {m.tap} | "
                     f"{m.metric} {_f(m.a)} -> {_f(m.b)}{fac}" + (f" | limit {_f(m.limit)}" if m.limit is not None else ""))
    if d.only_a or d.only_b:
        lines.append(f"checks only in A: {len(d.only_a)}, only in B: {len(d.only_b)}")
    return "\n".join(lines) + "\n"


def _layer_worst(doc: dict, case: str, mode: str) -> tuple[dict[int, float], float | None]:
    worst, limit = {}, None
    for c in doc["cases"]:
        if c["name"] != case:
            continue
        for r in c.get("results", []):
            v = _num(r.get("values", {}).get("nmse"))
            if r.get("mode") == mode and r.get("layer") is not None and not math.isnan(v):
                worst[r["layer"]] = max(worst.get(r["layer"], 0.0), v)
                limit = (r.get("limits") or {}).get("nmse", limit)
    return worst, limit


def to_html(d: Diff) -> str:
    """The diff as a page: case status A and B, the worst layer error of A and B per case, every
    moved check."""
    a, b = d.docs
    body = ["<h1>Sign-off diff</h1>",
            meta([("A", f"<code>{esc(d.a)}</code>"), ("B", f"<code>{esc(d.b)}</code>"),
                  ("moved", f"{len(d.moved)} check metric(s); "
                            f"{sum(m.passed_a != m.passed_b for m in d.moved)} changed status")]),
            "<h2>Cases</h2>",
            table(["case", "A", "B"], [[esc(c), badge(sa), badge(sb)] for c, sa, sb in d.cases],
                  row_cls=["bad" if sa != sb else "" for _, sa, sb in d.cases])]
    for case, _, _ in d.cases:
        for mode in ("added", "emulation"):
            wa, la = _layer_worst(a, case, mode)
            wb, lb = _layer_worst(b, case, mode)
            if not wa and not wb:
                continue
            n = max(list(wa) + list(wb)) + 1
            series = [Series(f"A {mode}", sorted(wa.items()), "#888888", "6 4", "square"),
                      Series(f"B {mode}", sorted(wb.items()), COLOURS[mode], "", "circle")]
            lims = [Limit(x, f"{mode} limit", COLOURS["limit"]) for x in {la, lb} if x is not None]
            lo, hi = y_range(list(wa.values()) + list(wb.values()), [x.value for x in lims], log=True)
            svg = line_chart(series, Axis(-0.5, n - 0.5, label="decoder layer", ticks=[(l, [str(l)]) for l in range(n)]),
                             Axis(lo, hi, log=True, label="worst NMSE"), lims, title=f"{case} {mode}", h=280)
            body.append(f"<h3>{esc(case)}: {esc(mode)} error per layer</h3><figure>{svg}<figcaption>Worst NMSE "
                        "per layer, A (grey, dashed) and B.</figcaption></figure>")
    rows = [[badge("fail") if m.change == "now fails" else badge("pass") if m.change == "now passes" else esc(m.change),
             esc(m.case), esc(m.mode), "–" if m.layer is None else str(m.layer), f"<code>{esc(m.tap)}</code>",
             esc(m.metric), _f(m.a), _f(m.b), "–" if not 0 < m.factor < math.inf else f"{m.factor:.3g}×",
             _f(m.limit)] for m in d.moved]
    body += [f"<h2>Moved checks ({len(d.moved)})</h2>",
             table(["change", "case", "mode", "layer", "tap", "metric", "A", "B", "B / A", "limit"], rows,
                   cls="sortable moved", num=(3, 6, 7, 8, 9), row_cls=["bad" if m.worse else "" for m in d.moved])]
    return page("k3bundle sign-off diff", "\n".join(body))
