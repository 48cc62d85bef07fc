"""The executor's fast forms against its readable ones (docs/executor.md "Forms").

The fast forms are the same equations rearranged: KDA's chunks batched (``kda.chunked_batched``)
and routed experts grouped by one sort (``latent_moe.routed_grouped``). In float64 they equal the
readable forms to <= 1e-13 relative; the grouped experts are bit-identical in every dtype (the
same GEMMs on the same rows, the same additions in the same order).
"""

from __future__ import annotations

import pytest
import torch

from k3bundle.executor import Executor, SourceWeights, TapRecorder, kda, latent_moe
from k3bundle.executor.errors import ExecutorError


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def kda_inputs(T, H=3, K=16, V=12, dtype=torch.float64, seed=0, gate_scale=3.0, lower=-5.0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    args = kda.gates(r(T, H, K), r(T, H, K), r(T, H, V), gate_scale * r(T, H, K), r(T, H),
                     torch.rand(H, generator=g, dtype=dtype), r(H, K), lower, dtype)
    return args, r(H, K, V)


@pytest.mark.parametrize("T", [1, 17, 63, 64, 65, 200, 333])
def test_batched_chunks_equal_the_chunk_loop_in_float64(T):
    args, S = kda_inputs(T)
    o1, S1, _ = kda.chunked(*args, S, 64)
    o2, S2, saved = kda.chunked_batched(*args, S, 64, -5.0, block_tokens=128,
                                        boundaries=[b for b in (64, 128, 192, T) if b <= T])  # blocks of 128
    assert o2.shape == o1.shape and S2.shape == S1.shape
    assert rel(o2, o1) <= 1e-13 and rel(S2, S1) <= 1e-13
    o3, S3 = kda.recurrent(*args, S)  # and both equal the recurrence (K5 as written)
    assert rel(o2, o3) <= 1e-13 and rel(S2, S3) <= 1e-13
    for b, S_b in saved.items():  # the snapshots are the states after b tokens
        assert rel(S_b, kda.recurrent(*(a[:b] for a in args), S)[1]) <= 1e-13, b
    assert torch.equal(saved[T], S2)


@pytest.mark.parametrize("lower", [-5.0, -20.0])
def test_batched_chunks_at_the_gate_lower_bound_stay_finite_and_exact(lower):
    """Every gate at the lower bound: the in-sub-chunk factors reach e^(|lower|·B); the sub-chunk
    length shrinks with the bound so they stay finite in FP32."""
    assert kda.subchunk(64, lower) == (16 if lower == -5.0 else 4)
    for dtype, limit in ((torch.float64, 1e-13), (torch.float32, 2e-5)):
        args, S = kda_inputs(200, dtype=dtype, gate_scale=50.0, lower=lower)
        q, k, v, _, beta = args
        g = torch.full_like(q, lower)  # α = e^lower at every step, every channel
        o1, S1, _ = kda.chunked(q, k, v, g, beta, S, 64)
        o2, S2, _ = kda.chunked_batched(q, k, v, g, beta, S, 64, lower)
        assert torch.isfinite(o2).all() and torch.isfinite(S2).all()
        assert rel(o2, o1) <= limit and rel(S2, S1) <= limit


def test_batched_chunks_in_float32_differ_from_the_loop_by_summation_order_only():
    args, S = kda_inputs(333, dtype=torch.float32)
    ref = kda.chunked(*(a.double() for a in args), S.double(), 64)
    o1, S1, _ = kda.chunked(*args, S, 64)
    o2, S2, _ = kda.chunked_batched(*args, S, 64, -5.0)
    # both forms sit within FP32 rounding of the float64 result, and as close to each other
    for o, s in ((o1, S1), (o2, S2)):
        assert rel(o, ref[0]) < 1e-5 and rel(s, ref[1]) < 1e-5
    assert rel(o2, o1) < 1e-5


def _moe_inputs(dtype, T=37, L=24, I=40, E=12, K=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, L, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    experts = {e: {"moe.expert.w1": torch.randn(I, L, generator=g).to(dtype) / L ** 0.5,
                   "moe.expert.w3": torch.randn(I, L, generator=g).to(dtype) / L ** 0.5,
                   "moe.expert.w2": torch.randn(L, I, generator=g).to(dtype) / I ** 0.5} for e in range(E)}
    return z, ids, w, experts


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("local", ["all", "even"])
def test_grouped_experts_equal_one_scan_per_expert(dtype, local, monkeypatch):
    z, ids, w, experts = _moe_inputs(dtype)
    calls = []

    def expert(e):  # "even": an expert-parallel rank that owns the even experts only
        calls.append(e)
        return experts[e] if local == "all" or e % 2 == 0 else None
    a = latent_moe.routed(z, ids, w, expert, 1.5, 7.0)
    n_readable = len(calls)
    b = latent_moe.routed_grouped(z, ids, w, expert, 1.5, 7.0)
    touched = sorted(set(ids.flatten().tolist()))
    assert sorted(calls[n_readable:]) == touched  # each touched expert fetched once
    exact = latent_moe.routed(*(x.double() for x in (z, ids, w)), lambda e: None if expert(e) is None else
                              {r: v.double() for r, v in experts[e].items()}, 1.5, 7.0)
    assert a.abs().sum() > 0
    if dtype == torch.float64:
        assert rel(b, a) <= 1e-13
    else:  # the batched GEMMs sum in another order: no further from float64 than the scan is
        assert rel(b, exact) <= 2 * rel(a, exact) + 1e-7
    # groups of one or two experts (a small GROUP_BYTES) and token blocks of 8: the same result
    monkeypatch.setitem(latent_moe.GROUP_BYTES, "cpu", 1)
    monkeypatch.setitem(latent_moe.PAIR_BYTES, "cpu", 8 * ids.shape[1] * z.shape[1] * 4)
    c = latent_moe.routed_grouped(z, ids, w, expert, 1.5, 7.0)
    assert rel(c, a) <= (1e-13 if dtype == torch.float64 else 2 * rel(a, exact) + 1e-7)


def test_grouped_experts_decode_mxfp4_straight_into_the_stack():
    """An expert kept as MXFP4 is decoded by the codec into the group's buffer, bit for bit its value()."""
    from k3bundle.formats import mxfp4
    from k3bundle.ops.expert_weight import ExpertWeight

    g = torch.Generator().manual_seed(5)
    z, ids, w, _ = _moe_inputs(torch.float32, L=64, I=32)
    stored = {}
    for e in range(12):
        parts = {}
        for role, (rows, cols) in (("moe.expert.w1", (32, 64)), ("moe.expert.w3", (32, 64)), ("moe.expert.w2", (64, 32))):
            p = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)
            sc = torch.randint(120, 128, (rows, cols // 32), generator=g, dtype=torch.uint8)
            parts[role] = (p, sc)
        stored[e] = parts
    made = []

    def stored_expert(e):
        return {r: ExpertWeight(lambda p=p, s=s: made.append(1) or mxfp4.dequantize(p, s, torch.float32), (p, s))
                for r, (p, s) in stored[e].items()}
    logical = lambda e: {r: mxfp4.dequantize(p, s, torch.float32) for r, (p, s) in stored[e].items()}  # noqa: E731
    a = latent_moe.routed(z, ids, w, logical, 1.5, 7.0)
    b = latent_moe.routed_grouped(z, ids, w, stored_expert, 1.5, 7.0)
    assert not made  # never through value(): decoded into the stack
    assert rel(b, a) < 1e-6


@pytest.fixture(scope="module")
def both_forms(tiny_ckpt):
    ids = torch.randint(0, 1000, (150,), generator=torch.Generator().manual_seed(3))
    out = {}
    for dtype in ("float64", "float32"):
        for forms in ("readable", "fast"):
            rec = TapRecorder()
            ex = Executor(SourceWeights(tiny_ckpt, dtype=dtype, resident=True), rec, forms=forms)
            logits, cache = ex.prefill(ids[:140])
            for t in ids[140:]:
                ex.decode(int(t), cache)
            out[dtype, forms] = rec
    return out


def test_whole_model_fast_equals_readable_in_float64(both_forms):
    a, b = both_forms["float64", "readable"], both_forms["float64", "fast"]
    assert a.names() == b.names()
    for name in a.names():
        if name.endswith("router_ids"):
            assert torch.equal(a[name], b[name]), name
        else:
            assert rel(b[name], a[name]) <= 1e-13, (name, rel(b[name], a[name]))


def test_whole_model_fast_in_float32_is_within_rounding_of_readable(both_forms):
    a, b, ref = both_forms["float32", "readable"], both_forms["float32", "fast"], both_forms["float64", "readable"]
    for name in a.names():
        if name.endswith("router_ids"):
            continue
        # the fast form is no further from float64 than FP32 rounding takes the readable one
        assert rel(b[name], ref[name]) <= max(4 * rel(a[name], ref[name]), 1e-6), name


def test_unknown_forms_is_refused(tiny_ckpt):
    with pytest.raises(ExecutorError, match="forms must be one of fast, readable"):
        Executor(SourceWeights(tiny_ckpt), forms="quick")


@pytest.mark.parametrize("offset,T,S", [(0, 300, 300), (40, 300, 340), (0, 1, 1), (7, 257, 264)])
def test_blocked_attention_equals_the_naive_form(offset, T, S):
    from k3bundle.executor import mla

    g = torch.Generator().manual_seed(T + offset)
    q, k, v = (torch.randn(n, 4, d, generator=g, dtype=torch.float64) for n, d in ((T, 24), (S, 24), (S, 16)))
    a = mla.attend_naive(q, k, v, offset, 24 ** -0.5)
    b = mla.attend_blocked(q, k, v, offset, 24 ** -0.5)
    assert rel(b, a) <= 1e-13
    a32 = mla.attend_naive(q.float(), k.float(), v.float(), offset, 24 ** -0.5)
    b32 = mla.attend_blocked(q.float(), k.float(), v.float(), offset, 24 ** -0.5)
    assert rel(b32, a) < 1e-6 and rel(a32, a) < 1e-6


def test_prefill_computes_only_the_logits_it_is_asked_for(tiny_ckpt):
    """all_logits=False: the tapped rows and the last one, equal to the full head's rows."""
    w = SourceWeights(tiny_ckpt, dtype="float64", resident=True)
    ids = list(range(3, 90))
    full, _ = Executor(w).prefill(ids)
    rec = TapRecorder(names=["logits"], positions=[0, 40, 41])
    part, _ = Executor(w, rec, all_logits=False).prefill(ids)
    assert part.shape == (4, full.shape[1])
    assert rel(part, full[[0, 40, 41, 86]]) <= 1e-13
    assert rec.positions_of("logits") == [0, 40, 41] and rel(rec["logits"], full[[0, 40, 41]]) <= 1e-13


def test_long_prompts_run_their_conv_and_ffn_in_row_blocks(monkeypatch):
    """Row blocks bound a long prompt's intermediates; rows are independent, so both equal the
    unblocked forms to rounding (the reduction kernels may vectorise another way)."""
    from k3bundle.executor import situ_glu

    g = torch.Generator().manual_seed(9)
    u, w, st = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((50, 12), (12, 1, 4), (3, 12)))
    whole, _ = kda.short_conv(u, w, st, torch.float64)
    monkeypatch.setattr(kda, "CONV_ROW_BLOCK", 7)
    assert rel(kda.short_conv(u, w, st, torch.float64)[0], whole) <= 1e-15
    x = torch.randn(50, 16, generator=g, dtype=torch.float64)
    W = [torch.randn(24, 16, generator=g, dtype=torch.float64), torch.randn(24, 16, generator=g, dtype=torch.float64),
         torch.randn(16, 24, generator=g, dtype=torch.float64)]
    one = situ_glu.glu(x, *W, 1.5, 7.0)
    monkeypatch.setattr(situ_glu, "ROW_BLOCK", 8)
    assert rel(situ_glu.glu(x, *W, 1.5, 7.0), one) <= 1e-15


def test_blocked_attention_takes_fewer_queries_per_block_for_long_contexts(monkeypatch):
    from k3bundle.executor import mla

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, 4, d, generator=g, dtype=torch.float64) for n, d in ((90, 24), (90, 24), (90, 16)))
    want = mla.attend_naive(q, k, v, 0, 0.2)
    monkeypatch.setattr(mla, "SCORE_BYTES", 4 * 4 * 90 * 20)  # 20 queries' scores per block
    assert rel(mla.attend_blocked(q, k, v, 0, 0.2), want) <= 1e-13
