"""The calibrated tolerance file: a base file's limits, widened where this device's clean runs
need it, and a ``calibration`` section with the evidence (the run, each check's clean worst and
least severe located fault, the rates).

Limits are never tightened: a few seeds cannot prove a tighter one. A limit is widened to
``SAFETY`` × the clean worst (distances from perfect for a lower bound such as cosine):

- a fixed limit (teacher-forced: router, exact; added where the file has no ``added_factor``)
  where the clean worst came within 1/``SAFETY`` of it;
- a floor (a limit validate widens per golden with the reference's own BF16 noise) where a clean
  case failed that check, since its clean value alone does not say how near it came.

A widened limit that no longer fails the least severe fault located at that check is named in
``not_separated``: on this device that check cannot tell the two apart.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from k3bundle.calibrate.records import worse
from k3bundle.calibrate.tables import GATED, is_floor, limit_of
from k3bundle.golden.tolerances import METRICS, load_tolerances
from k3bundle.io.files import write_atomic
from k3bundle.io.strict_yaml import read_yaml
from k3bundle.validate.margin import distance

SAFETY = 2.0  # a calibrated limit sits at least this far beyond the clean worst (docs/validation.md)
SECTION_OF = {"distribution": "logits", "router": "router", "state": "state"}  # check mode -> flat section


def _widened(metric: str, clean_worst: float) -> float:
    d = SAFETY * distance(metric, clean_worst)
    return d if METRICS[metric] == "max" else max(-1.0, 1.0 - d)


def _set_limit(data: dict, key: str, value: float) -> None:
    mode, kind, metric = key.split("/")
    if mode in SECTION_OF:
        data.setdefault(SECTION_OF[mode], {})[metric] = value
    else:
        data.setdefault(mode, {}).setdefault(kind, {})[metric] = value


def widen(data: dict, table: dict, failed: set[str], tol) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """Widen ``data``'s limits in place (module docstring). Returns ({key: (old, new)}, the keys
    whose new limit passes the least severe located fault)."""
    changed, lost = {}, []
    for key in sorted(table):
        metric, t = key.rsplit("/", 1)[1], table[key]
        limit, cw = limit_of(tol, key), t["clean_worst"]
        if metric not in GATED or limit is None or cw is None or not math.isfinite(cw):
            continue
        near = distance(metric, cw) * SAFETY > distance(metric, limit)
        if not (key in failed if is_floor(tol, key) else near):
            continue
        new = _widened(metric, cw)
        if not worse(metric, new, limit):
            continue
        _set_limit(data, key, float(f"{new:.3g}") if METRICS[metric] == "max" else new)
        changed[key] = (limit, new)
        if t["fault_best"] is not None and not worse(metric, t["fault_best"], new):
            lost.append(key)
    return changed, lost


def calibration_section(table: dict, run: str, rates: dict | None = None, widened: dict | None = None,
                        not_separated: list[str] | None = None) -> dict:
    """The ``calibration`` mapping: the run, each gated check's clean worst and least severe
    located fault, and (from ``k3bundle calibrate``) the rates and what was widened."""
    gated = {k: t for k, t in sorted(table.items()) if k.rsplit("/", 1)[1] in GATED}
    out = {"run": run,
           "clean_worst": {k: float(f"{t['clean_worst']:.8g}") for k, t in gated.items()
                           if t["clean_worst"] is not None and math.isfinite(t["clean_worst"])}}
    fault_best = {k: float(f"{t['fault_best']:.8g}") for k, t in gated.items()
                  if t["fault_best"] is not None and math.isfinite(t["fault_best"])}
    if rates is not None:
        out["fault_best"] = fault_best
        out["rates"] = {k: rates[k] for k in ("clean_bundles", "clean_bundle_failures", "clean_cases",
                                              "clean_case_failures")}
        out["rates"]["faults"] = {k: dict(v) for k, v in sorted(rates["faults"].items())}
        out["widened"] = {k: [float(f"{a:.8g}"), float(f"{b:.8g}")] for k, (a, b) in sorted((widened or {}).items())}
        out["not_separated"] = list(not_separated or [])
    return out


def calibration_yaml(table: dict, run: str) -> str:
    """The ``calibration`` section of a shipped tolerance file (``bench/calibrate.py limits --write``):
    the run and each gated check's clean worst."""
    lines = ["calibration:                 # written by bench/calibrate.py limits --write: evidence, not limits",
             f"  run: {json.dumps(run)}", "  clean_worst:"]
    for key, v in calibration_section(table, run)["clean_worst"].items():
        lines.append(f"    {key}: {v:.8g}")
    return "\n".join(lines) + "\n"


def write_calibrated(base: Path, out: Path, table: dict, rates: dict, run: str, failed: set[str]) -> dict:
    """Write the calibrated tolerance file ``out`` from ``base`` (module docstring) atomically and
    read it back. Returns what it changed: {"widened": {key: (old, new)}, "not_separated": [keys]}."""
    data = read_yaml(base)
    tol = load_tolerances(base)
    data.pop("calibration", None)
    changed, lost = widen(data, table, failed, tol)
    data["description"] = f"{data.get('description', base.stem)}; calibrated: {run}"
    data["calibration"] = calibration_section(table, run, rates, changed, lost)
    head = (f"# Written by k3bundle calibrate from {base.name}: its limits, widened to {SAFETY:g}x the clean worst\n"
            "# where this device's clean runs needed it (calibration.widened); calibration holds the evidence.\n")
    write_atomic(out, head + yaml.safe_dump(data, sort_keys=False, width=120))
    load_tolerances(out)  # what was written reads back
    return {"widened": changed, "not_separated": lost}
