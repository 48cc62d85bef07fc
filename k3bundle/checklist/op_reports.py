"""Op conformance from ``reports/kernels.json`` (``k3bundle kernels --out BUNDLE/reports``).

A conformance report ticks the kernel-coverage row of each op it covered and passed; a failing op
is marked failed with its first failing case; ops the backend does not cover stay open. A report
made for another layout ticks nothing: per-rank shapes differ between layouts.
"""

from __future__ import annotations

from pathlib import Path

from k3bundle.checklist.stages import read_report
from k3bundle.file_names import KERNELS_REPORT

KERNELS_KIND = "k3bundle.kernel_conformance"


def read_kernel_report(bundle: Path, target: str) -> tuple[dict | None, str]:
    """(the report, '') or (None, why it cannot tick anything)."""
    doc, why = read_report(bundle, KERNELS_REPORT)
    if doc is None:
        return None, why
    if not isinstance(doc, dict) or doc.get("kind") != KERNELS_KIND or not isinstance(doc.get("ops"), list):
        return None, f"{KERNELS_REPORT}: not a k3bundle kernels report"
    if doc.get("target") != target:
        return None, f"{KERNELS_REPORT} was made for layout {doc.get('target')!r}, not {target!r}"
    return doc, ""


def op_status(ops: list[str], report: dict | None, why: str) -> dict[str, tuple[str, str]]:
    """op -> (status "pass" / "fail" / "open", evidence) for each op in ``ops``."""
    by_op = {o.get("op"): o for o in (report or {}).get("ops", []) if isinstance(o, dict)}
    where = "" if report is None else f"backend {report.get('backend')} on {report.get('device')}, {report.get('dtype')}"
    out = {}
    for op in ops:
        o = by_op.get(op)
        if report is None:
            out[op] = ("open", why)
        elif o is None or o.get("status") not in ("pass", "fail"):
            out[op] = ("open", f"{where}: {o.get('status') if o else 'not in the report'}")
        elif o["status"] == "fail":
            bad = next((c for c in o.get("cases", []) if not c.get("passed")), {})
            out[op] = ("fail", f"{where}: case {bad.get('name', '?')} fails: {'; '.join(bad.get('failures', []))[:200]}")
        else:
            out[op] = ("pass", f"{where}: {len(o.get('cases', []))} cases conform")
    return out
