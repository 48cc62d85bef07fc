"""Stable LatentMoE, the FFN of layers 1..92 (docs/kimi-k3.md §3.7, R1-R7).

(R1) logits = W_router x in FP32 (router weight upcast);  s = σ(logits)
(R2) I = top-k of (s + e_score_correction_bias)   (bias F32, selection only; torch.topk order)
(R3) w_i = s_i / (Σ_{j∈I} s_j + 1e-20) · routed_scaling_factor   (unbiased scores)
(R4) z = W_rdown x                                  (latent down, shared by all experts)
(R5) r = Σ_{i∈I} w_i · E_i(z),  E_i = SiTU-GLU with w1 = gate, w3 = up, w2 = down (MXFP4)
(R6) routed = W_rup · RMSNorm_{routed_expert_norm}(r)   (norm on the weighted sum)
(R7) MoE(x) = routed + GLU_shared(x)                 (fused 2-wide shared expert, un-projected x)

Routed experts are fetched one at a time through ``W.expert(e)`` (dequantized lazily by the
weight source, only for experts some token selected) and dropped after use. The weighted sum
r accumulates in FP32 (FP64 in the float64 policy), as a MoE combine kernel does, and is cast
to the activation dtype before the norm.

Legend: T tokens, D model width, E experts, K top-k, Lr latent width, I expert width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3bundle.config import TextConfig
from k3bundle.executor.norms import compute_dtype, linear, rms_norm
from k3bundle.executor.situ_glu import glu, situ
from k3bundle.executor.weights import EXPERT_ROLES
from k3bundle.formats import mxfp4
from k3bundle.ops.contract import REFERENCE, Backend
from k3bundle.ops.expert_weight import ExpertWeight
from k3bundle.ops.expert_weight import values as expert_values

RENORM_EPS = 1e-20  # (R3) keeps an all-zero selection finite; invisible otherwise


@dataclass(frozen=True, slots=True)
class Route:
    """The router's decision for T tokens (R1-R3)."""

    ids_TK: torch.Tensor  # the experts used, torch.topk order (the forced ones when forced)
    weights_TK: torch.Tensor  # their renormalised weights (R3), compute dtype
    margin_T: torch.Tensor  # biased score of the k-th minus the (k+1)-th expert: near-tie measure
    own_ids_TK: torch.Tensor  # the router's own top-k (R2), equal to ids_TK unless forced
    noise_T: torch.Tensor  # std of margin_T caused by rounding the router input (0 at FP32 and above)


@dataclass(frozen=True, slots=True)
class MoEOut:
    out_TD: torch.Tensor  # MoE(x) (R7)
    route: Route


def route(x_TD: torch.Tensor, w_router_ED: torch.Tensor, bias_E: torch.Tensor, text: TextConfig,
          forced_TK: torch.Tensor | None = None, ops: Backend = REFERENCE) -> Route:
    """(R1-R3) for the post_attention_layernorm output x.

    ``forced_TK`` replaces the selection (R2) by given ids, e.g. a golden run's, so that a
    comparison is not dominated by near-tie routing flips; the weights still follow R3, and
    the router's own choice stays available as ``own_ids_TK``. With a backend that brings its
    own router, ids and weights are the backend's; margin and noise (diagnostics) stay the reference's.
    """
    c, u = compute_dtype(x_TD), torch.finfo(x_TD.dtype).eps / 2  # u: unit roundoff of the input
    x_in = x_TD
    # the router runs in FP32 whatever the activation dtype (vLLM: replicated gate, FP32 output)
    x_TD, w_router_ED, bias_E = x_TD.to(c), w_router_ED.to(c), bias_E.to(c)
    logits_TE = linear(x_TD, w_router_ED)  # (R1)
    s_TE = torch.sigmoid(logits_TE)  # (R1)
    k = text.num_experts_per_token
    top = torch.topk(s_TE + bias_E, min(k + 1, s_TE.shape[-1]), dim=-1)  # (R2) biased, one extra for the margin
    own_TK = top.indices[:, :k]
    margin_T = top.values[:, k - 1] - top.values[:, k] if top.values.shape[-1] > k else top.values[:, k - 1]
    noise_T = margin_noise(x_TD, w_router_ED, s_TE, top.indices, k, u)
    if ops.provides("sigmoid_biased_topk_router"):
        op, kw = ops.ops["sigmoid_biased_topk_router"], dict(top_k=k, scaling=text.routed_scaling_factor)
        own_TK, w_TK = op(x_in, w_router_ED, bias_E, **kw)
        ids_TK = own_TK
        if forced_TK is not None:
            ids_TK, w_TK = op(x_in, w_router_ED, bias_E, forced_ids=forced_TK.to(own_TK.device, torch.long), **kw)
        return Route(ids_TK.long(), w_TK.to(c), margin_T, own_TK.long(), noise_T)
    ids_TK = own_TK if forced_TK is None else forced_TK.to(own_TK.device, torch.long)
    return Route(ids_TK, weights(s_TE, ids_TK, text.routed_scaling_factor), margin_T, own_TK, noise_T)


def weights(s_TE: torch.Tensor, ids_TK: torch.Tensor, scaling: float) -> torch.Tensor:
    """(R3) the renormalised unbiased scores of the selected experts."""
    s_TK = s_TE.gather(-1, ids_TK)  # (R3) the unbiased scores of the selected experts
    return s_TK / (s_TK.sum(-1, keepdim=True) + RENORM_EPS) * scaling  # (R3)


def margin_noise(x_TD, w_ED, s_TE, top_TK1, k: int, u: float) -> torch.Tensor:
    """Std of the selection margin (R2) caused by the rounding of the router input x.

    A low-precision x carries a relative error of about u per element (a cast and the norm's
    output rounding), independent across elements, so logit e moves by about
    u·sqrt(Σ_d W_ed² x_d²) and its score by s_e(1 − s_e) times that; the margin between the
    k-th and (k+1)-th expert moves by the two combined. A routing flip whose reference margin
    is a few of these is arithmetic, not a fault (docs/validation.md "router").
    """
    if u < 2.0 ** -20 or top_TK1.shape[-1] <= k:  # FP32 and FP64 inputs: nothing to speak of
        return torch.zeros(x_TD.shape[0], dtype=s_TE.dtype, device=s_TE.device)
    pair_T2 = top_TK1[:, k - 1:k + 1]
    w_T2D = w_ED[pair_T2]  # the two boundary experts' router rows
    logit_std_T2 = u * torch.sqrt(torch.einsum("tpd,td->tp", w_T2D * w_T2D, x_TD * x_TD))
    s_T2 = s_TE.gather(-1, pair_T2)
    return torch.linalg.vector_norm(s_T2 * (1 - s_T2) * logit_std_T2, dim=-1)


def routed(z_TL, ids_TK, w_TK, expert, situ_beta: float, situ_cap: float, act=situ) -> torch.Tensor:
    """(R5) r = Σ_{i∈I} w_i E_i(z) in the compute dtype; ``expert(e)`` -> {role: weight} or None;
    ``act``: the experts' gate activation (``glu``)."""
    r_TL = torch.zeros(z_TL.shape, dtype=w_TK.dtype, device=z_TL.device)
    for e in torch.unique(ids_TK).tolist():
        E = expert(e)  # dequantized now, only because some token picked it
        if E is None:  # owned by another expert-parallel rank
            continue
        tok_N, slot_N = (ids_TK == e).nonzero(as_tuple=True)
        y_NL = glu(z_TL[tok_N], E["moe.expert.w1"], E["moe.expert.w3"], E["moe.expert.w2"],
                   situ_beta, situ_cap, act=act)  # (R5) E_i(z)
        # the combine accumulates in FP32; a token picks an expert at most once, so no repeats in tok_N
        r_TL[tok_N] += w_TK[tok_N, slot_N, None] * y_NL.to(w_TK.dtype)  # (R5) Σ w_i E_i(z)
        del E
    return r_TL


#: decoded weights of one batched group of experts, and the per-pair outputs (at 4 bytes an
#: element) of one token block: what the fast form holds at once beyond the layer's own weights
GROUP_BYTES = {"cuda": 4 << 30, "cpu": 16 << 20}
PAIR_BYTES = {"cuda": 2 << 30, "cpu": 256 << 20}


def routed_grouped(z_TL, ids_TK, w_TK, stored_expert, situ_beta: float, situ_cap: float) -> torch.Tensor:
    """(R5) as ``routed``, batched. The (token, slot) pairs are sorted by expert once; the touched
    experts run in groups of similar token counts, each group's weights decoded into one stacked
    buffer (MXFP4 straight from the stored bytes, one codec launch per projection on CUDA) and its
    tokens as one batched GEMM per projection (zero rows pad a group: their outputs are dropped);
    the K terms of a token are then summed at once. The same products as ``routed``; the GEMMs'
    blocking and the order of the K-term sum differ. Tokens run in blocks so that the per-pair
    outputs stay under ``PAIR_BYTES``; each block decodes its experts once."""
    T, K = ids_TK.shape
    dev = "cuda" if z_TL.is_cuda else "cpu"
    block = max(1, PAIR_BYTES[dev] // max(1, K * z_TL.shape[1] * 4))
    if T > block:
        return torch.cat([routed_grouped(z_TL[s:s + block], ids_TK[s:s + block], w_TK[s:s + block], stored_expert,
                                         situ_beta, situ_cap) for s in range(0, T, block)])
    flat_P = ids_TK.reshape(-1)
    order_P = torch.argsort(flat_P, stable=True)  # pairs t·K + k by expert, tokens ascending within one
    experts, counts = torch.unique_consecutive(flat_P[order_P], return_counts=True)
    table = torch.stack([experts, torch.cumsum(counts, 0) - counts, counts]).tolist()  # the one host sync
    spans = sorted(zip(*table), key=lambda s: -s[2])  # (expert, first sorted pair, pairs), most tokens first
    y_PL = z_TL.new_zeros(T * K, z_TL.shape[1])  # E_i(z) of pair t·K + k (another rank's experts: 0)
    group: list = []
    for e, start, n in spans:
        E = stored_expert(e)
        if E is None:  # owned by another expert-parallel rank
            continue
        group.append((order_P[start:start + n], E))
        if len(group) * _expert_bytes(E, z_TL.element_size()) >= GROUP_BYTES[dev]:
            _run_group(group, z_TL, K, y_PL, situ_beta, situ_cap)
            group = []
    if group:
        _run_group(group, z_TL, K, y_PL, situ_beta, situ_cap)
    c = w_TK.dtype  # (R5) Σ w_i E_i(z) in the combine dtype (FP32; FP64 under float64)
    return (w_TK[..., None] * y_PL.view(T, K, -1).to(c)).sum(1)


def _expert_bytes(E, esize: int) -> int:
    return sum(math.prod(_logical_shape(w)) for w in E.values()) * esize


def _stored(w):
    """The stored MXFP4 form of ``w`` where it still has to be decoded, else None."""
    return w.mxfp4() if isinstance(w, ExpertWeight) and not w.decoded else None


def _logical_shape(w) -> tuple[int, int]:
    if isinstance(w, ExpertWeight) and w.shape is not None:  # known without decoding
        return w.shape
    stored = _stored(w)
    if stored is not None:
        return stored[0].shape[0], stored[0].shape[1] * 2
    return tuple((w.value() if isinstance(w, ExpertWeight) else w).shape)


def _stack(ws: list, out: torch.Tensor, stored: list) -> None:
    """``out[g]`` <- the logical weight of ``ws[g]``: MXFP4 decoded straight into the stack where
    every source keeps its stored form (``stored[g]``) on this device (the codec, bit for bit),
    else copied."""
    if all(s is not None and s[0].device == out.device for s in stored):
        p0, s0 = stored[0]
        mxfp4.dequantize_stack([p for p, _ in stored], [s for _, s in stored], out,
                               block=2 * p0.shape[-1] // s0.shape[-1])
        return
    for g, v in enumerate(expert_values(ws)):  # a source's batch decode where it has one
        out[g].copy_(v)


#: at most this many tokens per expert (a decode step's): the projections read the MXFP4 bytes
#: directly (``mxfp4.matmul_stack``), no decoded weight is ever written
DIRECT_TOKENS = 4


def _run_group(group, z_TL, K: int, y_PL, situ_beta, situ_cap) -> None:
    """One group's E_i(z) (R5, S3) as batched GEMMs; writes each pair's row of ``y_PL``."""
    G, N = len(group), group[0][0].numel()  # the first expert has the most tokens
    stored = {r: [_stored(E[r]) for _, E in group] for r in EXPERT_ROLES}
    if N <= DIRECT_TOKENS and all(mxfp4.matmul_available(z_TL, s) for s in stored.values()):
        # the stored bytes themselves, decoded inside the matmul
        stacks = stored
        mm = lambda x, w: mxfp4.matmul_stack(x, [p for p, _ in w], [s for _, s in w])  # noqa: E731
    else:
        stacks, mm = {}, linear
        for role in EXPERT_ROLES:
            stacks[role] = z_TL.new_empty(G, *_logical_shape(group[0][1][role]))
            _stack([E[role] for _, E in group], stacks[role], stored[role])
    dev = z_TL.device
    pairs_R = torch.cat([p for p, _ in group])  # pair indices t·K + k, expert by expert
    # each pair's (expert in the group, row in its block), built on the device from the counts
    n_G = torch.tensor([p.numel() for p, _ in group]).to(dev, non_blocking=True)
    g_R = torch.repeat_interleave(torch.arange(G, device=dev), n_G, output_size=pairs_R.numel())
    j_R = torch.arange(pairs_R.numel(), device=dev) - (torch.cumsum(n_G, 0) - n_G)[g_R]
    X_GNL = z_TL.new_zeros(G, N, z_TL.shape[1])
    X_GNL[g_R, j_R] = z_TL[pairs_R // K]
    Y_GNL = glu(X_GNL, stacks["moe.expert.w1"], stacks["moe.expert.w3"], stacks["moe.expert.w2"],
                situ_beta, situ_cap, mm)  # (R5) E_i(z), one batched GEMM per projection
    y_PL[pairs_R] = Y_GNL[g_R, j_R]


def forward(x_TD: torch.Tensor, W, text: TextConfig, forced_TK: torch.Tensor | None = None,
            ops: Backend = REFERENCE, fast: bool = True) -> MoEOut:
    """MoE(x) for the post_attention_layernorm output x, and the route it took; ``fast`` picks
    ``routed_grouped`` over ``routed`` where no backend brings its own grouped GEMM."""
    act, c = x_TD.dtype, compute_dtype(x_TD)
    r = route(x_TD, W["moe.router"], W["moe.router_bias"], text, forced_TK, ops)  # (R1-R3)
    z_TL = linear(x_TD, W["moe.latent_down"])  # (R4)
    beta, cap = text.activation_situ_beta, text.activation_situ_linear_beta
    op = W.expert_op  # the grouped GEMM of this storage format (graph_manifest custom_ops)
    if ops.provides(op):
        r_TL = ops.ops[op](z_TL, r.ids_TK, r.weights_TK.to(c), W.stored_expert, situ_beta=beta, situ_cap=cap)
    else:
        if fast:
            r_TL = routed_grouped(z_TL, r.ids_TK, r.weights_TK.to(c), W.stored_expert, beta, cap)  # (R5)
        else:
            r_TL = routed(z_TL, r.ids_TK, r.weights_TK.to(c), W.expert, beta, cap)  # (R5)
    # the weighted sum is one tensor across EP/TP ranks before the norm (R6 needs all of r)
    r_TL = W.reduce(r_TL.to(c)).to(act)
    routed_TD = linear(rms_norm(r_TL, W["moe.latent_norm"], text.rms_norm_eps), W["moe.latent_up"])  # (R6)
    shared_TD = W.reduce(glu(x_TD, W["moe.shared.gate_proj"], W["moe.shared.up_proj"],
                             W["moe.shared.down_proj"], beta, cap))  # (R7) on the un-projected x
    return MoEOut(routed_TD + shared_TD, r)  # (R7)
