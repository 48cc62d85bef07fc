"""MLA prefill attention (M4) as one fused Triton kernel on a CUDA device: the reference's contract
at the speed of a flash kernel.

``mla.attend_blocked`` materialises FP32 score blocks [H, 256, S] and runs P·V as an FP32 GEMM:
at 8,192 tokens it is 9× its bound, at 131,072 68× (docs/performance.md). This kernel streams
keys through on-chip tiles with the online softmax (one pass, nothing of size S² in memory) and
keeps the reference's precision contract (``mla`` module docstring):

- scores q·kᵀ: BF16 operands on the tensor cores with FP32 accumulation (every product exact in
  FP32, FP32 sums), as ``mla.scores_f32``; FP32 operands (the interpreter's path, see
  ``available``) as IEEE FP32 dots (no TF32);
- softmax in FP32: running max m, running sum l, p = exp(s − m) (M4);
- P·V with P in FP32: for BF16 V, P is split exactly into three BF16 parts
  p = p₁ + p₂ + p₃ (p₁ = bf16(p), p₂ = bf16(p − p₁), p₃ = p − p₁ − p₂: 3 × 8 significant bits
  hold FP32's 24), so each tensor-core product p_i·v is exact and the sum FP32 — the FP32 GEMM's
  contract, not a BF16 rounding of P; for FP32 V, an IEEE FP32 dot;
- the output divided by l once and rounded to the activation dtype once.

What differs from the readable form is only the summation order (keys in tiles, the softmax
normaliser applied at the end) and the exponential's last bits; ``tests/test_executor_mla_gpu.py``
states the measured difference against ``mla.attend_naive`` in FP32 and BF16 (in Triton's CPU
interpreter everywhere, on the GPU where there is one).

Head layout: Triton tiles are powers of two, so K's head dim E (nope + rope = 128 + 64 at full
width) is taken as two dot products over its leading power of two and the rest (128 + 64: exactly
q_nope·k_nope + q_pe·k_pe); the rest and the value dim must be powers of two ≥ 16, else
``available`` is False and ``attend_blocked`` serves (the tiny preset's 16 + 8).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; elsewhere attend_blocked serves
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

# (queries, keys) per tile, warps, pipeline stages per dtype: bench/mla_prefill.py --sweep on an H200
CONFIGS = {torch.bfloat16: (64, 64, 4, 2), torch.float32: (32, 32, 4, 2)}


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _head_split(E: int) -> tuple[int, int]:
    """E = E1 + E2 with E1 the largest power of two <= E (192 -> 128 + 64)."""
    e1 = 1 << (E.bit_length() - 1)
    return e1, E - e1


def available(q_THE: torch.Tensor, v_dim: int) -> bool:
    """True where the kernel serves (M4): a BF16 CUDA tensor, head dims that tile (module docstring).

    FP32 stays with ``attend_blocked`` on CUDA: Triton's IEEE FP32 dot runs as FMAs at ~1-9
    TFLOP/s on an H200, slower than cuBLAS's FP32 GEMMs, and its ``exp`` (ex2.approx) costs FP32
    digits the readable form keeps (docs/performance.md "MLA prefill kernel"). Under Triton's CPU
    interpreter the FP32 path serves instead (its BF16 dot is not one): the tests check the
    kernel's tiling, masking and online softmax there.
    """
    if triton is None:
        return False
    dtype = torch.float32 if os.environ.get("TRITON_INTERPRET") == "1" else torch.bfloat16
    e1, e2 = _head_split(q_THE.shape[-1])
    return (q_THE.dtype == dtype and (q_THE.is_cuda or dtype == torch.float32)
            and _pow2(e1) and (e2 == 0 or _pow2(e2)) and _pow2(v_dim))


if triton is not None:
    @triton.jit
    def _tile(acc, m_i, l_i, qn, qr, k_ptr, v_ptr, s0, pos, sk_s, sv_s, hi, scale,
              N: tl.constexpr, R: tl.constexpr, V: tl.constexpr, BN: tl.constexpr,
              MASK: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr):
        """One key tile of the online softmax (M4): scores, running max/sum, P·V accumulated."""
        cols = s0 + tl.arange(0, BN)
        c64 = cols.to(tl.int64)
        k_cols = k_ptr + c64[None, :] * sk_s
        v_rows = v_ptr + c64[:, None] * sv_s + tl.arange(0, V)[None, :]
        if MASK:  # the diagonal tiles: keys up to ``hi`` only
            kn = tl.load(k_cols + tl.arange(0, N)[:, None], mask=(cols < hi)[None, :], other=0.0)
            v = tl.load(v_rows, mask=(cols < hi)[:, None], other=0.0)
        else:
            kn = tl.load(k_cols + tl.arange(0, N)[:, None])
            v = tl.load(v_rows)
        if IEEE:
            s = tl.dot(qn, kn, input_precision="ieee")
        else:
            s = tl.dot(qn, kn)  # BF16 x BF16 -> FP32: exact products, FP32 sums
        if R > 0:  # the head dim's second part (k_pe at full width)
            if MASK:
                kr = tl.load(k_cols + N + tl.arange(0, R)[:, None], mask=(cols < hi)[None, :], other=0.0)
            else:
                kr = tl.load(k_cols + N + tl.arange(0, R)[:, None])
            if IEEE:
                s += tl.dot(qr, kr, input_precision="ieee")
            else:
                s += tl.dot(qr, kr)
        s = s * scale  # (M4) q kᵀ · (nope + rope)^(-1/2)
        if MASK:  # causal: key position <= query position (and inside the keys that exist)
            s = tl.where((cols[None, :] <= pos[:, None]) & (cols < hi)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # (M4) softmax numerator in FP32
        l_i = l_i * alpha + tl.sum(p, 1)
        if SPLIT:  # P in FP32 as three exact BF16 parts: every product exact, FP32 sums
            p1 = p.to(tl.bfloat16)
            r = p - p1.to(tl.float32)
            p2 = r.to(tl.bfloat16)
            p3 = (r - p2.to(tl.float32)).to(tl.bfloat16)
            pv = tl.dot(p1, v) + tl.dot(p2, v) + tl.dot(p3, v)
        elif IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv  # (M4) Σ_s p_s v_s, rescaled to the running max
        return acc, m_new, l_i

    @triton.jit
    def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, offset, scale,
                        sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, so_t, so_h,
                        N: tl.constexpr, R: tl.constexpr, V: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        SPLIT: tl.constexpr, IEEE: tl.constexpr):
        # the longest causal rows first, so the short ones fill the tail of the launch
        mb, h = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1).to(tl.int64)
        rows = mb * BM + tl.arange(0, BM)
        rmask = rows < T
        q_rows = q_ptr + h * sq_h + rows.to(tl.int64)[:, None] * sq_t
        qn = tl.load(q_rows + tl.arange(0, N)[None, :], mask=rmask[:, None], other=0.0)
        if R > 0:
            qr = tl.load(q_rows + N + tl.arange(0, R)[None, :], mask=rmask[:, None], other=0.0)
        else:
            qr = qn
        k_ptr += h * sk_h
        v_ptr += h * sv_h
        pos = rows + offset  # query t sits at absolute position offset + t
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, V], dtype=tl.float32)
        first = offset + mb * BM  # keys below the block's first query are visible to all its queries
        hi = tl.minimum(first + BM, offset + T)  # and none beyond its last
        full = (first // BN) * BN
        for s0 in range(0, full, BN):
            acc, m_i, l_i = _tile(acc, m_i, l_i, qn, qr, k_ptr, v_ptr, s0, pos, sk_s, sv_s, hi, scale,
                                  N, R, V, BN, False, SPLIT, IEEE)
        for s0 in range(full, hi, BN):
            acc, m_i, l_i = _tile(acc, m_i, l_i, qn, qr, k_ptr, v_ptr, s0, pos, sk_s, sv_s, hi, scale,
                                  N, R, V, BN, True, SPLIT, IEEE)
        o = acc / l_i[:, None]  # (M4) the softmax normaliser, once
        o_rows = o_ptr + h * so_h + rows.to(tl.int64)[:, None] * so_t
        tl.store(o_rows + tl.arange(0, V)[None, :], o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def attend(q_THE: torch.Tensor, k_SHE: torch.Tensor, v_SHV: torch.Tensor, offset: int, scale: float,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """(M4) causal attention of T queries at positions offset.. over S = offset + T keys, as
    ``mla.attend_naive``: o [T, H, V] in the activation dtype. ``config``: (BM, BN, warps,
    stages), else ``CONFIGS``."""
    T, H, E = q_THE.shape
    V = v_SHV.shape[-1]
    if k_SHE.shape[0] != offset + T or k_SHE.shape[1:] != (H, E) or v_SHV.shape[:2] != (offset + T, H):
        raise ValueError(f"mla_gpu.attend: q {tuple(q_THE.shape)} k {tuple(k_SHE.shape)} v {tuple(v_SHV.shape)} "
                         f"do not fit offset {offset}")
    if q_THE.stride(-1) != 1 or k_SHE.stride(-1) != 1 or v_SHV.stride(-1) != 1:
        q_THE, k_SHE, v_SHV = q_THE.contiguous(), k_SHE.contiguous(), v_SHV.contiguous()
    BM, BN, warps, stages = config or CONFIGS[q_THE.dtype]
    e1, e2 = _head_split(E)
    o = q_THE.new_empty(T, H, V)
    ieee = q_THE.dtype == torch.float32
    split = q_THE.dtype == torch.bfloat16
    grid = (triton.cdiv(T, BM), H)
    _prefill_kernel[grid](q_THE, k_SHE, v_SHV, o, T, offset, scale,
                          q_THE.stride(0), q_THE.stride(1), k_SHE.stride(0), k_SHE.stride(1),
                          v_SHV.stride(0), v_SHV.stride(1), o.stride(0), o.stride(1),
                          N=e1, R=e2, V=V, BM=BM, BN=BN, SPLIT=split, IEEE=ieee,
                          num_warps=warps, num_stages=stages)
    return o
