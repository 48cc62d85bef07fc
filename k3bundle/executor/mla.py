"""Gated Multi-head Latent Attention without positional encoding (docs/kimi-k3.md §3.4, M1-M5).

(M1) c_q = RMSNorm_{q_a_layernorm}(W_qa x);  Q = W_qb c_q → [H, nope + rope] = [q_nope | q_pe]
(M2) [c_kv | k_pe] = W_kva x;  ĉ_kv = RMSNorm_{kv_a_layernorm}(c_kv);  W_kvb ĉ_kv → [H, nope + v] = [k_nope | v]
(M3) K_h = [k_nope_h ; k_pe]: k_pe shared by all heads; **no rotary embedding** (NoPE)
(M4) o_h = softmax_causal( Q_h K_hᵀ · (nope + rope)^(−1/2) ) V_h   (192^(−1/2) at full scale)
(M5) MLA(x) = W_o [ concat_h o_h ⊙ σ(W_g x) ]

The cache holds, per token, the latent [ĉ_kv ‖ k_pe] (kv_lora + rope = 512 + 64 values). Both
forms read it. ``naive`` expands K and V from the cache through W_kvb (prefill); ``absorbed``
(decode, as vLLM/FlashMLA) never expands: with W_kvb split per head into W_UK [nope, kv_lora]
and W_UV [v, kv_lora],
  q_nopeᵀ k_nope,s = (W_UKᵀ q_nope)ᵀ ĉ_kv,s   and   o_h = W_UV Σ_s p_s ĉ_kv,s.
Both are exact rewrites of M4 (tests/test_executor_blocks.py checks naive == absorbed).

Precision: projections in the activation dtype; scores, softmax and the weighted sum in FP32
(FP64 in the float64 policy) from activation-dtype operands; output cast back.

Legend: T new tokens, S cached tokens (incl. the new ones), D model width, H heads,
N nope dim, R rope dim, V value dim, L kv_lora rank, C = L + R latent width.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from k3bundle.config import TextConfig
from k3bundle.executor import mla_gpu
from k3bundle.executor.cache import MLAState
from k3bundle.executor.norms import compute_dtype, linear, rms_norm
from k3bundle.ops.contract import REFERENCE, Backend


def project(x_TD: torch.Tensor, W, text: TextConfig):
    """M1-M3 for the new tokens: (q_nope [T,H,N], q_pe [T,H,R], latent [T,C])."""
    N, R, L = text.qk_nope_head_dim, text.qk_rope_head_dim, text.kv_lora_rank
    T = x_TD.shape[0]
    c_q = rms_norm(linear(x_TD, W["mla.q_a_proj"]), W["mla.q_a_norm"], text.rms_norm_eps)  # (M1)
    Q_THE = linear(c_q, W["mla.q_b_proj"]).view(T, -1, N + R)  # (M1) per head [q_nope | q_pe]
    ckv_kpe_TC = linear(x_TD, W["mla.kv_a_proj"])  # (M2) [c_kv | k_pe]
    ckv_TL = rms_norm(ckv_kpe_TC[:, :L], W["mla.kv_a_norm"], text.rms_norm_eps)  # (M2) ĉ_kv
    latent_TC = torch.cat([ckv_TL, ckv_kpe_TC[:, L:]], dim=-1)  # (M3) k_pe kept as is: no RoPE
    return Q_THE[..., :N], Q_THE[..., N:], latent_TC


def _causal_softmax(scores_HTS: torch.Tensor, offset: int) -> torch.Tensor:
    """softmax over keys s <= offset + t (query t sits at absolute position offset + t)."""
    T, S = scores_HTS.shape[-2:]
    pos_T = torch.arange(T, device=scores_HTS.device)[:, None] + offset
    allowed_TS = torch.arange(S, device=scores_HTS.device)[None, :] <= pos_T
    return torch.softmax(scores_HTS.masked_fill(~allowed_TS, -torch.inf), dim=-1)  # (M4)


QUERY_BLOCK = 1024  # queries per score block in the naive form: bounds memory at [H, 1024, S]


def expand(latent_SC: torch.Tensor, W, text: TextConfig):
    """(M2-M3) K [S, H, N+R] and V [S, H, V] expanded from the latent cache (prefill)."""
    N, L, V = text.qk_nope_head_dim, text.kv_lora_rank, text.v_head_dim
    S = latent_SC.shape[0]
    kv_SHE = linear(latent_SC[:, :L], W["mla.kv_b_proj"]).view(S, -1, N + V)  # (M2) [k_nope | v]
    H = kv_SHE.shape[1]
    k_SHE = torch.cat([kv_SHE[..., :N], latent_SC[:, None, L:].expand(S, H, -1)], -1)  # (M3) shared k_pe
    return k_SHE, kv_SHE[..., N:]


def attend_naive(q_THE, k_SHE, v_SHV, offset: int, scale: float) -> torch.Tensor:
    """(M4) causal attention of T queries at positions offset.. over S keys; o [T, H, V] (activation dtype).

    Queries are processed in blocks of ``QUERY_BLOCK`` so a long prefill never holds a [H, T, S]
    score tensor; each block attends only to the keys it can see (causal), which is exact.
    """
    act, c = q_THE.dtype, compute_dtype(q_THE)
    q_THE, k_SHE, v_SHV = q_THE.to(c), k_SHE.to(c), v_SHV.to(c)
    out = []
    for t0 in range(0, q_THE.shape[0], QUERY_BLOCK):
        t1 = min(t0 + QUERY_BLOCK, q_THE.shape[0])
        keys = offset + t1  # keys a query of this block may see: positions < offset + t1
        scores_HTS = torch.einsum("the,she->hts", q_THE[t0:t1], k_SHE[:keys]) * scale  # (M4)
        p_HTS = _causal_softmax(scores_HTS, offset + t0)  # (M4)
        out.append(torch.einsum("hts,shv->thv", p_HTS, v_SHV[:keys]))  # (M4) o_h = P V_h
    return torch.cat(out).to(act)


FAST_QUERY_BLOCK = 256  # the fast form's blocks: the causal triangle costs (n + 1) / 2n of the square
SCORE_BYTES = 1 << 30  # and at most this much of FP32 scores per block (long contexts take fewer queries)


def scores_f32(q_HTE: torch.Tensor, k_HSE: torch.Tensor) -> torch.Tensor:
    """q kᵀ [H, T, S] in FP32 (FP64 for float64) from activation-dtype operands. BF16/FP16 operands
    on CUDA go to the tensor cores with an FP32 result: every product is exact in FP32 and the
    sum is FP32, as the upcast einsum (another summation order)."""
    c = compute_dtype(q_HTE)
    if q_HTE.is_cuda and q_HTE.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.bmm(q_HTE, k_HSE.transpose(1, 2), out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # torch < 2.8: no out_dtype
            pass
    return torch.bmm(q_HTE.to(c), k_HSE.to(c).transpose(1, 2))


def attend_blocked(q_THE, k_SHE, v_SHV, offset: int, scale: float) -> torch.Tensor:
    """(M4) as ``attend_naive``, faster: blocks of ``FAST_QUERY_BLOCK`` queries, scores from
    ``scores_f32``, scale, mask and softmax in place on each block's visible keys."""
    act, c = q_THE.dtype, compute_dtype(q_THE)
    q_HTE, k_HSE, v_HSV = q_THE.transpose(0, 1), k_SHE.transpose(0, 1), v_SHV.transpose(0, 1).to(c)
    out = q_THE.new_empty(q_THE.shape[0], v_SHV.shape[1], v_SHV.shape[2], dtype=c)
    step = max(16, min(FAST_QUERY_BLOCK, SCORE_BYTES // (4 * k_SHE.shape[1] * k_SHE.shape[0])))
    for t0 in range(0, q_THE.shape[0], step):
        t1 = min(t0 + step, q_THE.shape[0])
        keys = offset + t1
        s_HTS = scores_f32(q_HTE[:, t0:t1], k_HSE[:, :keys]).mul_(scale)  # (M4)
        pos_T = torch.arange(t0, t1, device=s_HTS.device)[:, None] + offset
        d0 = offset + t0  # keys before the block's first query are visible to all of it: mask the rest only
        s_HTS[:, :, d0:].masked_fill_(torch.arange(d0, keys, device=s_HTS.device)[None, :] > pos_T, -torch.inf)
        p_HTS = torch.softmax(s_HTS, dim=-1)  # (M4)
        out[t0:t1] = torch.bmm(p_HTS, v_HSV[:, :keys]).transpose(0, 1)  # (M4) o_h = P V_h
    return out.to(act)


def attend_fast(q_THE, k_SHE, v_SHV, offset: int, scale: float) -> torch.Tensor:
    """(M4) the fast form: one fused flash-style kernel where it serves (``mla_gpu``: CUDA, BF16 or
    FP32, the reference's precision contract), else ``attend_blocked`` (CPU, float64)."""
    if mla_gpu.available(q_THE, v_SHV.shape[-1]):
        return mla_gpu.attend(q_THE, k_SHE, v_SHV, offset, scale)
    return attend_blocked(q_THE, k_SHE, v_SHV, offset, scale)


def attend_absorbed(q_nope, q_pe, latent_SC, w_HEL, offset: int, scale: float) -> torch.Tensor:
    """(M4) with W_UK/W_UV absorbed, reading only the latent cache; returns o [T, H, V].

    ``w_HEL``: kv_b_proj per head, rows [k_nope (N) | v (V)] of the latent width L."""
    N, L = q_nope.shape[-1], w_HEL.shape[-1]
    act, c = q_nope.dtype, compute_dtype(q_nope)
    # the whole absorbed form runs in FP32 (FP64 under float64) from activation-dtype operands
    w_HEL = w_HEL.to(c)
    ckv_SL, kpe_SR = latent_SC[:, :L].to(c), latent_SC[:, L:].to(c)
    q_nope, q_pe = q_nope.to(c), q_pe.to(c)
    q_lat_THL = torch.einsum("thn,hnl->thl", q_nope, w_HEL[:, :N])  # (M4) W_UKᵀ q_nope
    scores_HTS = (torch.einsum("thl,sl->hts", q_lat_THL, ckv_SL)
                  + torch.einsum("thr,sr->hts", q_pe, kpe_SR)) * scale  # (M4) q_nope·k_nope + q_pe·k_pe
    p_HTS = _causal_softmax(scores_HTS, offset)  # (M4)
    o_lat_THL = torch.einsum("hts,sl->thl", p_HTS, ckv_SL)  # (M4) Σ_s p_s ĉ_kv,s
    o_THV = torch.einsum("thl,hvl->thv", o_lat_THL, w_HEL[:, N:])  # (M4) W_UV
    return o_THV.to(act)


def output_gate(o_THV: torch.Tensor, g_TP: torch.Tensor) -> torch.Tensor:
    """(M5) o ⊙ σ(W_g x) for [T, H, V] o; the sigmoid gate multiplies in FP32 and rounds once."""
    act, c = o_THV.dtype, compute_dtype(o_THV)
    o_TP, g_TP = o_THV.reshape(o_THV.shape[0], -1).to(c), g_TP.to(c)
    return (o_TP * torch.sigmoid(g_TP)).to(act)  # (M5) o ⊙ σ(W_g x)


def softmax_scale(text: TextConfig) -> float:
    return (text.qk_nope_head_dim + text.qk_rope_head_dim) ** -0.5  # (M4) no YaRN mscale, no cap


# ---- the reference form of the ops (k3bundle.ops.contract.OP_CONTRACTS) a backend may replace ----

def gated_mla_prefill(q, k, v, gate, *, offset, scale, fast=False):
    return output_gate((attend_fast if fast else attend_naive)(q, k, v, offset, scale), gate)  # (M4-M5)


def gated_mla_decode_latent_cache(q_nope, q_pe, latent, lengths, w_kvb, gate, *, scale):
    rows = []
    for b in range(q_nope.shape[0]):  # one request at a time: attend_absorbed over its own cache
        n, p = int(lengths[b]), slice(b, b + 1)
        rows.append(attend_absorbed(q_nope[p], q_pe[p], latent[b, :n], w_kvb, n - 1, scale))  # (M4)
    return output_gate(torch.cat(rows), gate)  # (M5)


@dataclass(frozen=True, slots=True)
class MLAOut:
    out_TD: torch.Tensor  # MLA(x) (M5)
    latent_TC: torch.Tensor  # the new tokens' latents [ĉ_kv ‖ k_pe] (M2/M3), appended to the state


def forward(x_TD: torch.Tensor, W, state: MLAState, text: TextConfig, absorbed: bool = False,
            ops: Backend = REFERENCE, fast: bool = True) -> MLAOut:
    """MLA(x) for T new tokens; appends their latents to ``state`` (in place).

    Args:
        x_TD: the input_layernorm output, activation dtype.
        absorbed: the decode form (else the naive prefill form); same result.
        ops: the backend whose attention kernels run (docs/kernels.md).
        fast: where the backend has no prefill kernel, ``attend_fast`` rather than ``attend_naive``.

    Returns:
        ``MLAOut``: MLA(x) [T, D] and the new tokens' latents [T, C].
    """
    T = x_TD.shape[0]
    N, V, L = text.qk_nope_head_dim, text.v_head_dim, text.kv_lora_rank
    q_nope, q_pe, latent_TC = project(x_TD, W, text)
    offset = state.length
    latent_SC = state.append(latent_TC)
    g_TP = linear(x_TD, W["mla.g_proj"])
    scale = softmax_scale(text)
    if absorbed:  # one query per kernel row, each at its own position (decode: T = 1)
        lengths_B = torch.arange(offset + 1, offset + T + 1, device=x_TD.device)
        latent_BSC = latent_SC[None].expand(T, -1, -1)
        w_HEL = W["mla.kv_b_proj"].view(-1, N + V, L)
        attend = ops.op("gated_mla_decode_latent_cache", gated_mla_decode_latent_cache)
        y_TP = attend(q_nope, q_pe, latent_BSC, lengths_B, w_HEL, g_TP, scale=scale)  # (M4-M5)
    else:
        k_SHE, v_SHV = expand(latent_SC, W, text)  # (M2-M3)
        q_THE = torch.cat([q_nope, q_pe], dim=-1)
        attend = ops.op("gated_mla_prefill", partial(gated_mla_prefill, fast=fast))
        y_TP = attend(q_THE, k_SHE, v_SHV, g_TP, offset=offset, scale=scale)  # (M4-M5)
    return MLAOut(W.reduce(linear(y_TP, W["mla.o_proj"])), latent_TC)  # (M5) W_o, row-parallel sum
