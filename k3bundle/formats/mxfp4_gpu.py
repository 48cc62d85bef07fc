"""MXFP4 dequantization as one Triton kernel on a CUDA device, bit-identical to ``mxfp4.dequantize``.

The torch form of the codec (``mxfp4.dequantize``) is a table gather, a scale broadcast and a
multiply: four passes over memory, ~93 GB/s of packed input on an H200. This kernel reads each
packed byte and its scale byte once and writes the two values: the minimum traffic of a decode
that materialises its output (1 byte in, 4 bytes out for BF16; docs/performance.md "MXFP4 decode").

The arithmetic is the codec's, from bits (OCP MX v1.0 §5.3, §6.3):
  E2M1 code c = s·8 + m:  |v| = m/2 for m < 2, else (2 + (m & 1)) · 2^(m >> 1) / 4
  E8M0 byte x:            2^(x − 127) as f32 bits x << 23 (x = 0: the subnormal 2^-127, 1 << 22;
                          x = 255: NaN for the whole block)
  value = v · 2^(x − 127) in f32: exact, or ±Inf where it overflows, as in the codec; then one
  rounding to the output dtype (exact for BF16 and F32: ≤ 2 significant bits; BF16 is written as
  the upper half of the F32 bits, which for an exact value is the same number, subnormals included).
The two values of a byte leave as one word (int32 for 16-bit outputs, int64 for F32), so every
store is whole and coalesced.
``tests/test_formats_mxfp4_gpu.py`` checks every (code byte, scale byte) pair against the codec,
bit for bit, on the GPU and in Triton's CPU interpreter.
"""

from __future__ import annotations

import torch

from k3bundle.errors import CodecError

try:  # Triton ships with CUDA builds of torch; elsewhere the torch codec serves
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

BYTES_PER_PROGRAM = 4096  # packed bytes per program, and its warps: the H200's best (bench/mxfp4_decode.py --sweep)
NUM_WARPS = 4
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the kernel's OUT codes 0, 1, 2


def available(packed: torch.Tensor, dtype: torch.dtype) -> bool:
    """True where this kernel serves ``mxfp4.dequantize``: a CUDA tensor, Triton, a 16/32-bit float."""
    return triton is not None and packed.is_cuda and dtype in _DTYPES


if triton is not None:
    @triton.jit
    def _magnitude(m):
        # |E2M1| of the 3-bit magnitude m: 0, 0.5, 1, 1.5, 2, 3, 4, 6 (small integers: exact)
        sub = m.to(tl.float32) * 0.5
        e = m >> 1
        norm = (2 + (m & 1)).to(tl.float32) * (1 << e).to(tl.float32) * 0.25
        return tl.where(e == 0, sub, norm)

    @triton.jit
    def _value_bits(byte, x):
        """F32 bits of the two values of packed ``byte`` (low nibble, high nibble) under E8M0 ``x``."""
        factor = tl.where(x == 0, 1 << 22, x << 23).to(tl.float32, bitcast=True)  # 2^(x-127) from bits
        lo, hi = byte & 0xF, byte >> 4
        # the sign as the sign bit (a float negation could turn -0 into +0: code 8 is -0)
        lo_bits = (_magnitude(lo & 7) * factor).to(tl.int32, bitcast=True) | ((lo & 8) << 28)
        hi_bits = (_magnitude(hi & 7) * factor).to(tl.int32, bitcast=True) | ((hi & 8) << 28)
        lo_bits = tl.where(x == 255, 0x7FC00000, lo_bits)  # the whole block NaN
        hi_bits = tl.where(x == 255, 0x7FC00000, hi_bits)
        return lo_bits, hi_bits

    @triton.jit
    def _decode_kernel(packed_ptr, scale_ptr, words_ptr, n_bytes, BLOCK: tl.constexpr, GROUP_BYTES: tl.constexpr,
                       OUT: tl.constexpr, MANY: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        if MANY:  # axis 1 = one of several same-shape tensors: addresses from tables, outputs stacked
            m = tl.program_id(1)
            packed_ptr = tl.load(packed_ptr + m).to(tl.pointer_type(tl.uint8))
            scale_ptr = tl.load(scale_ptr + m).to(tl.pointer_type(tl.uint8))
            words_ptr += m.to(tl.int64) * n_bytes
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_bytes
        byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
        x = tl.load(scale_ptr + offs // GROUP_BYTES, mask=mask, other=127).to(tl.int32)
        lo_bits, hi_bits = _value_bits(byte, x)
        # one word per packed byte, the even element in its low half (little-endian): every store
        # is a whole, coalesced word
        if OUT == 0:  # BF16: an exact value's BF16 bits are its F32 bits' upper half (subnormals too)
            word = ((lo_bits >> 16) & 0xFFFF) | (hi_bits & -65536)
        elif OUT == 1:  # F16: one rounding (overflow to Inf, F16 subnormals), as the codec's cast
            lo16 = lo_bits.to(tl.float32, bitcast=True).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
            hi16 = hi_bits.to(tl.float32, bitcast=True).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
            word = (lo16 & 0xFFFF) | (hi16 << 16)
        else:  # F32
            word = (lo_bits.to(tl.int64) & 0xFFFFFFFF) | (hi_bits.to(tl.int64) << 32)
        tl.store(words_ptr + offs, word, mask=mask)


if triton is not None:
    @triton.jit
    def _gemv_kernel(x_ptr, pk_tab, sc_tab, y_ptr, R, C: tl.constexpr, N: tl.constexpr, BR: tl.constexpr,
                     BB: tl.constexpr, GROUP_BYTES: tl.constexpr):
        """y[g, n, r] = Σ_c x[g, n, c] · W_g[r, c], W_g decoded from MXFP4 in registers (FP32 sums)."""
        rb, g = tl.program_id(0), tl.program_id(1)
        packed_ptr = tl.load(pk_tab + g).to(tl.pointer_type(tl.uint8))
        scale_ptr = tl.load(sc_tab + g).to(tl.pointer_type(tl.uint8))
        rows = rb * BR + tl.arange(0, BR)
        rmask = rows < R
        half: tl.constexpr = C // 2
        x_g = x_ptr + g.to(tl.int64) * N * C
        for n in tl.static_range(N):
            acc = tl.zeros([BR], dtype=tl.float32)
            for b0 in range(0, half, BB):
                cols = b0 + tl.arange(0, BB)  # packed byte columns: values 2j (low) and 2j+1 (high)
                cmask = cols < half
                m2 = rmask[:, None] & cmask[None, :]
                off = rows.to(tl.int64)[:, None] * half + cols[None, :]
                byte = tl.load(packed_ptr + off, mask=m2, other=0).to(tl.int32)
                x = tl.load(scale_ptr + rows.to(tl.int64)[:, None] * (half // GROUP_BYTES) + cols[None, :] // GROUP_BYTES,
                            mask=m2, other=127).to(tl.int32)
                lo_bits, hi_bits = _value_bits(byte, x)
                w_lo, w_hi = lo_bits.to(tl.float32, bitcast=True), hi_bits.to(tl.float32, bitcast=True)
                x_even = tl.load(x_g + n * C + 2 * cols, mask=cmask, other=0.0).to(tl.float32)
                x_odd = tl.load(x_g + n * C + 2 * cols + 1, mask=cmask, other=0.0).to(tl.float32)
                acc += tl.sum(w_lo * x_even[None, :] + w_hi * x_odd[None, :], axis=1)
            y_g = y_ptr + (g.to(tl.int64) * N + n) * R
            tl.store(y_g + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)


GEMV_ROWS, GEMV_BYTES, GEMV_WARPS = 16, 256, 4  # rows per program, packed bytes per step along a row, warps


def matmul_many(x_GNC: torch.Tensor, packed: list[torch.Tensor], scales: list[torch.Tensor],
                block: int = 32) -> torch.Tensor:
    """``y[g] = x[g] @ dequantize(packed[g], scales[g]).T`` for a few rows of x per tensor, the
    weights decoded in registers (never written): [G, N, C] x G × [R, C] MXFP4 -> [G, N, R] in
    x's dtype, sums in FP32. For the few tokens per expert of a decode step."""
    if triton is None:
        raise CodecError("mxfp4_gpu.matmul_many: Triton is not installed")
    G, N, C = x_GNC.shape
    R = packed[0].shape[0]
    if x_GNC.dtype not in (torch.bfloat16, torch.float32) or len(packed) != G or packed[0].shape[1] * 2 != C:
        raise CodecError(f"mxfp4_gpu.matmul_many: x {tuple(x_GNC.shape)} {x_GNC.dtype} does not fit "
                         f"{len(packed)} weights of {tuple(packed[0].shape)} bytes")
    x_GNC = x_GNC.contiguous()
    y = torch.empty(G, N, R, dtype=x_GNC.dtype, device=x_GNC.device)
    p_addr, s_addr = _address_tables(packed, scales, x_GNC.device)
    grid = (triton.cdiv(R, GEMV_ROWS), G)
    _gemv_kernel[grid](x_GNC, p_addr, s_addr, y, R, C=C, N=N, BR=GEMV_ROWS, BB=GEMV_BYTES, GROUP_BYTES=block // 2,
                       num_warps=GEMV_WARPS)
    return y


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int = 32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``mxfp4.dequantize(packed, scales, dtype, block)`` in one kernel (shapes checked by the caller).

    ``packed`` [..., n/2] and ``scales`` [..., n/block] uint8 on one CUDA device (or any device
    under ``TRITON_INTERPRET=1``); returns [..., n] of ``dtype``, written into ``out`` when given
    (a slice of a stacked buffer: no copy).
    """
    if triton is None:
        raise CodecError("mxfp4_gpu.dequantize: Triton is not installed")
    if dtype not in _DTYPES:
        raise CodecError(f"mxfp4_gpu.dequantize: no kernel for {dtype}")
    packed, scales = packed.contiguous(), scales.contiguous()
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    elif out.shape != shape or out.dtype != dtype or not out.is_contiguous() or out.device != packed.device:
        raise CodecError(f"mxfp4_gpu.dequantize: out must be contiguous {dtype} {shape} on {packed.device}")
    n = packed.numel()
    if n:
        kind = _DTYPES.index(dtype)
        words = out.view(torch.int64 if kind == 2 else torch.int32)  # one word per packed byte
        grid = (triton.cdiv(n, BYTES_PER_PROGRAM),)
        _decode_kernel[grid](packed, scales, words, n, BLOCK=BYTES_PER_PROGRAM, GROUP_BYTES=block // 2, OUT=kind,
                             MANY=False, num_warps=NUM_WARPS)
    return out


def _address_tables(packed: list[torch.Tensor], scales: list[torch.Tensor], device) -> torch.Tensor:
    """The tensors' addresses as two int64 rows on ``device`` (one copy), for a kernel's pointer loads."""
    # pinned, so the copy is queued behind the stream's work rather than waiting for it
    addr = torch.tensor([[p.data_ptr() for p in packed], [s.data_ptr() for s in scales]], dtype=torch.int64,
                        pin_memory=torch.device(device).type == "cuda")
    return addr.to(device, non_blocking=True)


def dequantize_many(packed: list[torch.Tensor], scales: list[torch.Tensor], out: torch.Tensor,
                    block: int = 32) -> torch.Tensor:
    """``out[i] = dequantize(packed[i], scales[i])`` for same-shape tensors anywhere on one device,
    in one launch (a group of routed experts decoded into their stacked buffer)."""
    if triton is None:
        raise CodecError("mxfp4_gpu.dequantize_many: Triton is not installed")
    shape = (len(packed), *packed[0].shape[:-1], packed[0].shape[-1] * 2)
    if out.dtype not in _DTYPES or tuple(out.shape) != shape or not out.is_contiguous():
        raise CodecError(f"mxfp4_gpu.dequantize_many: out must be contiguous {shape} of a 16/32-bit float")
    for p, s in zip(packed, scales, strict=True):
        if p.shape != packed[0].shape or s.shape != scales[0].shape or not (p.is_contiguous() and s.is_contiguous()):
            raise CodecError("mxfp4_gpu.dequantize_many: tensors must be contiguous and of one shape")
    n = packed[0].numel()
    if n and packed:
        p_addr, s_addr = _address_tables(packed, scales, out.device)
        kind = _DTYPES.index(out.dtype)
        words = out.view(torch.int64 if kind == 2 else torch.int32)
        grid = (triton.cdiv(n, BYTES_PER_PROGRAM), len(packed))
        _decode_kernel[grid](p_addr, s_addr, words, n, BLOCK=BYTES_PER_PROGRAM, GROUP_BYTES=block // 2, OUT=kind,
                             MANY=True, num_warps=NUM_WARPS)
    return out
