"""FP4 E2M1 element codec: encode/decode 4-bit codes and pack them two per byte.

A code is 4 bits: bit 3 is the sign, bits 0-2 index the magnitude table below.
E2M1 has no Inf and no NaN; its largest magnitude is 6.

Signed zero (same rule as torchao ``_f32_to_floatx_unpacked``): the sign bit of
the code is the sign bit of the input, always. So ``-0.0`` encodes to 0x8, and a
negative value that rounds to zero (e.g. ``-0.1``) also encodes to 0x8; code 0x8
decodes to ``-0.0``.

NaN: ``encode`` maps NaN to magnitude code 0 (sign bit copied from the NaN).
E2M1 cannot carry NaN; block codecs (mxfp4, nvfp4) carry it in the scale instead.
+-Inf saturate to +-6 like every other out-of-range value.
"""

import torch

from k3bundle.errors import CodecError

# Magnitudes of codes 0..7 (bits 0-2: 2 exponent bits, 1 mantissa bit, bias 1).
# Source: OCP Microscaling Formats (MX) v1.0 spec (Sept 2023), section 5.3, element
# data type FP4 E2M1: exponent 00 is subnormal (0, 0.5); max normal 6.0; no Inf/NaN.
# https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SIGN_BIT = 0x8
MAX = 6.0

# All 16 code points, code -> value (code 8 is -0.0).
VALUES = MAGNITUDES + tuple(-m for m in MAGNITUDES)

# Rounding thresholds between neighbouring magnitudes, with round-to-nearest-even:
# a midpoint goes to the neighbour whose code is even (its mantissa bit is 0).
# (midpoint, upper code): |x| moves up to `upper code` when |x| > midpoint, or
# when |x| == midpoint and `upper code` is even.
_THRESHOLDS = tuple(
    ((MAGNITUDES[c - 1] + MAGNITUDES[c]) / 2, c) for c in range(1, len(MAGNITUDES))
)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def encode(x: torch.Tensor) -> torch.Tensor:
    """Round floats to E2M1 codes: nearest, ties to even, saturating to +-6.

    Args:
        x: float tensor (f16, bf16, f32 or f64; comparisons are exact in each
            because every midpoint is a short binary fraction).

    Returns:
        uint8 tensor of the same shape holding codes 0..15 (bit 3 = sign).
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise CodecError(f"e2m1.encode: expected a float tensor, got {x.dtype} {tuple(x.shape)}")
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, upper in _THRESHOLDS:
        moves_up = mag >= midpoint if upper % 2 == 0 else mag > midpoint
        code += moves_up.to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Map E2M1 codes to their exact values.

    Args:
        codes: uint8 tensor of codes 0..15 (higher bits must be zero).
        dtype: float dtype of the result; every E2M1 value is exact in all of them.

    Returns:
        tensor of `dtype`, same shape as `codes`.
    """
    if codes.dtype != torch.uint8:
        raise CodecError(f"e2m1.decode: expected uint8 codes, got {codes.dtype} {tuple(codes.shape)}")
    table = torch.tensor(VALUES, dtype=dtype, device=codes.device)
    return table[(codes & 0xF).long()]


def decode_packed(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode(unpack(packed))`` in one gather: a 256-entry table of (low, high) value pairs.

    Args:
        packed: uint8 [..., m].
        dtype: float dtype of the result.

    Returns:
        tensor of `dtype` [..., 2m]; element 2j decodes the low nibble of byte j.
    """
    if packed.dtype != torch.uint8 or packed.ndim == 0:
        raise CodecError(f"e2m1.decode_packed: expected uint8 [..., m], got {packed.dtype} {tuple(packed.shape)}")
    values = torch.tensor(VALUES, dtype=dtype, device=packed.device)
    byte = torch.arange(256, device=packed.device)
    pairs_256x2 = torch.stack((values[byte & 0xF], values[byte >> 4]), dim=-1)
    # int32 indices (half the bytes of embedding's int64) into the pairs viewed as one word each
    # (a bf16 pair is one int32): one plain word gather, the fastest form on CPU and on an H200
    idx = packed.reshape(-1).to(torch.int32)
    word = {2: torch.int32, 4: torch.int64}.get(pairs_256x2.element_size())
    if word is None:  # f64 pairs: gather rows
        out = pairs_256x2.index_select(0, idx)
    else:
        out = pairs_256x2.view(word).reshape(256).index_select(0, idx).view(dtype)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes two per byte along the last axis: low nibble = even index.

    Args:
        codes: uint8 [..., n] with n even, values 0..15.

    Returns:
        uint8 [..., n/2]; byte j = codes[2j] | codes[2j+1] << 4.
    """
    if codes.dtype != torch.uint8 or codes.ndim == 0 or codes.shape[-1] % 2:
        raise CodecError(
            f"e2m1.pack: expected uint8 [..., even n], got {codes.dtype} {tuple(codes.shape)}"
        )
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`.

    Args:
        packed: uint8 [..., m].

    Returns:
        uint8 [..., 2m] codes; element 2j is the low nibble of byte j.
    """
    if packed.dtype != torch.uint8 or packed.ndim == 0:
        raise CodecError(f"e2m1.unpack: expected uint8 [..., m], got {packed.dtype} {tuple(packed.shape)}")
    pairs = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)
