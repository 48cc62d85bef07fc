"""Comparison metrics, pure functions over tensors (computed in float64).

Families, as in Polygraphy's ``CompareFunc`` (style-anchors §5), one small function each:
- distance: ``nmse``, ``cosine``, ``rel_l2``, ``max_abs`` — any tap;
- distribution: ``kld`` per position (mean / p99 taken by the caller), ``topk_agreement``;
- indices: ``expert_set_agreement`` with a near-tie exemption (spec/validation-landscape.md §12:
  flips are allowed only where the golden margin between the k-th and (k+1)-th selection score
  is below eps).

NaN or Inf anywhere in a candidate makes every distance metric the worst value (NaN never
passes); ``nonfinite`` counts them and finds the first, so that a report can say how many and
where instead of only "inf". An all-zero reference makes NMSE relative to 1 instead of dividing
by zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _pair(ref: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if tuple(ref.shape) != tuple(x.shape):
        raise ValueError(f"shapes differ: reference {list(ref.shape)} vs candidate {list(x.shape)}")
    return ref.detach().to("cpu", torch.float64).flatten(), x.detach().to("cpu", torch.float64).flatten()


def finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


@dataclass(frozen=True)
class NonFinite:
    """The NaN and Inf values of one tensor: counts, and the index of the first in row-major order."""

    nan: int
    inf: int
    total: int
    shape: tuple[int, ...]
    first: tuple[int, ...] | None  # None when every value is finite

    @property
    def count(self) -> int:
        return self.nan + self.inf


def nonfinite(x: torch.Tensor) -> NonFinite:
    """Count ``x``'s NaN and Inf values and locate the first (row-major)."""
    x = x.detach()
    if not x.is_floating_point():
        return NonFinite(0, 0, x.numel(), tuple(x.shape), None)
    nan, inf = torch.isnan(x), torch.isinf(x)
    bad = (nan | inf).reshape(-1).nonzero()
    first = None
    if bad.numel():
        flat, first = int(bad[0, 0]), []
        for n in reversed(x.shape):
            flat, i = divmod(flat, n)
            first.append(i)
        first = tuple(reversed(first))
    return NonFinite(int(nan.sum()), int(inf.sum()), x.numel(), tuple(x.shape), first)


def nmse(ref: torch.Tensor, x: torch.Tensor) -> float:
    """||x - ref||^2 / ||ref||^2 (inf if x has NaN/Inf)."""
    r, c = _pair(ref, x)
    if not finite(c):
        return math.inf
    den = float((r * r).sum())
    return float(((c - r) ** 2).sum()) / (den if den > 0 else 1.0)


def rel_l2(ref: torch.Tensor, x: torch.Tensor) -> float:
    return math.sqrt(nmse(ref, x))


def cosine(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Cosine similarity (-inf if x has NaN/Inf; 1 when both are all zero)."""
    r, c = _pair(ref, x)
    if not finite(c):
        return -math.inf
    nr, nc = float(r.norm()), float(c.norm())
    if nr == 0 and nc == 0:
        return 1.0
    if nr == 0 or nc == 0:
        return 0.0
    return float((r @ c) / (nr * nc))


def max_abs(ref: torch.Tensor, x: torch.Tensor) -> float:
    r, c = _pair(ref, x)
    if not finite(c):
        return math.inf
    return float((c - r).abs().max()) if r.numel() else 0.0


def kld(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P) per position over the last axis, float64 [positions]."""
    if tuple(ref_logits.shape) != tuple(logits.shape):
        raise ValueError(f"shapes differ: reference {list(ref_logits.shape)} vs candidate {list(logits.shape)}")
    lp_ref = torch.log_softmax(ref_logits.to(torch.float64), -1)
    lp = torch.log_softmax(logits.to(torch.float64), -1)
    out = (lp_ref.exp() * (lp_ref - lp)).sum(-1).reshape(-1)
    return torch.where(torch.isfinite(out), out, torch.full_like(out, math.inf))


def quantile(values: torch.Tensor, q: float) -> float:
    v = values.to(torch.float64).flatten()
    if not v.numel():
        return 0.0
    out = float(torch.quantile(v, q))
    # interpolating between two infinite values gives NaN: the quantile of infinities is infinite
    return math.inf if math.isnan(out) and not bool(v.isnan().any()) else out


def topk_agreement(ref_logits: torch.Tensor, logits: torch.Tensor, k: int = 1) -> float:
    """Fraction of positions whose top-k token sets are equal (k = 1: same argmax)."""
    a = ref_logits.to(torch.float64).topk(k, -1).indices.reshape(-1, k)
    b = logits.to(torch.float64).topk(k, -1).indices.reshape(-1, k)
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return float(same.double().mean()) if same.numel() else 1.0


def expert_set_agreement(ref_ids: torch.Tensor, ids: torch.Tensor, ref_margin: torch.Tensor | None = None,
                         eps: float | torch.Tensor = 0.0) -> tuple[float, int]:
    """Fraction of tokens whose routed-expert sets agree, and the count of exempted flips.

    Args:
        ref_ids (`Tensor` [tokens, k]): golden top-k expert ids.
        ids (`Tensor` [tokens, k]): candidate ids.
        ref_margin (`Tensor` [tokens], optional): golden selection-score gap between the k-th and
            (k+1)-th expert; a differing set counts as agreeing when this gap is below ``eps``.
        eps (`float` or `Tensor` [tokens]): the near-tie threshold, one for all tokens or one per
            token. Defaults to 0 (no exemption).

    Returns:
        (agreement in [0, 1], number of exempted near-tie flips).
    """
    if tuple(ref_ids.shape) != tuple(ids.shape):
        raise ValueError(f"shapes differ: reference {list(ref_ids.shape)} vs candidate {list(ids.shape)}")
    a = ref_ids.reshape(-1, ref_ids.shape[-1]).sort(-1).values
    b = ids.reshape(-1, ids.shape[-1]).sort(-1).values
    same = (a == b).all(-1)
    exempt = torch.zeros_like(same)
    eps = torch.as_tensor(eps, dtype=torch.float64).reshape(-1)
    if ref_margin is not None and bool((eps > 0).any()):
        exempt = (~same) & (ref_margin.reshape(-1).to(torch.float64) < eps)
    ok = same | exempt
    return (float(ok.double().mean()) if ok.numel() else 1.0), int(exempt.sum())
