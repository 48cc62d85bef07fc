"""FP8 E4M3 (torch.float8_e4m3fn, max 448) weights with f32 dequant multipliers.

Two layouts, both storing the scale as the DEQUANT multiplier (w ~= q * scale):

* per output channel: ``q [..., out, in]``, ``scale f32 [..., out]`` (one per row
  over the last axis), scale = amax / 448, rows of zeros get scale 1.
* 128x128 blocks (DeepSeek-V3 ``weight_scale_inv``): ``scale f32
  [..., ceil(out/128), ceil(in/128)]``; edge blocks are partial.

Quantization divides in f32, clamps to +-448 (torch's cast to e4m3fn does not
saturate on every version), then casts (round-to-nearest-even). A scale that
would underflow to 0 for a nonzero amax is raised to 2^-149. NaN/Inf input
raises CodecError.

Dequantization is ``q.float() * scale`` in f32: the product of a 4-bit and a
24-bit significand is correctly rounded once, i.e. it equals the f64 product
rounded to f32 (the value reference kernels produce); then cast to `dtype`.
For ``dtype=torch.float64`` the product is computed in f64 (exact).
"""

import torch

from k3bundle.errors import CodecError

E4M3_MAX = 448.0
_TINY = 2.0**-149
_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_input(w: torch.Tensor, min_ndim: int, who: str) -> torch.Tensor:
    if w.dtype not in _INPUT_DTYPES or w.ndim < min_ndim:
        raise CodecError(
            f"{who}: expected a float tensor with >= {min_ndim} dims, got {w.dtype} {tuple(w.shape)}"
        )
    w32 = w.to(torch.float32)
    if not bool(torch.isfinite(w32).all()):
        raise CodecError(f"{who}: tensor {tuple(w.shape)} holds NaN or Inf (after rounding to f32)")
    return w32


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    scale = (amax / E4M3_MAX).clamp(min=_TINY)
    return torch.where(amax == 0, 1.0, scale)


def _cast(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel E4M3 quantization.

    Args:
        w: float tensor [..., out, in] (at least 1-D; the scale is per row of the
            last axis).

    Returns:
        (q float8_e4m3fn [..., out, in], scale f32 [..., out]).
    """
    w32 = _check_input(w, 1, "fp8.quantize_channel")
    scale = _scale_from_amax(w32.abs().amax(-1))
    return _cast(w32 / scale[..., None]), scale


def dequantize_channel(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_channel`: q * scale[..., None].

    Args:
        q: float8_e4m3fn [..., out, in].
        scale: f32 [..., out].
        dtype: result dtype.

    Returns:
        tensor of `dtype` [..., out, in].
    """
    if q.dtype != torch.float8_e4m3fn or q.ndim == 0 or scale.shape != q.shape[:-1]:
        raise CodecError(
            f"fp8.dequantize_channel: q {q.dtype} {tuple(q.shape)} and scale {tuple(scale.shape)} "
            "do not fit float8_e4m3fn [..., out, in] and [..., out]"
        )
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(compute) * scale.to(compute)[..., None]).to(dtype)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quantize_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise E4M3 quantization, one scale per block x block tile.

    Args:
        w: float tensor [..., out, in]; out and in need not be multiples of `block`.
        block: tile edge (128 for DeepSeek-V3 style checkpoints).

    Returns:
        (q float8_e4m3fn [..., out, in],
        scale f32 [..., ceil(out/block), ceil(in/block)], the dequant multiplier).
    """
    w32 = _check_input(w, 2, "fp8.quantize_block")
    rows, cols = w32.shape[-2:]
    nr, nc = _ceil_div(rows, block), _ceil_div(cols, block)
    padded = torch.nn.functional.pad(w32, (0, nc * block - cols, 0, nr * block - rows))
    tiles = padded.reshape(*w32.shape[:-2], nr, block, nc, block)
    scale = _scale_from_amax(tiles.abs().amax(dim=(-3, -1)))
    q = _cast(tiles / scale[..., :, None, :, None])
    q = q.reshape(*w32.shape[:-2], nr * block, nc * block)[..., :rows, :cols]
    return q.contiguous(), scale


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block: int = 128) -> torch.Tensor:
    """Broadcast a [..., ceil(rows/block), ceil(cols/block)] scale to [..., rows, cols]."""
    full = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :rows, :cols]


def dequantize_block(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = 128
) -> torch.Tensor:
    """Inverse of `quantize_block`: q * scale of each element's tile.

    Args:
        q: float8_e4m3fn [..., out, in].
        scale: f32 [..., ceil(out/block), ceil(in/block)].
        dtype: result dtype.
        block: tile edge.

    Returns:
        tensor of `dtype` [..., out, in].
    """
    if q.dtype != torch.float8_e4m3fn or q.ndim < 2:
        raise CodecError(
            f"fp8.dequantize_block: q must be float8_e4m3fn [..., out, in], got {q.dtype} {tuple(q.shape)}"
        )
    rows, cols = q.shape[-2:]
    want = (*q.shape[:-2], _ceil_div(rows, block), _ceil_div(cols, block))
    if tuple(scale.shape) != want:
        raise CodecError(
            f"fp8.dequantize_block: scale {tuple(scale.shape)} does not fit q {tuple(q.shape)}; want {want}"
        )
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(compute) * expand_block_scale(scale.to(compute), rows, cols, block)).to(dtype)
