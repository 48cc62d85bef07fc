"""Judging one case: free-running (inherited) checks, teacher-forced layer checks, greedy
agreement and state drift. Which taps are judged how comes from the tap grammar
(``executor.taps.TAPS``: ``judged``), every limit from the tolerance file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from k3bundle.executor.taps import spec_of, tap_kind
from k3bundle.golden.noise import ADDED, widen_with_basis
from k3bundle.golden.tolerances import Tolerances
from k3bundle import metrics as M
from k3bundle.validate.compare import TapResult, compare_logits, compare_router, compare_tensor
from k3bundle.validate.devices import EXACT, as_tensor

OWN = "own."  # teacher-forced outputs: the layer's own (unforced) expert choice
NOISE = "noise."  # ... and how far its selection margin can move from its input's rounding
NOT_TAPS = ("positions", "greedy_tokens", "chunk_positions")


def _judged(name: str) -> str | None:
    """How a candidate array is judged: its tap kind's ``judged`` (None: not a tap)."""
    if name in NOT_TAPS or name.startswith(("decode_states.", "routes.", "chunk_states.")):
        return None
    spec = spec_of(name)
    return None if spec is None else spec.judged


def inherited_checks(golden: dict, cand: dict, case: str, tol: Tolerances, routers: bool = True) -> list[TapResult]:
    """Free-running comparisons of every tap the candidate has against the golden, plus the
    step logits. ``routers=False`` when the candidate replayed the golden routing."""
    results = []
    for name in sorted(cand):
        if name not in golden:
            continue
        how = "logits" if name == "step_logits" else _judged(name)
        ref, x = as_tensor(golden[name]), cand[name]
        factor = tol.noise.get("factor", 0.0)  # free-running limits widen with the reference's BF16 noise
        if how == "logits":
            limits, basis = widen_with_basis(dict(tol.logits), golden, name, factor)
            results.append(compare_logits(case, name, ref, x.to(ref.device), tol, limits, basis))
        elif how == "tensor":
            limits, basis = widen_with_basis(tol.limits("inherited", name), golden, name, factor)
            results.append(compare_tensor(case, name, ref, x, tol, "inherited", limits, basis))
    for name in sorted(cand):
        if routers and _judged(name) == "router" and name in golden and not name.startswith("decode."):
            results.append(compare_router(case, name, as_tensor(golden[name]), cand[name],
                                          as_tensor(golden.get(_margin_of(name))), tol))
    return results


def _margin_of(router_ids: str) -> str:
    return router_ids[: -len(tap_kind(router_ids))] + "router_margin"


def layer_checks(outputs: dict[str, torch.Tensor], ref: Callable[[str], object], case: str, tol: Tolerances,
                 mode: str, margins: Callable[[str], object], exact_section: str = "exact",
                 noise: Mapping | None = None) -> list[TapResult]:
    """Teacher-forced layer outputs against ``ref``: "added" (fed the goldens) or "emulation"
    (fed a dump's own outputs). Own expert choices are judged as sets with the golden margins;
    ``exact.…`` outputs by ``exact_section``'s limits (``exact`` or ``exact_gpu``). ``noise``
    (the goldens): "added" limits widen to ``noise.added_factor`` × the reference's own
    teacher-forced BF16 noise at each tap, where the goldens carry it (``golden.noise``)."""
    results = []
    factor = tol.noise.get("added_factor", 0.0) if mode == "added" and noise is not None else 0.0
    for name, value in outputs.items():
        if name.startswith(NOISE):
            continue
        if name.startswith(EXACT):  # the goldens' precision on the goldens' weights: to the float32 floor
            expected = ref(name[len(EXACT):])
            if expected is not None:
                results.append(compare_tensor(case, name[len(EXACT):], as_tensor(expected), value, tol, exact_section))
            continue
        tap = name[len(OWN):] if name.startswith(OWN) else name
        expected = ref(tap)
        if expected is None:
            continue
        if name.startswith(OWN):
            results.append(compare_router(case, tap, as_tensor(expected), value,
                                          as_tensor(margins(_margin_of(tap))), tol,
                                          outputs.get(NOISE + _margin_of(tap))))
        else:
            limits, basis = widen_with_basis(tol.limits(mode, name), noise, ADDED + name, factor) if factor \
                else (None, None)
            results.append(compare_tensor(case, name, as_tensor(expected), value, tol, mode, limits, basis))
    return results


def drift_limits(golden: dict, names, tol: Tolerances) -> tuple[dict[str, float], dict[str, dict]]:
    """Per state: the fixed drift limit widened with the reference's own BF16 drift, and what
    each limit came from (``widen_with_basis``) where the goldens carry that drift."""
    base, factor = tol.state.get("drift_nmse", float("inf")), tol.noise.get("factor", 0.0)
    limits, basis = {}, {}
    for n in names:
        lim, b = widen_with_basis({"drift_nmse": base}, golden, n, factor)
        limits[n] = lim["drift_nmse"]
        if b:
            basis[n] = b["drift_nmse"]
    return limits, basis


def state_drift(golden: dict, cand: dict) -> dict[str, list[float]]:
    """Per decode step NMSE of each layer's state (KDA recurrent state, newest MLA latent row)."""
    out = {}
    for name in sorted(cand):
        if name.startswith("decode_states.") and name in golden:
            g, c = as_tensor(golden[name]), cand[name]
            out[name] = [M.nmse(g[i], c[i]) for i in range(min(g.shape[0], c.shape[0]))]
    return out
