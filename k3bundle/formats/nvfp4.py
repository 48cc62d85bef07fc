"""NVFP4 codec: E2M1 elements, an E4M3 scale per 16 elements, one FP32 global scale.

Storage: ``packed`` uint8 [..., n/2] (low nibble = even column, as MXFP4);
``scales`` uint8 [..., n/16] holding torch.float8_e4m3fn bit patterns (view them
with ``scales.view(torch.float8_e4m3fn)``); ``global_scale`` a 0-dim f32 tensor.

``global_scale`` is the DEQUANT multiplier:
``x[..., i] ~= e2m1(code[..., i]) * float(e4m3(scales[..., i // 16])) * global_scale``.
``dequantize`` computes exactly that, in f32: the first product is exact, the
multiply by ``global_scale`` rounds once.

Quantization (torchao ``nvfp4_quantize`` / ModelOpt convention):
``global_scale = fl32(amax / (6 * 448))`` over the finite values (1.0 for an
all-zero tensor); block scale = block_amax / 6 / global_scale, clamped to
[2^-9, 448] and rounded to E4M3 round-to-nearest-even (``scale_round="nearest"``,
torch's cast, as torchao and ModelOpt) or up to the next E4M3 value
(``scale_round="up"``, cuDNN, never saturates). Elements are
x / (scale * global_scale), divided in f64 (exact denominator, one rounding), then
``e2m1.encode`` (nearest-even, saturating, sign bit kept).
An all-zero block gets scale 2^-9 (byte 0x01); torchao uses 2^-6.

NaN/Inf: a 16-block holding a NaN or +-Inf gets the E4M3 NaN byte 0x7F and codes 0;
it dequantizes to NaN. Input is rounded to f32 first (as in mxfp4).
"""

import torch

from k3bundle.errors import CodecError
from k3bundle.formats import e2m1, mxfp4
from k3bundle.formats.geometry import NVFP4_BLOCK as BLOCK

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_NAN = 0x7F
SCALE_ROUNDING = ("nearest", "up")

_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _round_e4m3(ratio: torch.Tensor, scale_round: str) -> torch.Tensor:
    """f64 ratios in [2^-9, 448] -> E4M3 bytes (uint8), nearest-even or up."""
    s_u8 = ratio.to(torch.float8_e4m3fn).view(torch.uint8)
    if scale_round == "up":
        below = s_u8.view(torch.float8_e4m3fn).to(torch.float64) < ratio
        s_u8 = s_u8 + below.to(torch.uint8)  # positive E4M3 bytes are ordered
    return s_u8


def _quantize_blocks(
    x_NB: torch.Tensor, global_scale: float, scale_round: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize finite f32 blocks [..., nb, 16] with a given global scale.

    Returns (codes uint8 [..., nb, 16], scale bytes uint8 [..., nb]).
    """
    x64_NB = x_NB.to(torch.float64)
    ratio_N = (x64_NB.abs().amax(-1) / 6.0 / global_scale).clamp(E4M3_MIN_SUBNORMAL, E4M3_MAX)
    s_u8_N = _round_e4m3(ratio_N, scale_round)
    denom_N = s_u8_N.view(torch.float8_e4m3fn).to(torch.float64) * global_scale
    return e2m1.encode(x64_NB / denom_N[..., None]), s_u8_N


def quantize(
    x: torch.Tensor, scale_round: str = "nearest"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize along the last axis to NVFP4.

    Args:
        x: float tensor [..., n] (bf16/f16/f32/f64), n divisible by 16.
        scale_round: "nearest" (RNE, torchao/ModelOpt) or "up" (cuDNN).

    Returns:
        (packed uint8 [..., n/2], scales uint8 [..., n/16] (E4M3 bits),
        global_scale 0-dim f32 tensor).
    """
    if scale_round not in SCALE_ROUNDING:
        raise CodecError(f"nvfp4.quantize: scale_round {scale_round!r} is not one of {SCALE_ROUNDING}")
    if x.dtype not in _INPUT_DTYPES:
        raise CodecError(f"nvfp4.quantize: dtype {x.dtype} of {tuple(x.shape)} is not a float type")
    if x.ndim == 0 or x.shape[-1] % BLOCK:
        raise CodecError(f"nvfp4.quantize: last dim of {tuple(x.shape)} is not a multiple of {BLOCK}")
    lead, n = x.shape[:-1], x.shape[-1]
    x_NB = x.to(torch.float32).reshape(*lead, n // BLOCK, BLOCK)
    finite_NB = torch.isfinite(x_NB)
    x_NB = torch.where(finite_NB, x_NB, 0.0)

    amax = x_NB.abs().amax() if x_NB.numel() else torch.tensor(0.0)
    global_scale = (amax / (6.0 * E4M3_MAX)).to(torch.float32)
    if amax == 0:
        global_scale = torch.tensor(1.0)
    elif global_scale == 0:  # amax below 2688 * 2^-150: keep it positive
        global_scale = torch.tensor(2.0**-149)

    codes_NB, scales_N = _quantize_blocks(x_NB, float(global_scale), scale_round)
    finite_N = finite_NB.all(-1)
    scales_N = torch.where(finite_N, scales_N, E4M3_NAN).to(torch.uint8)
    codes_NB = torch.where(finite_N[..., None], codes_NB, 0).to(torch.uint8)
    return e2m1.pack(codes_NB.reshape(*lead, n)), scales_N, global_scale.reshape(())


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: "torch.Tensor | float",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 dequantization: (e2m1 * e4m3_scale) * global_scale, in f32.

    Args:
        packed: uint8 [..., n/2].
        scales: uint8 (E4M3 bits) or float8_e4m3fn, [..., n/16].
        global_scale: f32 dequant multiplier (0-dim tensor or float).
        dtype: result dtype (f64 computes in f64).

    Returns:
        tensor of `dtype` [..., n]; blocks with a NaN scale are NaN.
    """
    if scales.dtype == torch.float8_e4m3fn:
        scales = scales.view(torch.uint8)
    mxfp4.check_shapes(packed, scales, BLOCK, "nvfp4.dequantize")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.as_tensor(global_scale, dtype=torch.float32).to(compute)
    lead, nb = scales.shape[:-1], scales.shape[-1]
    vals_NB = e2m1.decode_packed(packed, compute).reshape(*lead, nb, BLOCK)  # one gather, as mxfp4
    scale_N = scales.view(torch.float8_e4m3fn).to(compute)
    return ((vals_NB * scale_N[..., None]) * g).reshape(*lead, nb * BLOCK).to(dtype)


def _e4m3_pow2_byte(k: torch.Tensor) -> torch.Tensor:
    """E4M3 byte of 2^k for integer k in [-9, 8] (subnormal below 2^-6)."""
    normal = (k + 7).clamp(min=1) << 3
    subnormal = torch.ones_like(k) << (k + 9).clamp(0, 2)
    return torch.where(k >= -6, normal, subnormal).to(torch.uint8)


def from_mxfp4(
    packed: torch.Tensor, scales_e8m0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Transcode MXFP4 to NVFP4, keeping E2M1 codes wherever the scale fits.

    An MXFP4 block with exponent e becomes two 16-blocks with E4M3 scale 2^(e - G)
    and global scale 2^G, where G = (largest e over blocks with a nonzero code) - 8,
    so the largest exponents map to 2^8. E4M3 holds 2^-9 .. 2^8 exactly, so a block
    fits when e >= G - 9, i.e. within 17 of the largest exponent. Blocks whose codes
    are all +-0 fit at any exponent; NaN blocks (0xFF) map to the E4M3 NaN byte.
    Fitting blocks keep their codes and dequantize bit-identically (both sides
    compute the same power-of-two products in f32). Blocks that do not fit are
    re-quantized from their dequantized values with ``quantize``'s rule (RNE).

    Args:
        packed: uint8 [..., n/2] MXFP4 codes.
        scales_e8m0: uint8 [..., n/32] E8M0 bytes.

    Returns:
        (packed uint8 [..., n/2], scales uint8 [..., n/16] (E4M3 bits),
        global_scale 0-dim f32 tensor (a power of two),
        bad_blocks bool [..., n/32]: True where the 32-block was re-quantized).
    """
    if scales_e8m0.dtype == getattr(torch, "float8_e8m0fnu", None):  # torch >= 2.7
        scales_e8m0 = scales_e8m0.view(torch.uint8)
    mxfp4.check_shapes(packed, scales_e8m0, mxfp4.BLOCK, "nvfp4.from_mxfp4")
    lead, nb = scales_e8m0.shape[:-1], scales_e8m0.shape[-1]
    codes_NB = e2m1.unpack(packed).reshape(*lead, nb, mxfp4.BLOCK)

    exp_N = scales_e8m0.to(torch.int32) - mxfp4.E8M0_BIAS
    is_nan_N = scales_e8m0 == mxfp4.E8M0_NAN
    nonzero_N = (codes_NB & 0x7).amax(-1) > 0
    live_N = nonzero_N & ~is_nan_N
    top = int(exp_N[live_N].max()) if bool(live_N.any()) else 8
    g_exp = top - 8  # in [-135, 119]: a normal or subnormal f32 power of two
    global_scale = mxfp4.pow2(torch.tensor(g_exp))

    k_N = exp_N - g_exp
    bad_N = live_N & (k_N < -9)
    scales_N = torch.where(is_nan_N, E4M3_NAN, _e4m3_pow2_byte(k_N.clamp(-9, 8)))
    scales_N2 = scales_N.to(torch.uint8)[..., None].expand(*lead, nb, 2)
    codes_N2H = codes_NB.reshape(*lead, nb, 2, BLOCK).clone()
    scales_N2 = scales_N2.clone()

    if bool(bad_N.any()):
        bad_vals = e2m1.decode(codes_NB[bad_N]) * mxfp4.pow2(exp_N[bad_N])[:, None]
        bad_vals = bad_vals.reshape(-1, 2, BLOCK)
        new_codes, new_scales = _quantize_blocks(bad_vals, float(global_scale), "nearest")
        codes_N2H[bad_N] = new_codes
        scales_N2[bad_N] = new_scales

    packed16 = e2m1.pack(codes_N2H.reshape(*lead, nb * mxfp4.BLOCK))
    return packed16, scales_N2.reshape(*lead, nb * 2), global_scale.reshape(()), bad_N


def from_mxfp4_stack(
    packed: torch.Tensor, scales_e8m0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``from_mxfp4`` of each tensor of a stack [T, ...] at once: its own global scale each.

    The same function as calling ``from_mxfp4`` on every ``packed[t], scales_e8m0[t]``
    (tests/test_formats_nvfp4.py checks byte equality), with one pass of tensor operations for the
    whole stack instead of one per tensor: at the release's 82,432 expert tensors of a few KB
    each (the ``full-depth`` scale test), per-call overhead, not bytes, is the cost. Tensors
    with a block to re-quantize (rare: an exponent more than 17 below the tensor's largest)
    are redone alone by ``from_mxfp4``.

    Returns:
        (packed uint8 [T, ..., n/2], scales uint8 [T, ..., n/16], global_scale f32 [T],
        bad_blocks bool [T, ..., n/32]).
    """
    if scales_e8m0.dtype == getattr(torch, "float8_e8m0fnu", None):
        scales_e8m0 = scales_e8m0.view(torch.uint8)
    mxfp4.check_shapes(packed, scales_e8m0, mxfp4.BLOCK, "nvfp4.from_mxfp4_stack")
    if packed.ndim < 2:
        raise CodecError(f"nvfp4.from_mxfp4_stack: expected a stack [T, ..., n/2], got {tuple(packed.shape)}")
    lead, nb = scales_e8m0.shape[:-1], scales_e8m0.shape[-1]
    codes_NB = e2m1.unpack(packed).reshape(*lead, nb, mxfp4.BLOCK)
    exp_N = scales_e8m0.to(torch.int32) - mxfp4.E8M0_BIAS
    is_nan_N = scales_e8m0 == mxfp4.E8M0_NAN
    live_N = ((codes_NB & 0x7).amax(-1) > 0) & ~is_nan_N
    floor = torch.iinfo(torch.int32).min
    top_T = torch.where(live_N, exp_N, floor).reshape(lead[0], -1).amax(-1)
    g_exp_T = torch.where(top_T == floor, 8, top_T) - 8  # no live block: 8, as from_mxfp4
    k_N = exp_N - g_exp_T.reshape(-1, *([1] * (exp_N.ndim - 1)))
    bad_N = live_N & (k_N < -9)
    scales_N = torch.where(is_nan_N, E4M3_NAN, _e4m3_pow2_byte(k_N.clamp(-9, 8))).to(torch.uint8)
    packed16 = packed.clone()  # codes are kept where the scale fits: the same bytes
    scales16 = scales_N[..., None].expand(*lead, nb, 2).reshape(*lead, nb * 2).clone()
    for t in bad_N.reshape(lead[0], -1).any(-1).nonzero().flatten().tolist():
        packed16[t], scales16[t], _, bad_N[t] = from_mxfp4(packed[t], scales_e8m0[t])
    return packed16, scales16, mxfp4.pow2(g_exp_T), bad_N
