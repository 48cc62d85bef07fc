"""Judge candidate intermediates against goldens, tap by tap (Polygraphy-style results).

Every comparison returns a ``TapResult`` that carries its evidence: the metric values, the
limits applied, whether it passed, and for a failure the minimum limit that would have passed
(style-anchors §5); ``findings`` orders the failures and names the first. One rule judges every
metric: ``golden.tolerances.METRICS`` says whether its limit is a max or a min.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3bundle.executor.taps import layer_of
from k3bundle.golden.noise import basis_text
from k3bundle.golden.tolerances import METRICS, Tolerances
from k3bundle import metrics as M


@dataclass
class TapResult:
    case: str
    tap: str
    mode: str  # "inherited" (free-running) or "added" (teacher-forced)
    values: dict[str, float]
    limits: dict[str, float]
    passed: bool
    min_required: dict[str, float] = field(default_factory=dict)
    nonfinite: dict | None = None  # NaN/Inf counts on each side where either has one (nonfinite_evidence)
    basis: dict | None = None  # per metric, what its limit came from (golden.noise.widen_with_basis)

    @property
    def layer(self) -> int | None:
        return layer_of(self.tap)

    def __bool__(self) -> bool:
        return self.passed

    def _from(self, metric: str) -> str:
        """`` (2.5 × noise 7.3e-04)`` where the reference's BF16 noise set this limit."""
        text = basis_text(metric, self.basis)
        return "" if text.startswith("fixed") else f" ({text})"

    def line(self) -> str:
        vals = ", ".join(f"{k}={_fmt(v)}" for k, v in self.values.items())
        lims = ", ".join(f"{k} {'>=' if METRICS[k] == 'min' else '<='} {_fmt(v)}" + self._from(k)
                         for k, v in self.limits.items())
        status = "PASSED" if self.passed else "FAILED"
        tap = self.tap if self.nonfinite is None else f"{self.tap}: {nonfinite_text(self.nonfinite)}"
        return f"{status} | {self.case} | {self.mode} | {tap} | {vals} | limits {lims}"


def nonfinite_evidence(ref: torch.Tensor, x: torch.Tensor, logits: bool = False) -> dict | None:
    """NaN/Inf counts of the device's and the golden's values and where the device's first one
    is, or None when both are finite. The first index reads as (token row, channel) for a
    [tokens, channels] tap, (token row, vocab id) for logits; a token row is the index among the
    tap's tapped positions (the prompt position itself where every position is tapped)."""
    d, g = M.nonfinite(x), M.nonfinite(ref)
    if not d.count and not g.count:
        return None
    where = None
    if d.first is not None:
        if len(d.first) == 2:
            where = f"token {d.first[0]}, {'vocab id' if logits else 'channel'} {d.first[1]}"
        elif len(d.first) == 1:
            where = f"token {d.first[0]}"
        else:
            where = "index [" + ", ".join(map(str, d.first)) + "]"
    return {"device": {"nan": d.nan, "inf": d.inf}, "golden": {"nan": g.nan, "inf": g.inf}, "total": d.total,
            "first": None if d.first is None else list(d.first), "where": where}


def nonfinite_text(nf: dict) -> str:
    """``96 of 4,096 values NaN (first: token 0, channel 17)``, and the golden's own if any."""
    d, g = nf["device"], nf["golden"]
    kinds = [f"{n:,} {k}" for k, n in (("NaN", d["nan"]), ("Inf", d["inf"])) if n]
    out = []
    if kinds:
        head = kinds[0].split(" ")
        out.append(f"{head[0]} of {nf['total']:,} values {head[1]}" + "".join(f", {k}" for k in kinds[1:])
                   + (f" (first: {nf['where']})" if nf.get("where") else ""))
    if g["nan"] or g["inf"]:
        out.append(f"the golden has {g['nan']:,} NaN and {g['inf']:,} Inf")
    return "; ".join(out)


def _finite_rule(nf: dict | None) -> bool:
    """False when the device has a non-finite value the golden does not: never a pass."""
    return nf is None or (nf["device"]["nan"] + nf["device"]["inf"]) <= (nf["golden"]["nan"] + nf["golden"]["inf"])


def _fmt(v: float) -> str:
    return f"{v:.3e}" if isinstance(v, float) and (abs(v) < 1e-2 or abs(v) > 1e4) and v != 0 else f"{v:.6g}"


def judge(values: dict[str, float], limits: dict[str, float]) -> tuple[bool, dict[str, float]]:
    """(passed, {metric: value} of every limit missed). NaN never passes."""
    ok, need = True, {}
    for metric, limit in limits.items():
        v = values.get(metric)
        if v is None:
            continue
        good = v <= limit if METRICS[metric] == "max" else v >= limit
        if not good or (isinstance(v, float) and math.isnan(v)):
            ok = False
            need[metric] = v
    return ok, need


def compare_tensor(case: str, tap: str, ref: torch.Tensor, x: torch.Tensor, tol: Tolerances,
                   mode: str, limits: dict[str, float] | None = None, basis: dict | None = None) -> TapResult:
    limits = tol.limits(mode, tap) if limits is None else limits
    values = {"nmse": M.nmse(ref, x), "cosine": M.cosine(ref, x), "max_abs": M.max_abs(ref, x)}
    ok, need = judge(values, limits)
    nf = nonfinite_evidence(ref, x)
    return TapResult(case, tap, mode, values, limits, ok and _finite_rule(nf), need, nf, basis or None)


def compare_logits(case: str, tap: str, ref: torch.Tensor, x: torch.Tensor, tol: Tolerances,
                   limits: dict[str, float] | None = None, basis: dict | None = None) -> TapResult:
    k = M.kld(ref, x)
    values = {"kld_mean": float(k.mean()) if k.numel() else 0.0, "kld_p99": M.quantile(k, 0.99),
              "top1": M.topk_agreement(ref, x, 1), "top5": M.topk_agreement(ref, x, min(5, ref.shape[-1]))}
    limits = dict(tol.logits) if limits is None else limits
    ok, need = judge(values, limits)
    nf = nonfinite_evidence(ref, x, logits=True)
    return TapResult(case, tap, "distribution", values, limits, ok and _finite_rule(nf), need, nf, basis or None)


def compare_router(case: str, tap: str, ref_ids: torch.Tensor, ids: torch.Tensor,
                   ref_margin: torch.Tensor | None, tol: Tolerances,
                   noise: torch.Tensor | None = None) -> TapResult:
    """Expert sets per token; a flip is exempt where the golden selection margin is below
    ``near_tie_eps`` or below ``noise_sigmas`` standard deviations of the device's own margin
    noise (``noise``: what the rounding of its router input can move the margin by)."""
    eps = torch.tensor(tol.router.get("near_tie_eps", 0.0), dtype=torch.float64)
    if noise is not None:
        eps = torch.maximum(eps, tol.router.get("noise_sigmas", 0.0) * noise.reshape(-1).to(torch.float64))
    agree, exempt = M.expert_set_agreement(ref_ids, ids, ref_margin, eps)
    limits = {"expert_set": tol.router.get("expert_set", 1.0)}
    ok, need = judge({"expert_set": agree}, limits)
    return TapResult(case, tap, "router", {"expert_set": agree, "near_tie_exempt": float(exempt)},
                     limits, ok, need)


@dataclass(frozen=True)
class GreedyResult:
    matched: int  # tokens equal before the first divergence
    total: int
    first_divergence: int | None  # step index, None if all equal
    near_tie: bool  # the golden top-1 / top-2 gap at that step was below the margin
    passed: bool
    gap: float | None = None  # that gap
    margin: float | None = None  # the margin it was judged against
    nonfinite_step: int | None = None  # the first step whose device logits had NaN/Inf: a token chosen over them


def compare_greedy(ref_tokens, tokens, ref_step_logits: torch.Tensor, tol: Tolerances,
                   margin_at: Callable[[int], float] | None = None,
                   step_logits: torch.Tensor | None = None) -> GreedyResult:
    """Greedy agreement; a divergence passes at a near tie. ``margin_at(step)``: the near-tie
    margin at a step (default: the tolerance file's; validate widens it with the reference's
    own BF16 logit noise, ``golden.noise.near_tie_margin``). ``step_logits``: the device's own
    logits per step, where it has them: a token chosen over NaN/Inf logits never passes, even
    when it happens to equal the golden one (an engine emitting token 0 over NaN logits)."""
    if step_logits is not None and step_logits.is_floating_point():
        bad = (~torch.isfinite(step_logits.reshape(step_logits.shape[0], -1))).any(-1).nonzero()
        if bad.numel():
            s = int(bad[0, 0])
            res = _greedy(ref_tokens, tokens, ref_step_logits, tol, margin_at)
            return dataclasses.replace(res, passed=False, nonfinite_step=s)
    return _greedy(ref_tokens, tokens, ref_step_logits, tol, margin_at)


def _greedy(ref_tokens, tokens, ref_step_logits: torch.Tensor, tol: Tolerances,
            margin_at: Callable[[int], float] | None) -> GreedyResult:
    ref_tokens, tokens = list(map(int, ref_tokens)), list(map(int, tokens))
    n = min(len(ref_tokens), len(tokens))
    first = next((i for i in range(n) if ref_tokens[i] != tokens[i]), None)
    if first is None and len(ref_tokens) != len(tokens):
        first = n
    if first is None:
        return GreedyResult(len(ref_tokens), len(ref_tokens), None, False, True)
    if first >= ref_step_logits.shape[0]:
        return GreedyResult(first, len(ref_tokens), first, False, False)
    top2 = ref_step_logits[first].to(torch.float64).topk(2).values
    gap = float(top2[0] - top2[1])
    margin = margin_at(first) if margin_at is not None else tol.greedy.get("near_tie_margin", 0.0)
    near = gap < margin
    return GreedyResult(first, len(ref_tokens), first, near, near, gap, margin)
