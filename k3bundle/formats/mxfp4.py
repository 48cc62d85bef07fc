"""MXFP4 codec: OCP MX v1.0 blocks of 32 E2M1 elements sharing one E8M0 scale.

Storage (compressed-tensors "mxfp4-pack-quantized", also torchao ``to_mx``):
``packed`` uint8 [..., n/2], two E2M1 codes per byte, low nibble = even column;
``scales`` uint8 [..., n/32], E8M0 byte s meaning 2^(s-127). Byte 0 is 2^-127
(E8M0 has no zero); byte 0xFF is NaN.

Value: ``W[..., i] = e2m1(code[..., i]) * 2^(scales[..., i // 32] - 127)``.

Scale rules (``quantize(scale_rule=...)``), all producing an unbiased exponent X,
clamped to [-127, 127], stored as X + 127. ``amax`` is the block's max |x| in f32.

* ``"floor"`` (OCP MX v1.0 section 6.3, torchao FLOOR): X = floor(log2(amax)) - 2,
  read from the f32 exponent field (so a subnormal or zero amax gives X = -127).
  The block max lands in [4, 8); values in (6, 8) saturate to 6.
* ``"even"`` (torchao EVEN, = compressed-tensors ``generate_mxfp4_scales``): first
  round amax to 1 mantissa bit, half up, by adding 2^21 to its f32 bit pattern and
  clearing the mantissa; then as FLOOR. I.e. X = floor(log2 amax) - 2, plus 1 when
  the mantissa of amax is >= 0.75.
* ``"rceil"`` (cuBLAS / torchao RCEIL, PTX ``cvt.rp.ue8m0``): d = fl32(amax / 6);
  X = the exponent of the smallest power of two >= d (d <= 2^-127, including 0,
  gives -127). Never saturates except where the f32 division rounded d down.

Elements are then ``x * 2^-X`` (exact: a power-of-two multiply), rounded to E2M1
by ``e2m1.encode`` (nearest, ties to even, saturate to +-6, sign bit kept, so -0.0
and small negatives give code 0x8).

NaN/Inf: a block holding any NaN or +-Inf gets scale 0xFF and all codes 0;
``dequantize`` returns NaN for the whole block. (torchao differs for Inf: FLOOR
and EVEN give scale 253, RCEIL 254, with the Inf saturated to code 7.)

Known differences from torchao 0.18 ``to_mx`` on finite input, all at its edges:
blocks whose scale byte is 0 (amax < 2^-124): torchao divides by 2^-126 instead of
2^-127 (FLOOR/EVEN) or by 1.0 (RCEIL), so its codes there are not the OCP value;
and RCEIL with f32 input: torchao's eager path computes ceil(log2(d)) in f32, which
rounds d = 2^k * (1 + tiny) down to k, one scale byte below the exact rule.

Input dtypes: bf16, f16, f32 and f64; everything is computed in f32, so f64 input
is first rounded to f32 (which can move a value onto or off an E2M1 tie).
"""

import torch

from k3bundle.errors import CodecError
from k3bundle.formats import e2m1, mxfp4_gpu
from k3bundle.formats.geometry import MXFP4_BLOCK as BLOCK
from k3bundle.formats.geometry import MXFP4_SCALE_RULES as SCALE_RULES

E8M0_BIAS = 127
E8M0_NAN = 0xFF

_E2M1_EMAX = 2  # floor(log2(6)): the largest power of two in E2M1
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def pow2(exponent: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Exact 2^k built from bits (no exp2/pow rounding), including f32 subnormals.

    Args:
        exponent: integer tensor; k in [-149, 127] for f32, [-1022, 1023] for f64.
        dtype: torch.float32 or torch.float64.

    Returns:
        tensor of `dtype`, same shape as `exponent`.
    """
    if dtype == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    k = exponent.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def _shared_exponent(amax: torch.Tensor, scale_rule: str) -> torch.Tensor:
    """Unbiased block exponent X (int32, clamped to [-127, 127]) from f32 amax >= 0."""
    bits = amax.view(torch.int32)
    if scale_rule == "rceil":
        d_bits = (amax / 6.0).view(torch.int32)
        biased, mantissa = d_bits >> 23, d_bits & 0x7FFFFF
        normal_x = biased - E8M0_BIAS + (mantissa != 0).to(torch.int32)
        # subnormal d = mantissa * 2^-149: above 2^-127 exactly when mantissa > 2^22
        subnormal_x = torch.where(mantissa > (1 << 22), -126, -127).to(torch.int32)
        x = torch.where(biased > 0, normal_x, subnormal_x)
    else:
        if scale_rule == "even":
            bits = (bits + (1 << 21)) & 0x7F800000
        x = ((bits >> 23) & 0xFF) - E8M0_BIAS - _E2M1_EMAX
    return x.clamp(-E8M0_BIAS, E8M0_BIAS)


def quantize(
    x: torch.Tensor, scale_rule: str = "floor", block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last axis to MXFP4 bytes.

    Args:
        x: float tensor [..., n] (bf16/f16/f32/f64), n divisible by `block`.
        scale_rule: "floor" (OCP), "rceil" (cuBLAS) or "even" (compressed-tensors).
        block: elements per shared scale (32 for MXFP4).

    Returns:
        (packed uint8 [..., n/2], scales uint8 [..., n/block]).
    """
    if scale_rule not in SCALE_RULES:
        raise CodecError(f"mxfp4.quantize: scale_rule {scale_rule!r} is not one of {SCALE_RULES}")
    if x.dtype not in _INPUT_DTYPES:
        raise CodecError(f"mxfp4.quantize: dtype {x.dtype} of {tuple(x.shape)} is not a float type")
    if block <= 0 or block % 2 or x.ndim == 0 or x.shape[-1] % block:
        raise CodecError(f"mxfp4.quantize: last dim of {tuple(x.shape)} is not a multiple of block {block}")
    lead, n = x.shape[:-1], x.shape[-1]
    x_NB = x.to(torch.float32).reshape(*lead, n // block, block)

    finite_N = torch.isfinite(x_NB).all(-1)
    amax_N = torch.where(finite_N, x_NB.abs().amax(-1), 0.0)
    exp_N = _shared_exponent(amax_N, scale_rule)

    y_NB = x_NB * pow2(-exp_N)[..., None]
    y_NB = torch.where(finite_N[..., None], y_NB, 0.0)
    codes = e2m1.encode(y_NB).reshape(*lead, n)

    scales = torch.where(finite_N, exp_N + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    return e2m1.pack(codes), scales


def check_shapes(packed: torch.Tensor, scales: torch.Tensor, block: int, who: str) -> None:
    """Raise CodecError unless packed [..., n/2] and scales [..., n/block] agree."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CodecError(f"{who}: packed {packed.dtype} and scales {scales.dtype} must both be uint8")
    if (
        packed.ndim == 0
        or packed.shape[:-1] != scales.shape[:-1]
        or packed.shape[-1] * 2 != scales.shape[-1] * block
    ):
        raise CodecError(
            f"{who}: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} "
            f"do not fit [..., n/2] and [..., n/{block}]"
        )


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    block: int = BLOCK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact MXFP4 dequantization.

    Computed in f32 (f64 when `dtype` is f64, bf16 when it is bf16), where every
    product code * 2^X is exact or overflows to +-Inf (scale bytes >= 253 with large
    codes), then cast; the bf16 result equals the f32 one cast to bf16, bit for bit.

    Args:
        packed: uint8 [..., n/2].
        scales: uint8 [..., n/block] E8M0 bytes (float8_e8m0fnu is accepted too).
        dtype: result dtype.
        block: elements per scale (32 for MXFP4).
        out: optional contiguous tensor of `dtype` [..., n] to write into (e.g. a slice of a stack).

    Returns:
        tensor of `dtype` [..., n] (``out`` when given); blocks with scale 0xFF are all NaN.
    """
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):  # torch >= 2.7
        scales = scales.view(torch.uint8)
    check_shapes(packed, scales, block, "mxfp4.dequantize")
    if mxfp4_gpu.available(packed, dtype):  # the same arithmetic as one CUDA kernel (bit-identical)
        return mxfp4_gpu.dequantize(packed, scales, dtype, block, out=out)
    values = dequantize_torch(packed, scales, dtype, block)
    return values if out is None else out.copy_(values)


def dequantize_stack(packed: list[torch.Tensor], scales: list[torch.Tensor], out: torch.Tensor,
                     block: int = BLOCK) -> torch.Tensor:
    """``out[i] = dequantize(packed[i], scales[i], out.dtype)`` for tensors of one shape: on CUDA one
    kernel launch for the lot (``mxfp4_gpu.dequantize_many``), elsewhere one call each."""
    for p, s in zip(packed, scales, strict=True):
        check_shapes(p, s, block, "mxfp4.dequantize_stack")
    if packed and mxfp4_gpu.available(packed[0], out.dtype) and all(p.device == out.device for p in packed):
        return mxfp4_gpu.dequantize_many([p.contiguous() for p in packed], [s.contiguous() for s in scales], out, block)
    for i, (p, s) in enumerate(zip(packed, scales)):
        dequantize(p, s, out.dtype, block, out=out[i])
    return out


def matmul_available(x: torch.Tensor, stored: list) -> bool:
    """True where ``matmul_stack`` runs as one kernel: CUDA, Triton, BF16/F32 x, every weight's
    stored (packed, scales) on x's device, all of one shape."""
    return (mxfp4_gpu.available(x, torch.float32) and x.dtype in (torch.bfloat16, torch.float32)
            and all(s is not None and s[0].device == x.device and s[0].shape == stored[0][0].shape
                    and s[0].is_contiguous() and s[1].is_contiguous() for s in stored))


def matmul_stack(x_GNC: torch.Tensor, packed: list[torch.Tensor], scales: list[torch.Tensor],
                 block: int = BLOCK) -> torch.Tensor:
    """``x[g] @ dequantize(packed[g], scales[g]).T`` for each g, [G, N, C] -> [G, N, R] in x's dtype,
    the weights decoded in registers by the CUDA kernel (``mxfp4_gpu.matmul_many``): the decoded
    values are the codec's exactly; the sums are FP32, as a BF16 GEMM's."""
    return mxfp4_gpu.matmul_many(x_GNC, packed, scales, block)


def dequantize_torch(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block: int = BLOCK) -> torch.Tensor:
    """``dequantize`` in torch ops on any device (shapes checked by the caller): the portable form,
    and on CUDA the baseline of the Triton kernel (``bench/mxfp4_decode.py``)."""
    # bf16 output is computed in bf16: every code (<= 2 significant bits) and every 2^X (X in
    # [-127, 127], 2^-127 a bf16 subnormal) is exact in bf16, and a bf16 product is the exact
    # f32 product rounded once, as the f32 path then cast; half the bytes moved per pass
    compute = {torch.float64: torch.float64, torch.bfloat16: torch.bfloat16}.get(dtype, torch.float32)
    lead, nb = scales.shape[:-1], scales.shape[-1]
    vals_NB = e2m1.decode_packed(packed, compute).reshape(*lead, nb, block)
    factor_N = pow2(scales.to(torch.int32) - E8M0_BIAS, torch.float64 if compute == torch.float64
                    else torch.float32).to(compute)
    factor_N = torch.where(scales == E8M0_NAN, float("nan"), factor_N)
    return (vals_NB * factor_N[..., None]).reshape(*lead, nb * block).to(dtype)
