"""Records: one JSON object per judged case of a calibration run, appended to ``records.jsonl``.

A record holds the job (preset, seed, layout, device), the fault (None: clean) and where it was
planted, the case's verdict and first failure, and the worst value of every check, keyed
``mode/tap kind/metric`` (``validate.margin.check_key``), and which checks failed; a faulted run also keeps every
check's values (``taps``), so it can be judged again under other limits.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np

from k3bundle.golden.noise import ADDED, noise_key
from k3bundle.golden.tolerances import METRICS
from k3bundle.validate.margin import check_key

JOB_KEYS = ("preset", "seed", "layout", "device")


def worse(metric: str, v: float, than: float | None) -> bool:
    """Is ``v`` a worse value of ``metric`` than ``than`` (None: nothing yet)? (METRICS direction)"""
    return than is None or (v > than if METRICS.get(metric, "max") == "max" else v < than)


def summarise(rep, taps: bool = False) -> dict:
    """Worst value per check key (mode/kind/metric) of one case report (``validate.run.CaseReport``)
    and its verdict; ``taps``: every check's values too."""
    worst: dict[str, float] = {}
    for r in rep.results:
        for metric, v in r.values.items():
            if metric not in METRICS or not isinstance(v, float) or math.isnan(v):
                continue
            key = check_key(r.mode, r.tap, metric)
            if worse(metric, v, worst.get(key)):
                worst[key] = v
    for name, vals in rep.drift.items():
        key = check_key("state", name, "drift_nmse")
        if vals and worse("drift_nmse", max(vals), worst.get(key)):
            worst[key] = max(vals)
    failed = {check_key(r.mode, r.tap, m) for r in rep.results if not r.passed for m in (r.min_required or r.limits)}
    failed |= {check_key("state", name, "drift_nmse") for name, vals in rep.drift.items()
               if vals and max(vals) > rep.limit_of(name)}
    ff = rep.first_failure
    out = {"case": rep.name, "status": rep.status, "checks": worst, "failed_checks": sorted(failed),
           "first_failure": None if ff is None else {"layer": ff.layer, "tap": ff.tap, "mode": ff.mode,
                                                     "metrics": sorted(ff.min_required)},
           "greedy": None if rep.greedy is None else {"matched": rep.greedy.matched, "total": rep.greedy.total,
                                                      "passed": rep.greedy.passed},
           "reason": rep.reason}
    if taps:  # every check's values, so a faulted run can be re-judged under other limits
        out["taps"] = [[r.mode, r.tap, {k: v for k, v in r.values.items() if isinstance(v, float)}]
                       for r in rep.results]
    return out


def added_noise_ratio(rep, golden: dict) -> float | None:
    """The worst ratio of a clean case's added NMSE to the goldens' own teacher-forced BF16 noise
    at the same tap (golden/noise.py): how far above the reference's rounding a device's
    teacher-forced arithmetic lands, what ``noise.added_factor`` must cover (None: no noise)."""
    worst = None
    for r in rep.results:
        ref = golden.get(noise_key("nmse", ADDED + r.tap)) if r.mode == "added" else None
        v = r.values.get("nmse")
        if ref is None or not isinstance(v, float) or float(np.asarray(ref).reshape(-1)[0]) <= 0:
            continue
        q = v / float(np.asarray(ref).reshape(-1)[0])
        worst = q if worst is None or q > worst else worst
    return worst


def parse_seeds(spec: str) -> list[int]:
    """``0-9``, ``0,3,5-7``: the seeds named."""
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def load_records(paths: list[Path], seeds: list[int] | None = None) -> list[dict]:
    """Records from plain or gzip'd (the committed ones under tolerances/calibration/) files."""
    out = []
    for p in paths:
        raw = Path(p).read_bytes()
        for line in (gzip.decompress(raw) if str(p).endswith(".gz") else raw).decode().splitlines():
            r = json.loads(line)
            # records before 2026-12-01's serving-path run pooled every state's drift in one key
            r.get("checks", {}).pop("state/drift/drift_nmse", None)
            if seeds is None or r["seed"] in seeds:
                out.append(r)
    return out
