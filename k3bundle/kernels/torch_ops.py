"""The ``torch`` backend: stock PyTorch kernels for MLA and the routed experts.

- ``gated_mla_prefill``: ``F.scaled_dot_product_attention`` in the activation dtype (flash or
  cuDNN attention on a GPU in BF16; the math kernel elsewhere), causal with the queries at the
  end of the keys (a boolean mask when a cached prefix precedes them); the sigmoid gate in FP32.
- ``gated_mla_decode_latent_cache``: the absorbed form for a batch of requests as batched matmuls
  over a padded latent cache, keys past each request's length masked; FP32 like FlashMLA's
  accumulators.
- ``mxfp4_weight_gemm_grouped``: tokens sorted by expert; each touched expert's MXFP4 weights
  decoded once (``mxfp4_lut_decode``: a 16-entry E2M1 table and E8M0 exponents built from bits,
  on the device) and its tokens run together: ``torch._grouped_mm`` over all touched experts on a
  GPU in BF16 where the shapes allow it, one matmul per expert otherwise; the combine in FP32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAME = "torch"
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _c(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gate(o_TP: torch.Tensor, gate_TP: torch.Tensor) -> torch.Tensor:
    c = _c(o_TP)
    return (o_TP.to(c) * torch.sigmoid(gate_TP.to(c))).to(o_TP.dtype)  # (M5)


def gated_mla_prefill(q, k, v, gate, *, offset, scale):
    T, S = q.shape[0], k.shape[0]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T|S, E]
    if offset == 0 and T == S:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:  # query t sits at position offset + t
        mask = torch.arange(S, device=q.device)[None, :] <= (torch.arange(T, device=q.device)[:, None] + offset)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return _gate(o[0].transpose(0, 1).reshape(T, -1), gate)


def gated_mla_decode_latent_cache(q_nope, q_pe, latent, lengths, w_kvb, gate, *, scale):
    B, H, N = q_nope.shape
    L = w_kvb.shape[-1]
    c = _c(q_nope)
    w = w_kvb.to(c)
    ckv, kpe = latent[..., :L].to(c), latent[..., L:].to(c)  # [B, S, L], [B, S, R]
    q_lat = torch.einsum("bhn,hnl->bhl", q_nope.to(c), w[:, :N])  # W_UK^T q_nope
    scores = (torch.bmm(q_lat, ckv.transpose(1, 2)) + torch.bmm(q_pe.to(c), kpe.transpose(1, 2))) * scale
    keep = torch.arange(latent.shape[1], device=latent.device)[None, :] < lengths.to(latent.device)[:, None]
    p = torch.softmax(scores.masked_fill(~keep[:, None, :], -torch.inf), dim=-1)
    o = torch.einsum("bhl,hvl->bhv", torch.bmm(p, ckv), w[:, N:])  # W_UV
    return _gate(o.to(q_nope.dtype).reshape(B, -1), gate)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols/2] packed codes (low nibble = even column) -> [rows, cols] f32 by table."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    return table[torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()]


def e8m0_pow2(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> 2^(s-127) in f32 from the exponent field (s = 0: the subnormal 2^-127; 255: NaN)."""
    s = scale.to(torch.int32)
    pow2 = torch.where(s == 0, torch.full_like(s, 0x00400000), s << 23).view(torch.float32)
    return torch.where(s == 0xFF, torch.full_like(pow2, float("nan")), pow2)


def mxfp4_lut_decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 [rows, cols/2] codes + E8M0 [rows, cols/32] -> [rows, cols] values, on their device.

    Bit-identical to the codec (OCP MX v1.0): the product of an E2M1 value and a power of two is
    exact in f32 (or overflows, scale bytes >= 253: f64 for an f64 result, as the codec), then one
    rounding to ``dtype`` (exact for BF16 too).
    """
    c = torch.float64 if dtype == torch.float64 else torch.float32
    values = e2m1_values(packed).to(c).view(packed.shape[0], -1, 32) * e8m0_pow2(scale).to(c)[..., None]
    return values.reshape(packed.shape[0], -1).to(dtype)


def _weight(w, dtype):
    packed = w.mxfp4()
    return w.value().to(dtype) if packed is None else mxfp4_lut_decode(*packed, dtype)


def _situ_glu(x, w1, w3, w2, beta, cap, mm):
    c = _c(x)
    g, u = mm(x, w1, True).to(c), mm(x, w3, True).to(c)
    h = (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (cap * torch.tanh(u / cap))).to(x.dtype)  # S1-S3
    return mm(h, w2, False)


def mxfp4_weight_gemm_grouped(z, ids, weights, experts, *, situ_beta, situ_cap):
    T, K = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    uniq, counts = torch.unique_consecutive(flat[order], return_counts=True)
    tok_all = order // K
    r = torch.zeros(z.shape, dtype=weights.dtype, device=z.device)
    w_flat = weights.reshape(-1)[order]
    groups, start = [], 0
    for e, n in zip(uniq.tolist(), counts.tolist()):
        E = experts(e)
        if E is not None:  # other experts live on another expert-parallel rank
            groups.append((E, slice(start, start + n)))
        start += n
    if not groups:
        return r
    W1 = torch.stack([_weight(E["moe.expert.w1"], z.dtype) for E, _ in groups])  # [G, I, L]: each decoded once
    W3 = torch.stack([_weight(E["moe.expert.w3"], z.dtype) for E, _ in groups])
    W2 = torch.stack([_weight(E["moe.expert.w2"], z.dtype) for E, _ in groups])  # [G, L, I]
    rows = torch.cat([torch.arange(s.start, s.stop, device=z.device) for _, s in groups])
    x = z[tok_all[rows]]
    sizes = [s.stop - s.start for _, s in groups]
    grouped = (z.is_cuda and z.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
               and all(d % 8 == 0 for d in (*W1.shape[1:], W2.shape[1])))
    if grouped:
        offs = torch.tensor(sizes, device=z.device).cumsum(0).to(torch.int32)

        def mm(a, W, first):
            return torch._grouped_mm(a, W.transpose(1, 2), offs=offs)
    else:
        bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]

        def mm(a, W, first):
            return torch.cat([a[bounds[g]:bounds[g + 1]] @ W[g].T for g in range(len(sizes))])
    y = _situ_glu(x, W1, W3, W2, situ_beta, situ_cap, mm)  # (R5) every token of every touched expert
    r.index_add_(0, tok_all[rows], w_flat[rows, None] * y.to(r.dtype))  # (R5) Σ w_i E_i(z), FP32
    return r
