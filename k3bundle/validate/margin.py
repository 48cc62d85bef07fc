"""How close each check came to its limit, and to what clean bundles reached in calibration.

*Use of the limit* is value / limit for an upper bound (NMSE, KLD, drift) and
(1 − value) / (1 − limit) for a lower bound (cosine, agreement: the distance from a perfect 1);
100% is the limit. The *calibrated clean worst* is the worst value the same check reached on
clean bundles in the calibration run that set the limits (the tolerance file's ``calibration``
section, from ``bench/calibrate.py``). A failing value many times beyond it is unlike any clean
bundle seen — a fault; a value near it is an unlucky case of a clean one.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3bundle.executor.taps import tap_kind
from k3bundle.golden.noise import basis_text
from k3bundle.golden.tolerances import METRICS, Tolerances

NEAR = 0.5  # checks at or above this share of their limit are listed


def check_key(mode: str, tap: str, metric: str) -> str:
    """The calibration's name for a check: mode / tap kind / metric (e.g. ``added/mixer_out/nmse``)."""
    return f"{mode}/{tap_kind(tap)}/{metric}"


def distance(metric: str, v: float) -> float:
    """How far ``v`` is from perfect, in the metric's direction (0 is perfect)."""
    return v if METRICS[metric] == "max" else 1.0 - v


def ratio(metric: str, v: float, to: float) -> float:
    """``v``'s distance from perfect over ``to``'s (inf when ``to`` is perfect and ``v`` is not)."""
    a, b = distance(metric, v), distance(metric, to)
    return a / b if b > 0 else (0.0 if a <= 0 else float("inf"))


def show(metric: str, v: float) -> str:
    """A value as people read it: a lower bound near 1 by its deficit (``1 − 7.1e-05``)."""
    if METRICS.get(metric) == "min" and 0.99 < v < 1:
        return f"1 − {1 - v:.2g}"
    return f"{v:.4g}"


def show_use(use: float) -> str:
    """Use of a limit: a percentage up to 10×, then a multiple (``4.8e+06×``)."""
    return f"{use:.0%}" if use < 10 else f"{use:.3g}×"


@dataclass(frozen=True)
class Margin:
    mode: str
    tap: str
    metric: str
    value: float
    limit: float
    clean_worst: float | None  # None: the check was not calibrated
    basis: dict | None = None  # what the limit came from (golden.noise.widen_with_basis), None: fixed

    @property
    def limit_from(self) -> str:
        """``2.5 × noise 7.3e-04`` where the reference's own BF16 noise set the limit, else ``fixed``."""
        return basis_text(self.metric, {self.metric: self.basis} if self.basis else None)

    @property
    def use(self) -> float:
        return ratio(self.metric, self.value, self.limit)

    @property
    def beyond_clean(self) -> float | None:
        """value relative to the calibrated clean worst (> 1: worse than any clean bundle seen)."""
        return None if self.clean_worst is None else ratio(self.metric, self.value, self.clean_worst)

    def as_dict(self) -> dict:
        return {"mode": self.mode, "tap": self.tap, "metric": self.metric, "value": self.value,
                "limit": self.limit, "limit_from": self.limit_from, "limit_basis": self.basis,
                "use_of_limit": self.use, "calibrated_clean_worst": self.clean_worst,
                "relative_to_clean_worst": self.beyond_clean}


def margins(case, tol: Tolerances, near: float = NEAR) -> list[Margin]:
    """Every check of ``case`` (a ``CaseReport``) at ``near`` of its limit or beyond, worst first."""
    out = []
    worst = tol.calibrated_clean_worst
    for r in case.results:
        for metric, limit in r.limits.items():
            v = r.values.get(metric)
            if isinstance(v, float) and metric in METRICS:
                out.append(Margin(r.mode, r.tap, metric, v, limit, worst.get(check_key(r.mode, r.tap, metric)),
                                  (r.basis or {}).get(metric)))
    for name, vals in case.drift.items():
        if vals:
            out.append(Margin("state", name, "drift_nmse", max(vals), case.limit_of(name),
                              worst.get(check_key("state", name, "drift_nmse")), case.drift_basis.get(name)))
    # NaN compares false: a NaN value is always listed
    listed = [m for m in out if not m.use < near]
    return sorted(listed, key=lambda m: -m.use if m.use == m.use else float("-inf"))
