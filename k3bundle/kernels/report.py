"""A conformance run as Markdown, JSON and a self-contained HTML page (``kernels --out DIR``)."""

from __future__ import annotations

import json
from pathlib import Path

from k3bundle.file_names import KERNELS_STEM
from k3bundle.io.files import write_atomic
from k3bundle.io.strict_json import nonfinite_as_text
from k3bundle.kernels.conformance import CaseResult, Conformance
from k3bundle.pages.html import badge, esc, meta, page, sci, table



def sizes_text(sizes: dict) -> str:
    """{'prefill': 8192, 'decode_batch': 64, 'context': 4096} as a reader says it."""
    words = {"prefill": "prefill {} tokens", "decode_batch": "decode batch {}", "context": "context {}"}
    return ", ".join(words.get(k, k + " {}").format(v) for k, v in sizes.items())

def _worst(c: CaseResult) -> tuple[float | None, float | None]:
    nmse = [m["nmse"] for m in c.metrics.values() if "nmse" in m]
    cos = [m["cosine"] for m in c.metrics.values() if "cosine" in m]
    return (max(nmse) if nmse else None), (min(cos) if cos else None)


def _ms(t: float | None) -> str:
    return "–" if t is None else f"{t * 1e3:.3f}"


def headline(r: Conformance) -> str:
    fails = [(o.op, o.failing()) for o in r.ops if o.status == "fail"]
    covered = r.covered()
    if fails:
        op, case = fails[0]
        return (f"FAIL: {len(fails)} op(s) do not conform; first: {op}, case {case.name}: {case.failures[0]}")
    return f"PASS: {len(covered)} op(s) conform ({', '.join(covered) or 'none covered'})"


def to_markdown(r: Conformance) -> str:
    lines = [f"# Kernel conformance: backend {r.backend} on {r.device}", "",
             f"target {r.target} (per-rank shapes of {r.shapes_of}), dtype {r.dtype}, card {r.card or '— (no roofline bound)'}, "
             f"sizes {sizes_text(r.sizes)}", "", headline(r), "",
             "| op | status | case | worst NMSE | min cosine | time ms | bound ms | × bound | failure |",
             "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for o in r.ops:
        if not o.cases:
            lines.append(f"| {o.op} | {o.status} | | | | | | | |")
            continue
        for c in o.cases:
            n, cos = _worst(c)
            ratio = "–" if c.ratio is None else f"{c.ratio:.1f}"
            bound = "–" if c.bound_s is None else f"{c.bound_s * 1e3:.4f}"
            lines.append(f"| {o.op} | {'pass' if c.passed else 'FAIL'} | {c.name} | {sci(n)} | {sci(cos)} | "
                         f"{_ms(c.time_s)} | {bound} | {ratio} | {'; '.join(c.failures)} |")
    lines += ["", "Limits: tolerances/kernels.yaml; reference: the executor's block functions in float64 on the "
              "same inputs (docs/kernels.md)."]
    return "\n".join(lines) + "\n"


def to_html(r: Conformance) -> str:
    body = [f"<h1>Kernel conformance {badge('pass' if r.passed else 'fail')}</h1>",
            meta([("backend", esc(r.backend)), ("device", esc(r.device)),
                  ("target", f"{esc(r.target)} (per-rank shapes of {esc(r.shapes_of)})"),
                  ("dtype", esc(r.dtype)), ("card", esc(r.card or "— (no roofline bound)")),
                  ("sizes", esc(sizes_text(r.sizes)))]),
            f"<p>{esc(headline(r))}</p>"]
    rows, classes = [], []
    for o in r.ops:
        for c in o.cases or [None]:
            if c is None:
                rows.append([esc(o.op), badge(o.status), "", "", "", "", "", "", ""])
                classes.append("")
                continue
            n, cos = _worst(c)
            rows.append([esc(o.op), badge("pass" if c.passed else "fail"), esc(c.name), sci(n), sci(cos),
                         _ms(c.time_s), "–" if c.bound_s is None else f"{c.bound_s * 1e3:.4f}",
                         "–" if c.ratio is None else f"{c.ratio:.1f}", esc("; ".join(c.failures))])
            classes.append("" if c.passed else "bad")
    body.append(table(["op", "status", "case", "worst NMSE", "min cosine", "time ms", "bound ms", "× bound",
                       "failure"], rows, num=(3, 4, 5, 6, 7), row_cls=classes))
    return page(f"k3bundle kernels — {r.backend}", "\n".join(body))


def save(r: Conformance, out: Path) -> list[Path]:
    """kernels.md, kernels.json and kernels.html in ``out`` (each written atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{KERNELS_STEM}.{ext}" for ext in ("md", "json", "html")]  # checklist --bundle reads the .json
    write_atomic(paths[0], to_markdown(r))
    write_atomic(paths[1], json.dumps(nonfinite_as_text(r.to_dict()), indent=2, sort_keys=True) + "\n")
    write_atomic(paths[2], to_html(r))
    return paths
