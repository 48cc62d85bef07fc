"""Executor blocks in isolation: MLA forms, router, SiTU-GLU, norms, AttnRes schedule, cache sizes."""

from __future__ import annotations

import math

import pytest
import torch

from k3bundle.executor import cache_bytes, latent_moe, mla, situ_glu
from k3bundle.executor.attnres import attn_res, schedule
from k3bundle.executor.cache import MLAState
from k3bundle.executor.norms import rms_norm
from k3bundle.executor.weights import LayerWeights
from k3bundle.presets import preset_config


@pytest.fixture(scope="module")
def tiny_text():
    return preset_config("tiny").text


def _rand(g, *shape, std=1.0):
    return std * torch.randn(*shape, generator=g, dtype=torch.float64)


def _mla_weights(text, seed=0):
    g = torch.Generator().manual_seed(seed)
    D, H = text.hidden_size, text.num_attention_heads
    N, R, V, Lq, L = (text.qk_nope_head_dim, text.qk_rope_head_dim, text.v_head_dim,
                      text.q_lora_rank, text.kv_lora_rank)
    w = {
        "mla.q_a_proj": _rand(g, Lq, D, std=D ** -0.5), "mla.q_a_norm": 1 + 0.1 * _rand(g, Lq),
        "mla.q_b_proj": _rand(g, H * (N + R), Lq, std=Lq ** -0.5),
        "mla.kv_a_proj": _rand(g, L + R, D, std=D ** -0.5), "mla.kv_a_norm": 1 + 0.1 * _rand(g, L),
        "mla.kv_b_proj": _rand(g, H * (N + V), L, std=L ** -0.5),
        "mla.g_proj": _rand(g, H * V, D, std=D ** -0.5), "mla.o_proj": _rand(g, D, H * V, std=(H * V) ** -0.5),
    }
    return LayerWeights(3, w)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_mla_naive_equals_absorbed(tiny_text, dtype, tol):
    W = _mla_weights(tiny_text)
    W = LayerWeights(3, {k: v.to(dtype) for k, v in W.items()})
    x = torch.randn(40, tiny_text.hidden_size, generator=torch.Generator().manual_seed(1), dtype=dtype)
    width = tiny_text.kv_lora_rank + tiny_text.qk_rope_head_dim
    outs = {}
    for absorbed in (False, True):
        st = MLAState.empty(width, dtype, "cpu", capacity=4)  # forces growth on append
        a = mla.forward(x[:25], W, st, tiny_text, absorbed=absorbed).out_TD  # prefill part
        b = mla.forward(x[25:], W, st, tiny_text, absorbed=absorbed).out_TD  # continuation
        outs[absorbed] = torch.cat([a, b])
        assert st.length == 40 and st.latent_SC.shape == (40, width)
    rel = (outs[True] - outs[False]).norm() / outs[False].norm()
    assert rel < tol


def test_mla_latent_cache_is_kv_lora_plus_rope_per_token(release_config):
    t = release_config.text
    assert t.kv_lora_rank + t.qk_rope_head_dim == 576  # 512 + 64 (spec §3.4)
    assert (t.qk_nope_head_dim + t.qk_rope_head_dim) ** -0.5 == 192 ** -0.5  # M4 scale


def test_router_bias_changes_selection_never_weights(tiny_text):
    g = torch.Generator().manual_seed(2)
    E, D, T = tiny_text.num_experts, tiny_text.hidden_size, 64
    x = _rand(g, T, D)
    w_router = _rand(g, E, D, std=D ** -0.5)
    no_bias = torch.zeros(E, dtype=torch.float64)
    bias = torch.zeros(E, dtype=torch.float64)
    bias[:4] = 10.0  # strong enough to force experts 0..3 into every token's top-k
    r0, r1 = latent_moe.route(x, w_router, no_bias, tiny_text), latent_moe.route(x, w_router, bias, tiny_text)
    (ids0, w0), (ids1, w1) = (r0.ids_TK, r0.weights_TK), (r1.ids_TK, r1.weights_TK)
    assert not torch.equal(ids0.sort(-1).values, ids1.sort(-1).values)  # selection moved
    assert (ids1.sort(-1).values == torch.arange(4)).all()
    s = torch.sigmoid(x @ w_router.T)  # weights from unbiased scores only (R3)
    for ids, w in ((ids0, w0), (ids1, w1)):
        sel = s.gather(-1, ids)
        expected = sel / (sel.sum(-1, keepdim=True) + 1e-20) * tiny_text.routed_scaling_factor
        torch.testing.assert_close(w, expected, rtol=1e-15, atol=0)
    # a bias that does not change the top-k set changes nothing at all
    r2 = latent_moe.route(x, w_router, torch.full((E,), 3.0, dtype=torch.float64), tiny_text)
    assert torch.equal(r2.ids_TK, ids0) and torch.equal(r2.weights_TK, w0)


def test_forced_route_keeps_the_routers_own_choice(tiny_text):
    g = torch.Generator().manual_seed(3)
    E, D, T = tiny_text.num_experts, tiny_text.hidden_size, 16
    x, w_router = _rand(g, T, D), _rand(g, E, D, std=D ** -0.5)
    bias = torch.zeros(E, dtype=torch.float64)
    own = latent_moe.route(x, w_router, bias, tiny_text)
    forced_ids = torch.arange(tiny_text.num_experts_per_token).repeat(T, 1)
    forced = latent_moe.route(x, w_router, bias, tiny_text, forced_ids)
    assert torch.equal(forced.ids_TK, forced_ids)  # the replayed choice is used ...
    assert torch.equal(forced.own_ids_TK, own.ids_TK)  # ... and the router's own stays visible
    s = torch.sigmoid(x @ w_router.T).gather(-1, forced_ids)  # weights follow R3 on the forced set
    torch.testing.assert_close(forced.weights_TK, s / (s.sum(-1, keepdim=True) + 1e-20)
                               * tiny_text.routed_scaling_factor, rtol=1e-15, atol=0)


def test_situ_glu_saturates_at_100(tiny_text):
    beta, lim = tiny_text.activation_situ_beta, tiny_text.activation_situ_linear_beta
    assert (beta, lim) == (4.0, 25.0)
    big = torch.tensor([1e4, 1e6, 1e30], dtype=torch.float32)
    prod = situ_glu.situ(big, beta) * situ_glu.cap(big, lim)
    assert torch.equal(prod, torch.full_like(prod, 100.0))
    assert torch.equal(situ_glu.situ(big, beta) * situ_glu.cap(-big, lim), torch.full_like(prod, -100.0))
    grid = torch.linspace(-1e3, 1e3, 20001, dtype=torch.float64)
    bound = (situ_glu.situ(grid[:, None], beta) * situ_glu.cap(grid[None, ::50], lim)).abs().max()
    assert bound <= 100.0
    # situ is a soft-capped SiLU: ~SiLU near 0, -> 0 for very negative input
    small = torch.tensor([0.1, -0.1], dtype=torch.float64)
    torch.testing.assert_close(situ_glu.situ(small, beta), torch.nn.functional.silu(small), rtol=1e-3, atol=0)
    assert situ_glu.situ(torch.tensor(-1e4), beta) == 0


def test_rms_norm_rounds_before_the_gain():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    x32 = x.float()
    normalised = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    expected = (w.float() * normalised.float()).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-5), expected)
    assert torch.equal(rms_norm(x, w, 1e-5), w * normalised)  # == a bf16 multiply
    unrounded = (w.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert not torch.equal(unrounded, expected)  # the rounding step is observable


def test_attn_res_mixes_raw_values_with_depth_softmax():
    g = torch.Generator().manual_seed(4)
    cands = [_rand(g, 5, 32, std=s) for s in (1.0, 3.0, 0.5)]
    w, q = 1 + 0.1 * _rand(g, 32), _rand(g, 1, 32)
    out = attn_res(cands, w, q, 1e-5)
    for t in range(5):
        scores = [sum(float(v[t, c]) / math.sqrt(float(v[t].pow(2).mean()) + 1e-5) * float(w[c]) * float(q[0, c])
                      for c in range(32)) for v in cands]
        m = max(scores)
        p = [math.exp(s - m) for s in scores]
        p = [x / sum(p) for x in p]
        ref = sum(pi * v[t] for pi, v in zip(p, cands))
        torch.testing.assert_close(out[t], ref, rtol=1e-12, atol=1e-12)


def test_attn_res_schedule_full_scale(release_config):
    t = release_config.text
    s = schedule(t.num_hidden_layers, t.attn_res_block_size)
    assert s.stored_blocks == 8 and s.output == 9  # spec A2: |B| = 8, 9 output candidates
    assert s.openings == [0, 12, 24, 36, 48, 60, 72, 84] == t.block_openings
    assert s.mixer[0] == 1 and s.mixer[1] == 2  # layer 0 reads h⁰ directly (no mixing)
    assert s.ffn[0] == 2  # [h⁰, a₀]
    assert s.mixer[12] == 2 and s.ffn[12] == 3  # layer 12 opens block 2: B = [h⁰, b₁]
    assert s.ffn[92] == 9 and s.mixer[92] == 9


def test_attn_res_schedule_tiny(tiny_text):
    s = schedule(tiny_text.num_hidden_layers, tiny_text.attn_res_block_size)
    assert (s.stored_blocks, s.output, s.openings) == (3, 4, [0, 3, 6])


def test_cache_bytes_full_scale(release_config):
    b = cache_bytes(release_config.text)  # spec §5.3
    assert b.kda_recurrent_per_layer == 6_291_456 and b.kda_layers == 69
    assert b.kda_conv_per_layer == 221_184
    assert b.mla_per_token == 27_648 and b.mla_layers == 24
    assert round(b.kda_recurrent_per_layer * 69 / 1e6, 1) == 434.1
    assert round(b.kda_per_request / 1e6, 1) == 449.4
