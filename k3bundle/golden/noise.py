"""The reference's own sensitivity to BF16 arithmetic: what a free-running limit widens to.

A free-running comparison (a device's own run, every tap carrying the error of all layers
before it) measures the device *and* the model: a chaotic model (random weights) amplifies BF16
rounding tenfold more than a trained one. A fixed limit is then loose for a trained model or a
false alarm on a chaotic one (docs/validation.md "Calibration": random `tiny` failed one clean
bundle in three on fixed limits, the trained tiny none). So at golden time each case runs once
more under the ``bfloat16`` policy, replaying the golden routes and decoding the golden tokens
exactly as validate's built-in device does (``executor.case.replay_case``), and every
free-running metric of that run against the float32 goldens is stored beside them:

- ``bf16_noise.nmse.{tap}``, ``bf16_noise.cosine.{tap}``: every tap judged as a tensor;
- ``bf16_noise.kld_mean|kld_p99|top1.{logits|step_logits}``;
- ``bf16_noise.drift_nmse.{decode_states name}``: the worst per-step state drift;
- ``bf16_noise.logit_shift.step_logits``: per decode step, the largest change of any logit
  (so a greedy divergence at a gap the reference's own rounding could close is a near tie).

validate widens a free-running limit to ``noise.factor`` × this value (for a lower bound, the
deficit 1 − value) where that is looser than the tolerance file's limit, never tighter.

The teacher-forced (added) checks, which locate faults, have the same problem one layer at a
time: what a layer adds in BF16 depends on how far its weights amplify rounding, and a deep
random model has layers that add more than the tiny one's worst (docs/validation.md, "A clean
false alarm at full depth"). So the reference runs its layers once more teacher-forced in BF16
on the goldens' own inputs (exactly what validate's built-in device does,
``Executor.teacher_forced``; a case that taps a sample of positions is fed a replay of itself at
every position, as validate feeds it: ``sampled_added_noise``), and stores
``bf16_noise.nmse.added.{tap}`` and ``bf16_noise.cosine.added.{tap}`` (at the tapped
positions); an added limit widens to ``noise.added_factor`` × that, never tighter than the
fixed limit. The factor is smaller
than the free-running one: a teacher-forced value has no chaotic amplification to absorb,
only the difference between a device's BF16 arithmetic and the reference's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from k3bundle import metrics as M
from k3bundle.executor.case import replay_case
from k3bundle.executor.taps import spec_of
from k3bundle.golden.store import as_tensor
from k3bundle.golden.tolerances import METRICS

PREFIX = "bf16_noise."
ADDED = "added."  # teacher-forced noise: bf16_noise.{metric}.added.{tap}


def noise_key(metric: str, tap: str) -> str:
    return f"{PREFIX}{metric}.{tap}"


def noise_arrays(bf16_weights, golden: Mapping[str, np.ndarray], ids: Sequence[int],
                 forms: str = "fast") -> dict[str, np.ndarray]:
    """Free-running metrics of a BF16 replay of one golden case (float64 scalars by key, and
    the per-step logit shift), with the executor's ``forms``."""
    return noise_metrics(golden, replay_case(bf16_weights, golden, ids, forms=forms).arrays)


def noise_metrics(golden: Mapping[str, np.ndarray], run: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The metrics of ``noise_arrays`` from a BF16 replay's arrays (``run``)."""
    out: dict[str, object] = {}
    for name, x in run.items():
        if name not in golden:
            continue
        ref = as_tensor(golden[name])
        if name.startswith("decode_states."):
            steps = min(ref.shape[0], x.shape[0])
            out[noise_key("drift_nmse", name)] = max((M.nmse(ref[i], x[i]) for i in range(steps)), default=0.0)
            continue
        spec = spec_of(name)
        how = "logits" if name == "step_logits" else (spec.judged if spec is not None else None)
        if how == "logits" and ref.numel():
            k = M.kld(ref, x.to(torch.float64))
            out[noise_key("kld_mean", name)] = float(k.mean())
            out[noise_key("kld_p99", name)] = M.quantile(k, 0.99)
            out[noise_key("top1", name)] = M.topk_agreement(ref, x, 1)
            if name == "step_logits":  # [steps]: one value per step, not a scalar
                shift = (x.to(torch.float64) - ref.to(torch.float64)).abs().amax(dim=-1)
                out[noise_key("logit_shift", name)] = shift.cpu().numpy()
        elif how == "tensor" and ref.numel():
            out[noise_key("nmse", name)] = M.nmse(ref, x)
            out[noise_key("cosine", name)] = M.cosine(ref, x)
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def added_noise_steps(bf16_weights, golden: Mapping[str, np.ndarray]):
    """The teacher-forced metrics of a BF16 run of every layer fed the goldens (prompt and
    decode steps, as validate's built-in device runs it), as a generator of layer requests
    (``executor.model.drive_lockstep`` shares each layer's read among cases); the golden must
    tap every position."""
    from k3bundle.executor import Executor

    feed = lambda n: as_tensor(golden.get(n))  # noqa: E731
    outputs = yield from Executor(bf16_weights).teacher_forced_steps(feed, decode=True)
    return added_noise_metrics(golden, outputs)


def sampled_added_noise_steps(bf16_weights, weights, golden: Mapping[str, np.ndarray],
                              ids: Sequence[int]) -> tuple:
    """``added_noise_steps`` of a case that taps a sample of positions: the BF16 teacher-forced
    pass fed, at every position, a replay of the case on the goldens' own ``weights`` (what
    validate's built-in device is fed for such a case: ``executor.case.teacher_forced_on_replay``),
    judged at the tapped positions and every decode step. Two generators of layer requests,
    (replay on ``weights``, metrics on ``bf16_weights``), to run in this order in one
    ``executor.model.drive_lockstep``; the second returns the metrics."""
    from k3bundle.executor.case import teacher_forced_on_replay_steps

    replay, fed = teacher_forced_on_replay_steps(bf16_weights, weights, golden, [int(i) for i in ids])

    def metrics():
        return added_noise_metrics(golden, (yield from fed))

    return replay, metrics()


def sampled_added_noise(bf16_weights, weights, golden: Mapping[str, np.ndarray],
                        ids: Sequence[int]) -> dict[str, np.ndarray]:
    """``sampled_added_noise_steps`` run to its end: one case alone."""
    from k3bundle.executor.model import drive_lockstep

    runs = sampled_added_noise_steps(bf16_weights, weights, golden, ids)
    return drive_lockstep(list(runs), [weights, bf16_weights])[1]


def added_noise_arrays(bf16_weights, golden: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``added_noise_steps`` run to its end: one case alone."""
    from k3bundle.executor.model import drive

    return drive(added_noise_steps(bf16_weights, golden), bf16_weights)


def added_noise_metrics(golden: Mapping[str, np.ndarray], outputs: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """``bf16_noise.{nmse|cosine}.added.{tap}`` of teacher-forced BF16 layer ``outputs``."""
    out: dict[str, float] = {}
    for name, x in outputs.items():
        if name.startswith(("own.", "noise.")) or name not in golden:
            continue
        ref = as_tensor(golden[name])
        if ref.numel():
            out[noise_key("nmse", ADDED + name)] = M.nmse(ref, x)
            out[noise_key("cosine", ADDED + name)] = M.cosine(ref, x)
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def widen(limits: dict[str, float], golden: Mapping, tap: str, factor: float) -> dict[str, float]:
    """``limits`` with each widened to ``factor`` × the reference's BF16 noise at ``tap``."""
    return widen_with_basis(limits, golden, tap, factor)[0]


def widen_with_basis(limits: dict[str, float], golden: Mapping, tap: str,
                     factor: float) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``widen``'s limits, and per metric what they were derived from where the goldens carry
    noise for it: ``{"fixed": the tolerance file's limit, "noise": the reference's own BF16
    value, "factor": factor}`` (the limit is the looser of fixed and factor × noise)."""
    if factor <= 0:
        return limits, {}
    out, basis = dict(limits), {}
    for metric, limit in limits.items():
        v = golden.get(noise_key(metric, tap))
        if v is None:
            continue
        v = float(np.asarray(v, dtype=np.float64).reshape(-1)[0])
        if METRICS.get(metric) == "min":  # lower bounds (cosine, top-1): widen the deficit
            out[metric] = min(limit, 1.0 - factor * (1.0 - v))
        else:
            out[metric] = max(limit, factor * v)
        basis[metric] = {"fixed": limit, "noise": v, "factor": factor}
    return out, basis


def basis_text(metric: str, basis: Mapping | None) -> str:
    """Where a limit came from, as a report says it: ``2.5 × noise 7.3e-04`` where the
    reference's own BF16 noise set it, ``fixed`` where the tolerance file's limit did (with the
    noise term it beat, if any). A lower bound's noise is its deficit from 1."""
    b = (basis or {}).get(metric)
    if b is None:
        return "fixed"
    lower = METRICS.get(metric) == "min"
    noise, fixed = ((1.0 - b["noise"]), (1.0 - b["fixed"])) if lower else (b["noise"], b["fixed"])
    what = f"{b['factor']:g} × {'noise deficit' if lower else 'noise'} {noise:.2e}"
    return what if b["factor"] * noise > fixed else f"fixed ({what} is tighter)"


def near_tie_margin(tol_margin: float, golden: Mapping, step: int, factor: float) -> float:
    """The top-1/top-2 gap below which a greedy divergence at ``step`` is a tie: the tolerance
    file's margin, or ``factor`` × twice the reference's own largest logit shift there (a gap
    between two tokens moves by at most twice the largest single-logit change), if larger."""
    v = golden.get(noise_key("logit_shift", "step_logits"))
    if factor <= 0 or v is None:
        return tol_margin
    v = np.asarray(v, dtype=np.float64).reshape(-1)
    return max(tol_margin, factor * 2.0 * float(v[step])) if step < v.size else tol_margin
