"""Tolerance files (``tolerances/NAME.yaml``): thresholds per tap kind and numeric format.

A file has these sections (docs/validation.md explains each number's origin):
- ``added``: the error one layer adds when fed the golden input (teacher-forced), per tap kind;
- ``emulation``: a dumped layer output against k3bundle's emulation of that layer in the dump's
  own precision, fed the dump's own inputs (arithmetic noise only; spec §12 "bit-exact emulation");
- ``inherited``: the error a free-running device run carries to each tap;
- ``logits``: KL divergence mean / p99 and top-1 agreement against the golden distribution;
- ``router``: expert-set agreement and the near-tie margin that exempts a flip;
- ``exact`` and ``exact_gpu``: the built-in device once more in the goldens' float32 on the
  goldens' own weights: CPU against CPU goldens (the same arithmetic: clean value 0), and where a
  GPU is on either side (summation order and library functions differ: a measured floor);
- ``greedy`` and ``state``: near-tie logit gap for greedy divergence, per-step state drift;
- ``noise``: ``factor``, how far free-running limits (inherited, logits, state) widen with the
  reference's own BF16 noise (``golden.noise``), and ``added_factor``, how far the teacher-forced
  (added) limits widen with the reference's own teacher-forced BF16 noise; absent or 0: fixed limits.

Per-tap sections map a tap kind (the last part of a tap name; the kinds the tap grammar
``executor.taps.TAPS`` judges as tensors or logits) or ``default`` to metric limits. ``METRICS``
is the one table of metrics and their direction: a ``max`` limit is an upper bound (NMSE, KL
divergence), a ``min`` limit a lower bound (cosine, top-1 agreement, expert-set agreement).
Unknown sections, kinds or metrics are errors: a typo must not silently loosen a gate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from k3bundle.data_dirs import data_dirs
from k3bundle.errors import YamlFileError
from k3bundle.executor.taps import JUDGED_KINDS, tap_kind
from k3bundle.golden.errors import ToleranceError
from k3bundle.io.strict_yaml import read_yaml

#: every metric a limit can be set on, and whether the limit is its "max" or its "min"
METRICS = {
    "nmse": "max", "cosine": "min", "max_abs": "max",  # distance (any tap)
    "kld_mean": "max", "kld_p99": "max", "top1": "min", "top5": "min",  # distribution (logits)
    "expert_set": "min",  # indices (router)
    "drift_nmse": "max",  # a decode state's NMSE per step (state section)
}
#: the values a metric can take, so a limit outside them (cosine -5, top1 7.0, nmse -1) is refused:
#: such a limit would pass or fail every run whatever it measured
METRIC_RANGE = {"cosine": (-1.0, 1.0), "top1": (0.0, 1.0), "top5": (0.0, 1.0), "expert_set": (0.0, 1.0)}
#: every other number in a tolerance file (errors, divergences, margins, factors) is >= 0
NON_NEGATIVE = (0.0, math.inf)
TENSOR_METRICS = ("nmse", "cosine", "max_abs")
SECTIONS = {
    "added": None, "inherited": None, "emulation": None, "exact": None, "exact_gpu": None,
    "logits": {"kld_mean", "kld_p99", "top1"},
    "router": {"expert_set", "near_tie_eps", "noise_sigmas"},
    "greedy": {"near_tie_margin"},
    "state": {"drift_nmse"},
    # free-running limits widen to factor x the reference's BF16 noise, added ones to
    # added_factor x its teacher-forced BF16 noise (golden/noise.py)
    "noise": {"factor", "added_factor"},
}


@dataclass(frozen=True)
class Tolerances:
    name: str
    added: dict[str, dict[str, float]]
    inherited: dict[str, dict[str, float]]
    emulation: dict[str, dict[str, float]]
    exact: dict[str, dict[str, float]]
    logits: dict[str, float]
    router: dict[str, float]
    greedy: dict[str, float]
    state: dict[str, float]
    noise: dict[str, float] = field(default_factory=dict)
    exact_gpu: dict[str, dict[str, float]] = field(default_factory=dict)
    path: str = ""
    # the calibration the limits were set from (k3bundle calibrate): which run, and the worst
    # value every check ("mode/tap kind/metric") reached on clean bundles there
    calibration_run: str = ""
    calibrated_clean_worst: dict[str, float] = field(default_factory=dict)
    # ... and (k3bundle calibrate) the least severe located fault of every check, and the rates
    calibrated_fault_best: dict[str, float] = field(default_factory=dict)
    calibration_rates: dict = field(default_factory=dict)

    def limits(self, section: str, tap: str) -> dict[str, float]:
        """Limits for a tap: its kind's entry over the section's ``default``."""
        table = getattr(self, section)
        return {**table.get("default", {}), **table.get(tap_kind(tap), {})}


def tolerance_dirs() -> list[Path]:
    return data_dirs("tolerances")


def tolerance_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    for d in tolerance_dirs():
        if (d / f"{name}.yaml").is_file():
            return d / f"{name}.yaml"
    known = sorted({f.stem for d in tolerance_dirs() for f in d.glob("*.yaml")})
    raise ToleranceError(f"tolerance set {name!r} not found; available: {', '.join(known)}")


def _num(v, where: str, path: str) -> float:
    """A limit: a finite number within its metric's range (the metric is the last part of ``where``)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ToleranceError(f"{path}: {where} must be a number, got {v!r}")
    if not math.isfinite(v):  # a NaN limit makes every comparison false: a gate that never closes
        raise ToleranceError(f"{path}: {where} must be a finite number, got {v!r}")
    lo, hi = METRIC_RANGE.get(where.rsplit(".", 1)[-1].rsplit("/", 1)[-1], NON_NEGATIVE)
    if not lo <= v <= hi:
        span = f"from {lo:g} to {hi:g}" if math.isfinite(hi) else f">= {lo:g}"
        raise ToleranceError(f"{path}: {where} must be {span}, got {v!r}")
    return float(v)


def load_tolerances(path: str | Path) -> Tolerances:
    path = Path(path)
    try:
        data = read_yaml(path)
    except YamlFileError as e:
        raise ToleranceError(str(e)) from None
    if not isinstance(data, dict) or data.get("schema_version") != 1:
        raise ToleranceError(f"{path}: must be a mapping with schema_version: 1")
    unknown = sorted(set(data) - set(SECTIONS) - {"schema_version", "format", "description", "calibration"})
    if unknown:
        raise ToleranceError(f"{path}: unknown section {unknown[0]!r} (known: {', '.join(SECTIONS)})")
    out = {}
    for section, keys in SECTIONS.items():
        body = data.get(section) or {}
        if not isinstance(body, dict):
            raise ToleranceError(f"{path}: {section} must be a mapping")
        if keys is None:
            table = {}
            for kind, limits in body.items():
                if kind != "default" and kind not in JUDGED_KINDS:
                    raise ToleranceError(f"{path}: {section}.{kind} is not a tap kind ({', '.join(JUDGED_KINDS)})")
                if not isinstance(limits, dict):
                    raise ToleranceError(f"{path}: {section}.{kind} must map metrics to limits")
                bad = sorted(set(limits) - set(TENSOR_METRICS))
                if bad:
                    raise ToleranceError(f"{path}: {section}.{kind}.{bad[0]} is not a metric ({', '.join(TENSOR_METRICS)})")
                table[kind] = {m: _num(v, f"{section}.{kind}.{m}", str(path)) for m, v in limits.items()}
            out[section] = table
        else:
            bad = sorted(set(body) - keys)
            if bad:
                raise ToleranceError(f"{path}: {section}.{bad[0]} is not one of {', '.join(sorted(keys))}")
            out[section] = {k: _num(v, f"{section}.{k}", str(path)) for k, v in body.items()}
    run, worst, fault_best, rates = _calibration(data.get("calibration"), str(path))
    return Tolerances(name=str(data.get("format", path.stem)), path=str(path), calibration_run=run,
                      calibrated_clean_worst=worst, calibrated_fault_best=fault_best, calibration_rates=rates, **out)


def _checks(body, field: str, path: str) -> dict[str, float]:
    """A calibration mapping of "mode/tap kind/metric" keys to values."""
    if not isinstance(body, dict):
        raise ToleranceError(f"{path}: calibration.{field} must map mode/kind/metric to a value")
    for key in body:
        if not isinstance(key, str) or key.count("/") != 2 or key.rsplit("/", 1)[1] not in METRICS:
            raise ToleranceError(f"{path}: calibration.{field}.{key} is not mode/tap kind/metric")
    return {k: _num(v, f"calibration.{field}.{k}", path) for k, v in body.items()}


def _count(v, where: str, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ToleranceError(f"{path}: {where} must be a count (an integer >= 0), got {v!r}")
    return v


def _rates(body, path: str) -> dict:
    """``calibration.rates``: clean bundles and cases with their failures, and per fault
    {runs, detected, located} (``k3bundle calibrate``)."""
    clean = ("clean_bundles", "clean_bundle_failures", "clean_cases", "clean_case_failures")
    if not isinstance(body, dict) or set(body) - {*clean, "faults"}:
        raise ToleranceError(f"{path}: calibration.rates must be a mapping of {', '.join(clean)} and faults")
    out = {k: _count(body[k], f"calibration.rates.{k}", path) for k in clean if k in body}
    faults = body.get("faults") or {}
    if not isinstance(faults, dict):
        raise ToleranceError(f"{path}: calibration.rates.faults must map a fault to its runs, detected, located")
    out["faults"] = {}
    for name, r in faults.items():
        if not isinstance(r, dict) or set(r) != {"runs", "detected", "located"}:
            raise ToleranceError(f"{path}: calibration.rates.faults.{name} must be {{runs, detected, located}}")
        out["faults"][str(name)] = {k: _count(v, f"calibration.rates.faults.{name}.{k}", path) for k, v in r.items()}
    return out


def _calibration(body, path: str) -> tuple[str, dict[str, float], dict[str, float], dict]:
    """``calibration: {run: TEXT, clean_worst: {"mode/kind/metric": value}}`` (evidence, not limits);
    ``k3bundle calibrate`` adds ``fault_best`` (the least severe located fault's value of each
    check), ``rates``, ``widened`` ({key: [old, new]}) and ``not_separated`` (keys)."""
    if body is None:
        return "", {}, {}, {}
    known = {"run", "clean_worst", "fault_best", "rates", "widened", "not_separated"}
    if not isinstance(body, dict) or set(body) - known or not isinstance(body.get("run", ""), str):
        raise ToleranceError(f"{path}: calibration must be a mapping of run (text), clean_worst and fault_best "
                             "(mappings), rates, widened and not_separated")
    widened = body.get("widened") or {}
    if not isinstance(widened, dict) or not all(isinstance(v, list) and len(v) == 2 for v in widened.values()):
        raise ToleranceError(f"{path}: calibration.widened must map mode/kind/metric to [old, new]")
    _checks({k: v[1] for k, v in widened.items()}, "widened", path)
    lost = body.get("not_separated") or []
    if not isinstance(lost, list) or not all(isinstance(k, str) for k in lost):
        raise ToleranceError(f"{path}: calibration.not_separated must be a list of mode/kind/metric")
    rates = _rates(body["rates"], path) if body.get("rates") is not None else {}
    return (body.get("run", ""), _checks(body.get("clean_worst") or {}, "clean_worst", path),
            _checks(body.get("fault_best") or {}, "fault_best", path), rates)
