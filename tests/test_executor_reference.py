"""An independent float64 re-implementation of the whole tiny model, straight from spec §3.

Nothing of k3bundle is used to compute the reference: tensors are read with plain
``safetensors`` by their release names (spelled out here on purpose, spec §2), MXFP4 experts
are decoded with a table written from spec §2.10, and every equation is a loop or einsum
over tokens and heads. It covers a KDA + dense layer (0), KDA + MoE layers and MLA + MoE
layers (3, 7, 8), the AttnRes schedule with block openings and the head; the executor's
taps are compared layer by layer.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from k3bundle.executor import Executor, SourceWeights, TapRecorder

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # spec §2.10, magnitude of bits 0-2; bit 3 = sign


def mxfp4_decode(packed, scale):
    """W[o, i] = LUT(code) · sign · 2^(scale[o, i // 32] − 127); low nibble = even column."""
    lut = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float64)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
    factor = torch.pow(2.0, scale.double() - 127).repeat_interleave(32, dim=1)
    return lut[codes] * factor


class Ckpt:
    def __init__(self, d):
        self.cfg = json.loads((d / "config.json").read_text())["text_config"]
        self.t = {}
        for f in sorted(d.glob("model-*.safetensors")):
            self.t.update(load_file(f))

    def __call__(self, name):
        return self.t["language_model." + name].double()

    def expert(self, l, e, w):
        p = f"language_model.model.layers.{l}.block_sparse_moe.experts.{e}.{w}"
        return mxfp4_decode(self.t[p + ".weight_packed"], self.t[p + ".weight_scale"])


def rmsnorm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def attnres(cands, w, q, eps):
    out = torch.zeros_like(cands[0])
    for t in range(cands[0].shape[0]):
        s = torch.stack([(v[t] / math.sqrt(float((v[t] ** 2).mean()) + eps) * w * q[0]).sum() for v in cands])
        p = torch.softmax(s, 0)
        out[t] = sum(p[i] * cands[i][t] for i in range(len(cands)))
    return out


def glu(x, wg, wu, wd, beta=4.0, lim=25.0):
    g, u = x @ wg.T, x @ wu.T
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * lim * torch.tanh(u / lim)) @ wd.T


def kda_ref(x, c, p, cfg):
    la = cfg["linear_attn_config"]
    H, d = la["num_heads"], la["head_dim"]
    T = x.shape[0]
    pre = {n: x @ c(p + f"{n}_proj.weight").T for n in "qkv"}
    post = {}
    for n in "qkv":
        w = c(p + f"{n}_conv1d.weight")[:, 0, :]  # [P, 4], tap 3 = current token
        y = torch.zeros_like(pre[n])
        for t in range(T):
            for i in range(4):
                if t - 3 + i >= 0:
                    y[t] += w[:, i] * pre[n][t - 3 + i]
        post[n] = torch.nn.functional.silu(y).view(T, H, d)
    z = ((x @ c(p + "f_a_proj.weight").T) @ c(p + "f_b_proj.weight").T).view(T, H, d)
    a_log, dt = c(p + "A_log")[:H], c(p + "dt_bias").view(H, d)
    beta = torch.sigmoid(x @ c(p + "b_proj.weight").T)
    gate = torch.sigmoid(x @ c(p + "g_proj.weight").T).view(T, H, d)
    o = torch.zeros(T, H, d, dtype=torch.float64)
    for h in range(H):
        S = torch.zeros(d, d, dtype=torch.float64)
        for t in range(T):
            q = post["q"][t, h] / torch.sqrt((post["q"][t, h] ** 2).sum() + 1e-6) / math.sqrt(d)
            k = post["k"][t, h] / torch.sqrt((post["k"][t, h] ** 2).sum() + 1e-6)
            alpha = torch.exp(-5 * torch.sigmoid(torch.exp(a_log[h]) * (z[t, h] + dt[h])))
            S = torch.diag(alpha) @ S
            u = beta[t, h] * (post["v"][t, h] - S.T @ k)
            S = S + torch.outer(k, u)
            o[t, h] = S.T @ q
    y = rmsnorm(o, c(p + "o_norm.weight"), cfg["rms_norm_eps"]) * gate
    return y.reshape(T, H * d) @ c(p + "o_proj.weight").T


def mla_ref(x, c, p, cfg):
    H, N, R, V, L = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                     cfg["v_head_dim"], cfg["kv_lora_rank"])
    eps, T = cfg["rms_norm_eps"], x.shape[0]
    Q = (rmsnorm(x @ c(p + "q_a_proj.weight").T, c(p + "q_a_layernorm.weight"), eps)
         @ c(p + "q_b_proj.weight").T).view(T, H, N + R)
    a = x @ c(p + "kv_a_proj_with_mqa.weight").T
    kv = (rmsnorm(a[:, :L], c(p + "kv_a_layernorm.weight"), eps) @ c(p + "kv_b_proj.weight").T).view(T, H, N + V)
    gate = torch.sigmoid(x @ c(p + "g_proj.weight").T).view(T, H, V)
    o = torch.zeros(T, H, V, dtype=torch.float64)
    for h in range(H):
        K = torch.cat([kv[:, h, :N], a[:, L:]], -1)  # k_pe shared by heads, not rotated
        s = Q[:, h] @ K.T / math.sqrt(N + R)
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), -math.inf)
        o[:, h] = torch.softmax(s, -1) @ kv[:, h, N:]
    return (o * gate).reshape(T, H * V) @ c(p + "o_proj.weight").T


def moe_ref(x, c, ck, l, cfg):
    p = f"model.layers.{l}.block_sparse_moe."
    s = torch.sigmoid(x @ c(p + "gate.weight").T)
    bias = c(p + "gate.e_score_correction_bias")
    z = x @ c(p + "routed_expert_down_proj.weight").T
    r = torch.zeros_like(z)
    ids_all = []
    for t in range(x.shape[0]):
        ids = torch.topk(s[t] + bias, cfg["num_experts_per_token"]).indices
        ids_all.append(ids)
        w = s[t, ids] / (s[t, ids].sum() + 1e-20) * cfg["routed_scaling_factor"]
        for wi, e in zip(w, ids.tolist()):
            r[t] += wi * glu(z[t:t + 1], ck.expert(l, e, "w1"), ck.expert(l, e, "w3"), ck.expert(l, e, "w2"))[0]
    routed = rmsnorm(r, c(p + "routed_expert_norm.weight"), cfg["rms_norm_eps"]) @ c(p + "routed_expert_up_proj.weight").T
    shared = glu(x, c(p + "shared_experts.gate_proj.weight"), c(p + "shared_experts.up_proj.weight"),
                 c(p + "shared_experts.down_proj.weight"))
    return routed + shared, torch.stack(ids_all)


def reference(ck, ids):
    cfg, c = ck.cfg, ck
    eps, n = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    mla_1based = cfg["linear_attn_config"]["full_attn_layers"]
    h0 = c("model.embed_tokens.weight")[ids]
    B, S, taps = [], h0, {}
    for l in range(n):
        p = f"model.layers.{l}."
        x = attnres(B + [S], c(p + "self_attention_res_norm.weight"), c(p + "self_attention_res_proj.weight"), eps) if B else S
        opening = l % cfg["attn_res_block_size"] == 0
        if opening:
            B.append(S)
        xn = rmsnorm(x, c(p + "input_layernorm.weight"), eps)
        a = (mla_ref if l + 1 in mla_1based else kda_ref)(xn, c, p + "self_attn.", cfg)
        S = a if opening else S + a
        y = attnres(B + [S], c(p + "mlp_res_norm.weight"), c(p + "mlp_res_proj.weight"), eps)
        yn = rmsnorm(y, c(p + "post_attention_layernorm.weight"), eps)
        if l == 0:
            f = glu(yn, c(p + "mlp.gate_proj.weight"), c(p + "mlp.up_proj.weight"), c(p + "mlp.down_proj.weight"))
        else:
            f, taps[f"layers.{l}.router_ids"] = moe_ref(yn, c, ck, l, cfg)
        S = S + f
        taps.update({f"layers.{l}.attn_res_out": x, f"layers.{l}.mixer_out": a, f"layers.{l}.ffn_out": f})
    h = attnres(B + [S], c("model.output_attn_res_norm.weight"), c("model.output_attn_res_proj.weight"), eps)
    taps["final_hidden"] = h
    taps["logits"] = rmsnorm(h, c("model.norm.weight"), eps) @ c("lm_head.weight").T
    return taps


@pytest.mark.slow
def test_whole_tiny_model_matches_independent_reference(tiny_ckpt):
    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(11))  # 2 KDA chunks
    ref = reference(Ckpt(tiny_ckpt), ids)
    rec = TapRecorder()
    ex = Executor(SourceWeights(tiny_ckpt, dtype="float64"), rec)
    ex.prefill(ids)
    assert ex.text.is_mla(3) and ex.text.is_mla(8) and not ex.text.is_mla(0)
    for name, want in ref.items():
        got = rec[name]
        if name.endswith("router_ids"):
            assert torch.equal(got.sort(-1).values, want.sort(-1).values), name
            continue
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-11, (name, rel)
