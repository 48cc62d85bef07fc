"""Layer checks for a case whose goldens tap a sample of positions (the long-context case).

A teacher-forced layer is fed the reference's outputs of the layer before it at *every* position
(attention and the KDA recurrence read them all), but the long case's goldens keep 48 of them so
that their size does not grow with the prompt. So validate recomputes the rest rather than
storing them: the reference is run again — float32 on the weights the goldens were made from
(only where ``devices.exact_applies`` says these are those weights) — and, layer by layer in
lockstep, the device's teacher-forced pass eats each of its layers' outputs as they are made
(``executor.case.teacher_forced_on_replay``). Memory is the two AttnRes streams plus one layer's outputs,
never every layer's; the cost is one float32 prefill more than a case that taps every position.

Both runs are judged at the goldens' positions against the goldens themselves:

- the recomputation, as *exact* checks (``exact.…``): it must reproduce the goldens to the float32
  floor, else what it feeds the device is not the reference; a weight fault is located there;
- the device's teacher-forced outputs, as *added* checks, their limits the goldens' own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from k3bundle.executor.case import teacher_forced_on_replay
from k3bundle.executor.taps import spec_of

EXACT = "exact."  # teacher-forced outputs of the float32 run on the goldens' weights (devices.EXACT)
_NOT_TAPS = ("decode_states.", "routes.", "chunk_states.")  # per-step states, every-position routes, snapshots


def exact_taps(arrays: dict) -> dict[str, torch.Tensor]:
    """The recomputation's arrays judged by the *exact* limits: every per-position tap judged as
    a tensor or as logits, at the prompt's tapped positions and at each decode step."""
    out = {}
    for name, value in arrays.items():
        spec = spec_of(name)
        if name.startswith(_NOT_TAPS) or spec is None or spec.state or spec.judged not in ("tensor", "logits"):
            continue
        out[EXACT + name] = value
    return out


def recomputed_layer_checks(weights, reference_weights, golden: dict, ids: np.ndarray | Sequence[int],
                            after_step=None) -> dict[str, torch.Tensor]:
    """The layer outputs of a case with sampled positions (``CaseOutput.layers``): the device's
    teacher-forced outputs at the goldens' positions, prompt and every decode step, and the
    float32 recomputation's own (``exact.…``).

    ``reference_weights``: the weights the goldens were made from, under the float32 policy.
    The recomputation replays the golden case (golden routes, decode fed the golden tokens) and
    feeds the device's prompt layer by layer; its decode steps are fed the goldens' ``decode.…``
    taps (``executor.case.teacher_forced_on_replay``). ``after_step``: the device's cache
    handling, in both runs, as in ``devices.device_arrays``."""
    run, layers = teacher_forced_on_replay(weights, reference_weights, golden, [int(i) for i in ids], after_step)
    layers.update(exact_taps(run.arrays))
    return layers
