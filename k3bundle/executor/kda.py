"""Kimi Delta Attention, the linear-attention mixer of 69 of the 93 layers (docs/kimi-k3.md §3.3).

(K1) c̃_t = SiLU( Σ_{i=0..3} W_conv_c[:,0,i] ⊙ u_c,t−3+i ),  u_c = W_c x,  c ∈ {q, k, v}
(K2) q_t = q̃_t / sqrt(Σq̃_t² + 1e-6) · d^(−1/2);  k_t = k̃_t / sqrt(Σk̃_t² + 1e-6);  v_t = ṽ_t
(K3) g_t[h,j] = −5 · σ( exp(A_log[h]) · (z_t[h,j] + dt_bias[h,j]) ),  z_t = W_fb W_fa x;  α_t = exp(g_t)
(K4) β_t[h] = σ( (W_b x)[h] )
(K5) S' = Diag(α_t) S_{t−1};  u = β_t (v_t − S'ᵀ k_t);  S_t = S' + k_t uᵀ;  o_t = S_tᵀ q_t
(K6) y_t[h] = RMSNorm_{o_norm}(o_t[h]) ⊙ σ( (W_g x)[h] )
(K7) KDA(x) = W_o · concat_h y_t[h]

K5 has two forms. Decode uses the recurrence as written. Prefill uses the chunked form
(chunk 64): inside a chunk starting from state S₀, with Γ_t = Σ_{s≤t} g_s (log-decay from the
chunk start, per key channel) and D[t,s] = exp(Γ_t − Γ_s) for s ≤ t (always ≤ 1, so no
overflow in FP32 even at the −5 lower bound),
  (I + A) U = β ⊙ (V − (e^Γ ⊙ K) S₀),  A[t,s] = β_t Σ_j k_t[j] k_s[j] D[t,s,j]  (s < t)
  O = (e^Γ ⊙ Q) S₀ + M U,               M[t,s] = Σ_j q_t[j] k_s[j] D[t,s,j]        (s ≤ t)
  S_C = e^{Γ_C} ⊙ S₀ + Σ_s (e^{Γ_C − Γ_s} ⊙ k_s) u_sᵀ
where U stacks the u_t of K5. This is K5 unrolled exactly (no approximation); the tests check
it against fla-core's naive recurrent and naive chunk functions and against ``recurrent``.

Precision: projections in the activation dtype; conv, L2 norm, gates and the delta rule in the
state dtype (FP32; FP64 in the float64 policy); o is handed back in the activation dtype, as
fla's kernels return the dtype of v. State layout S[h] = [dk, dv] (fla's layout; HF
transposes it, docs/kimi-k3.md §5.3).

Legend: T tokens, D model width, H heads, K key dim, V value dim, P = H·K channels,
W conv state rows (kernel − 1), C chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3bundle.config import TextConfig
from k3bundle.executor.cache import KDAState
from k3bundle.executor.norms import compute_dtype, linear, rms_norm
from k3bundle.ops.contract import REFERENCE, Backend

L2_EPS = 1e-6  # (K2) inside the sqrt, as fla's l2norm (use_qk_l2norm_in_kernel)
CHUNK = 64
CONV_ROLES = (("kda.q_proj", "kda.q_conv"), ("kda.k_proj", "kda.k_conv"), ("kda.v_proj", "kda.v_conv"))


CONV_ROW_BLOCK = 8192  # tokens per block of the conv's [T, P, kernel] windows (rows are independent)


def short_conv(u_TP: torch.Tensor, w_P1K: torch.Tensor, state_WP: torch.Tensor, c: torch.dtype):
    """(K1) depthwise causal conv + SiLU; returns (c̃ [T, P], the extended input [W+T, P])."""
    ext_SP = torch.cat([state_WP.to(u_TP.dtype), u_TP])  # rows t..t+3 of ext are u_{t-3}..u_t
    win_TPK = ext_SP.unfold(0, w_P1K.shape[-1], 1)  # [T, P, kernel]; tap i=3 is the current token
    # the conv kernels are F32 in the checkpoint: accumulate in the state dtype
    w_PK = w_P1K[:, 0].to(c)
    out_TP = torch.cat([F.silu((win_TPK[s:s + CONV_ROW_BLOCK].to(c) * w_PK).sum(-1))  # (K1)
                        for s in range(0, win_TPK.shape[0], CONV_ROW_BLOCK)])
    return out_TP.to(u_TP.dtype), ext_SP


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)  # (K2)


def recurrent(q_THK, k_THK, v_THV, g_THK, beta_TH, S_HKV):
    """(K5) token by token; returns (o [T, H, V], final S)."""
    o_THV = q_THK.new_empty(*v_THV.shape)
    for t in range(q_THK.shape[0]):
        S_HKV = g_THK[t].exp()[..., None] * S_HKV  # (K5) S' = Diag(α_t) S: decay rows = key channels
        u_HV = beta_TH[t, :, None] * (v_THV[t] - torch.einsum("hk,hkv->hv", k_THK[t], S_HKV))  # (K5)
        S_HKV = S_HKV + k_THK[t][..., None] * u_HV[:, None, :]  # (K5) S_t = S' + k uᵀ
        o_THV[t] = torch.einsum("hk,hkv->hv", q_THK[t], S_HKV)  # (K5) read after the update
    return o_THV, S_HKV


def chunked(q_THK, k_THK, v_THV, g_THK, beta_TH, S_HKV, chunk: int = CHUNK, boundaries=()):
    """(K5) in chunks of ``chunk``; returns (o [T, H, V], final S, {n: S after n tokens})."""
    q, k, v, g = (x.transpose(0, 1) for x in (q_THK, k_THK, v_THV, g_THK))  # [H, T, *]
    beta_HT = beta_TH.T
    o_HTV = v.new_empty(v.shape)
    saved = {}
    for s in range(0, q.shape[1], chunk):
        e = min(s + chunk, q.shape[1])
        q_c, k_c, v_c, b_HC = q[:, s:e], k[:, s:e], v[:, s:e], beta_HT[:, s:e]
        C = e - s
        G_HCK = g[:, s:e].cumsum(1)  # Γ_t: log-decay from the chunk start through t
        lower_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # pairwise decays masked *before* exp: every exponent is <= 0, so FP32 never overflows
        D_HCCK = (G_HCK[:, :, None] - G_HCK[:, None, :]).masked_fill(~lower_CC[..., None], -torch.inf).exp()
        A_HCC = (b_HC[..., None] * torch.einsum("htk,hsk,htsk->hts", k_c, k_c, D_HCCK)).tril(-1)  # (K5)
        M_HCC = torch.einsum("htk,hsk,htsk->hts", q_c, k_c, D_HCCK)  # (K5) s <= t
        rhs_HCV = b_HC[..., None] * (v_c - (k_c * G_HCK.exp()) @ S_HKV)  # (K5) β(v − S'ᵀk), S₀ part
        eye = torch.eye(C, dtype=q.dtype, device=q.device)
        U_HCV = torch.linalg.solve_triangular(A_HCC + eye, rhs_HCV, upper=False, unitriangular=True)  # (K5)
        o_HTV[:, s:e] = (q_c * G_HCK.exp()) @ S_HKV + M_HCC @ U_HCV  # (K5) o_t = S_tᵀ q_t
        decay_HK = G_HCK[:, -1]
        S_HKV = decay_HK.exp()[..., None] * S_HKV + \
            (k_c * (decay_HK[:, None] - G_HCK).exp()).transpose(1, 2) @ U_HCV  # (K5) S at chunk end
        if e in boundaries:
            saved[e] = S_HKV.clone()
    return o_HTV.transpose(0, 1), S_HKV, saved


def subchunk(chunk: int, lower: float) -> int:
    """The sub-chunk length of ``chunked_batched``: decay factors up to e^(|lower|·B) ≤ e^80 stay
    finite and normal in FP32 (e^±80 ≈ 5.5e34 / 1.8e-35), B dividing the chunk."""
    return next(b for b in (16, 8, 4, 2, 1) if chunk % b == 0 and abs(lower) * b <= 80)


def chunked_batched(q_THK, k_THK, v_THV, g_THK, beta_TH, S_HKV, chunk: int = CHUNK, lower: float = -5.0,
                    block_tokens: int = 4096, boundaries=()):
    """(K5) the chunked form with every chunk's intra-chunk work batched; returns (o [T, H, V],
    final S, {n: S after n tokens} at the ``boundaries``, chunk multiples or T).

    The same equations as ``chunked`` (module docstring), rearranged so that only the state
    update runs chunk by chunk. Per chunk, U = u − w S₀ with u = (I + A)⁻¹ β V and
    w = (I + A)⁻¹ β (e^Γ ⊙ K), so O = M u + (e^Γ ⊙ Q − M w) S₀: A, M, u, w and both products
    are computed for all chunks and heads at once. A and M come as matmuls: in sub-chunk i
    (rows iB..iB+B−1) D[t,s] = e^(Γ_t − r_i) · e^(r_i − Γ_s) with r_i = Γ before sub-chunk i,
    both factors ≤ 1 for s before the sub-chunk and within e^(±|lower|·B) inside it. Tokens
    past T pad the last chunk with q = k = v = g = β = 0, which leaves S and every real row as
    they are. ``block_tokens`` (a chunk multiple) bounds the memory of the batched tensors. The
    states at chunk boundaries fall out of the chunk-by-chunk update, so a run that keeps
    snapshots computes exactly what one that keeps none does.
    """
    T, outs, saved = q_THK.shape[0], [], {}
    for s0 in range(0, T, block_tokens):
        p = slice(s0, s0 + block_tokens)
        o, S_HKV, S0 = _chunk_block(q_THK[p], k_THK[p], v_THV[p], g_THK[p], beta_TH[p], S_HKV, chunk,
                                    subchunk(chunk, lower))
        outs.append(o)
        for b in boundaries:
            if s0 < b < s0 + o.shape[0]:
                saved[b] = S0[:, (b - s0) // chunk].clone()  # the state before that chunk
            elif b == s0 + o.shape[0]:
                saved[b] = S_HKV.clone()
    return torch.cat(outs), S_HKV, saved


def _chunk_block(q_THK, k_THK, v_THV, g_THK, beta_TH, S_HKV, C: int, B: int):
    T = q_THK.shape[0]
    n = -(-T // C)
    pad = n * C - T

    def grid(x):  # [T, H, *] -> [H, n, C, *], zero rows past T
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        return x.reshape(n, C, *x.shape[1:]).movedim(2, 0)
    q, k, v, g, beta = grid(q_THK), grid(k_THK), grid(v_THV), grid(g_THK), grid(beta_TH)
    G = g.cumsum(2)  # Γ_t from the chunk start
    A, M = (q.new_zeros(*q.shape[:3], C) for _ in range(2))
    for i in range(C // B):
        t, upto = slice(i * B, (i + 1) * B), (i + 1) * B
        r = G[:, :, i * B - 1, None] if i else torch.zeros_like(G[:, :, :1])  # Γ before sub-chunk i
        left = (G[:, :, t] - r).exp()  # ≤ 1
        k_right = k[:, :, :upto] * (r - G[:, :, :upto]).exp()  # ≤ 1 before the sub-chunk
        M[:, :, t, :upto] = (q[:, :, t] * left) @ k_right.transpose(-1, -2)  # (K5) Σ_j q_t k_s D[t,s]
        A[:, :, t, :upto] = (k[:, :, t] * left) @ k_right.transpose(-1, -2)  # (K5) Σ_j k_t k_s D[t,s]
    M = M.tril()  # s <= t
    A = (beta[..., None] * A).tril(-1)  # (K5) A[t,s] = β_t Σ_j k_t k_s D[t,s], s < t
    eG = G.exp()
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * (k * eG)], -1)  # β V | β (e^Γ ⊙ K)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    uw = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)  # (K5)
    u, w = uw[..., :v.shape[-1]], uw[..., v.shape[-1]:]
    Mu, Qw = M @ u, q * eG - M @ w  # O = M u + (e^Γ ⊙ Q − M w) S₀
    decay = G[:, :, -1]  # Γ_C
    k_dec = k * (decay[:, :, None] - G).exp()  # e^(Γ_C − Γ_s) ⊙ k_s
    S0 = q.new_empty(q.shape[0], n, *S_HKV.shape[1:])
    for j in range(n):  # (K5) the state, chunk by chunk: S_C = e^(Γ_C) ⊙ S₀ + Σ_s (e^(Γ_C−Γ_s) k_s) u_sᵀ
        S0[:, j] = S_HKV
        U = u[:, j] - w[:, j] @ S_HKV
        S_HKV = decay[:, j].exp()[..., None] * S_HKV + k_dec[:, j].transpose(-1, -2) @ U
    O = Mu + Qw @ S0  # (K5) o_t = S_tᵀ q_t
    return O.movedim(0, 2).reshape(n * C, *O.shape[:1], O.shape[-1])[:T], S_HKV, S0


def gates(q_THK, k_THK, v_THV, z_THK, b_TH, A_log_H, dt_HK, lower: float, c: torch.dtype):
    """(K2-K4) the delta rule's inputs from the projections, in the state dtype ``c``:
    (q, k, v, g = log α, β). K = q's last dim, H heads from ``A_log_H`` (already sliced)."""
    K = q_THK.shape[-1]
    qt_THK, kt_THK, v_THV, z_THK = (t.to(c) for t in (q_THK, k_THK, v_THV, z_THK))
    a_H1 = A_log_H.to(c).exp()[:, None]
    q_THK = l2_normalise(qt_THK) * K ** -0.5  # (K2) L2 norm, then d^(-1/2)
    k_THK = l2_normalise(kt_THK)  # (K2); (K2) v_t = ṽ_t
    g_THK = lower * torch.sigmoid(a_H1 * (z_THK + dt_HK.to(c)))  # (K3) log α_t ∈ (−5, 0), dt_bias first
    beta_TH = torch.sigmoid(b_TH.to(c))  # (K4)
    return q_THK, k_THK, v_THV, g_THK, beta_TH


@dataclass(frozen=True, slots=True)
class KDAOut:
    out_TD: torch.Tensor  # KDA(x) (K7)
    state: KDAState  # the state after the T tokens
    snapshots: dict[int, KDAState]  # {n: state after n tokens} at the requested chunk boundaries


# ---- the reference form of the ops (k3bundle.ops.contract.OP_CONTRACTS) a backend may replace ----
# Batched forms (varlen ``cu_seqlens``, decode batches) loop over requests: the equations above,
# once per request, so the executor with no backend is exactly these lines.

def kda_chunked_prefill(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, *, lower_bound, chunk=CHUNK,
                        fast=False):
    c, cu = state.dtype, [int(x) for x in cu_seqlens]
    outs, finals = [], []
    for n in range(len(cu) - 1):
        p = slice(cu[n], cu[n + 1])
        args = gates(q[p], k[p], v[p], g[p], beta[p], A_log, dt_bias, lower_bound, c)  # (K2-K4)
        if fast:
            o, S, _ = chunked_batched(*args, state[n], chunk, lower_bound)  # (K5)
        else:
            o, S, _ = chunked(*args, state[n], chunk)  # (K5)
        outs.append(o)
        finals.append(S)
    return torch.cat(outs), torch.stack(finals)


def kda_recurrent_decode(q, k, v, g, beta, A_log, dt_bias, state, *, lower_bound):
    c = state.dtype
    outs, finals = [], []
    for b in range(q.shape[0]):
        p = slice(b, b + 1)
        args = gates(q[p], k[p], v[p], g[p], beta[p], A_log, dt_bias, lower_bound, c)  # (K2-K4)
        o, S = recurrent(*args, state[b])  # (K5)
        outs.append(o)
        finals.append(S)
    return torch.cat(outs), torch.stack(finals)


def causal_short_conv1d_with_state(u, weight, state):
    out, ext = short_conv(u, weight, state, compute_dtype(u))  # (K1)
    return out, ext[ext.shape[0] - state.shape[0]:]


def forward(x_TD: torch.Tensor, W, state: KDAState, text: TextConfig, decode: bool = False,
            chunk: int = CHUNK, boundaries=(), ops: Backend = REFERENCE, fast: bool = True) -> KDAOut:
    """KDA(x) for T new tokens after ``state``.

    Args:
        x_TD: the input_layernorm output, activation dtype.
        W: the layer's weights by role ("kda.*").
        decode: use the recurrence (else the chunked form).
        boundaries: token counts (multiples of ``chunk``) at which to return state snapshots.
        ops: the backend whose conv and delta-rule kernels run (docs/kernels.md).
        fast: where the backend has no prefill kernel, ``chunked_batched`` rather than ``chunked``.

    Returns:
        ``KDAOut``: KDA(x) [T, D], the state after the T tokens, {n: state after n tokens}.
    """
    T, act, c = x_TD.shape[0], x_TD.dtype, state.recurrent_HKV.dtype
    H = W["kda.b_proj"].shape[0]  # heads from the weights: a TP rank may hold a slice
    K = W["kda.q_proj"].shape[0] // H
    V = W["kda.o_norm"].shape[0]
    conv_op = ops.op("causal_short_conv1d_with_state", causal_short_conv1d_with_state)
    conv, ext, conv_state = [], [], []
    for i, (proj, kernel) in enumerate(CONV_ROLES):
        u_TP = linear(x_TD, W[proj])  # (K1) u_c = W_c x
        out_TP, new_WP = conv_op(u_TP, W[kernel], state.conv_3WP[i])  # (K1)
        conv.append(out_TP)
        conv_state.append(new_WP)
        ext.append(torch.cat([state.conv_3WP[i].to(u_TP.dtype), u_TP]))  # the inputs, for snapshots
    qt_TP, kt_TP, vt_TP = conv
    z_TP = linear(linear(x_TD, W["kda.f_a_proj"]), W["kda.f_b_proj"])  # (K3) z = W_fb W_fa x (low rank)
    b_TH = linear(x_TD, W["kda.b_proj"])
    g_TP = linear(x_TD, W["kda.g_proj"])
    # K2-K5 and the gates run in the kernel, in the state dtype (FP32; FP64 under float64), as
    # fla's kernels do with use_qk_l2norm / use_gate / use_beta_sigmoid_in_kernel
    q_THK, k_THK, v_THV, z_THK = (t.view(T, H, -1) for t in (qt_TP, kt_TP, vt_TP, z_TP))
    A_log_H = W["kda.A_log"][:H]  # A_log is stored zero-padded to 128 (docs/kimi-k3.md §2.3)
    dt_HK = W["kda.dt_bias"].view(H, K)
    lower = text.linear_attn_config.gate_lower_bound
    S_HKV, saved, o_parts = state.recurrent_HKV, {}, []
    if decode:  # (K5) the recurrence, one token per kernel call
        step = ops.op("kda_recurrent_decode", kda_recurrent_decode)
        for t in range(T):
            s = slice(t, t + 1)
            o_1HV, S_1HKV = step(q_THK[s], k_THK[s], v_THV[s], z_THK[s], b_TH[s], A_log_H, dt_HK, S_HKV[None],
                                 lower_bound=lower)
            o_parts.append(o_1HV)
            S_HKV = S_1HKV[0]
    elif fast and not ops.provides("kda_chunked_prefill"):  # (K5) batched; snapshots from its state updates
        args = gates(q_THK, k_THK, v_THV, z_THK, b_TH, A_log_H, dt_HK, lower, c)  # (K2-K4)
        o_THV, S_HKV, saved = chunked_batched(*args, S_HKV, chunk, lower, boundaries=boundaries)  # (K5)
        o_parts.append(o_THV)
    else:  # (K5) the chunked form; cut at the snapshot boundaries (chunk multiples: exact)
        prefill, s = ops.op("kda_chunked_prefill", kda_chunked_prefill), 0
        for e in sorted({*boundaries, T}):
            cu = torch.tensor([0, e - s], dtype=torch.long, device=x_TD.device)
            p = slice(s, e)
            o_CHV, S_1HKV = prefill(q_THK[p], k_THK[p], v_THV[p], z_THK[p], b_TH[p], A_log_H, dt_HK, S_HKV[None],
                                    cu, lower_bound=lower, chunk=chunk)
            o_parts.append(o_CHV)
            S_HKV, s = S_1HKV[0], e
            if e in boundaries:
                saved[e] = S_HKV.clone()  # a backend may reuse its output buffer
    # the delta-rule kernel hands o back in the activation dtype (fla returns v's dtype)
    o_THV = torch.cat(o_parts).to(act)
    n_THV = rms_norm(o_THV, W["kda.o_norm"], text.rms_norm_eps)  # (K6) N1, F32 gain shared by heads
    # the sigmoid gate multiplies in FP32 and rounds once to the activation dtype
    n_THV, gate_THV = n_THV.to(c), g_TP.view(T, H, V).to(c)
    y_THV = (n_THV * torch.sigmoid(gate_THV)).to(act)  # (K6) ⊙ σ(W_g x)
    out_TD = W.reduce(linear(y_THV.reshape(T, H * V), W["kda.o_proj"]))  # (K7) row-parallel sum
    win = state.conv_3WP.shape[1]

    def conv_after(n: int) -> torch.Tensor:  # (K1) the last W pre-conv inputs after n tokens
        return torch.stack([x[n:n + win] for x in ext])

    snaps = {n: KDAState(S, conv_after(n)) for n, S in saved.items()}
    return KDAOut(out_TD, KDAState(S_HKV, torch.stack(conv_state).to(state.conv_3WP.dtype)), snaps)
