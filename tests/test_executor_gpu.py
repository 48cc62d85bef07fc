"""The executor on a CUDA device against CPU float64 (skipped cleanly without CUDA).

Routing is teacher-forced from the float64 run (``forced_routes``) so that a near-tie expert
flip, legitimate in lower precision, does not dominate the comparison.
"""

from __future__ import annotations

import pytest
import torch

from k3bundle.executor import Executor, SourceWeights, TapRecorder

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TAPS = ["layers.*.mixer_out", "layers.*.ffn_out", "layers.*.router_ids", "final_hidden", "logits"]


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    ids = torch.randint(0, 1000, (80,), generator=torch.Generator().manual_seed(0))
    rec = TapRecorder(TAPS)
    Executor(SourceWeights(tiny_ckpt, dtype="float64"), rec).prefill(ids)
    return ids, rec


def _run(tiny_ckpt, dtype, ids, ref):
    forced = {n: ref[n] for n in ref.names() if n.endswith("router_ids")}
    rec = TapRecorder(TAPS)
    Executor(SourceWeights(tiny_ckpt, dtype=dtype, device="cuda"), rec, forced_routes=forced).prefill(ids)
    return {n: ((rec[n].double() - ref[n]).norm() / ref[n].norm()).item()
            for n in ref.names() if not n.endswith("router_ids")}


def test_cuda_float32_matches_cpu_float64(tiny_ckpt, reference):
    ids, ref = reference
    errs = _run(tiny_ckpt, "float32", ids, ref)
    assert max(errs.values()) < 1e-4, errs


def test_cuda_bfloat16_stays_within_emulation_error(tiny_ckpt, reference):
    ids, ref = reference
    errs = _run(tiny_ckpt, "bfloat16", ids, ref)
    assert errs["logits"] < 0.2 and max(errs.values()) < 0.3, errs


def test_cuda_prefill_then_decode_equals_longer_prefill(tiny_ckpt):
    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(1))
    ex = Executor(SourceWeights(tiny_ckpt, dtype="float32", device="cuda", resident=True))
    full, _ = ex.prefill(ids)
    _, cache = ex.prefill(ids[:66])
    for i in range(66, 70):
        row = ex.decode(int(ids[i]), cache)
        assert ((row - full[i]).norm() / full[i].norm()).item() < 1e-4
