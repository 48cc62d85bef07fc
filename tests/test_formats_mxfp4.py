"""E2M1 and MXFP4 codecs against oracles that do not use k3bundle code.

Oracles: a scalar E2M1 decoder written from the OCP MX v1.0 bit layout (sign,
2 exponent bits with bias 1, 1 mantissa bit, exponent 0 subnormal); a NumPy
float64 nearest-even rounder; scale rules recomputed with math.frexp; torchao
``to_mx``.

Which MXFP4 byte patterns survive dequantize -> quantize unchanged (proved in
``test_round_trip_bytes``): a block with scale byte s <= 252 whose largest
magnitude code is 6 or 7 (value 4 or 6) round-trips bit-exactly under all three
rules (FLOOR/EVEN read floor(log2 amax) = X + 2; RCEIL sees amax/6 in (2^(X-1), 2^X]).
Any other block with s <= 252 keeps its VALUES under FLOOR (the scale drops by
1-3 and the codes double/quadruple/octuple, which stays on the grid) but not its
bytes; s = 253/254 with a large code overflows f32 and s = 0xFF is NaN.
"""

import math

import numpy as np
import pytest
import torch

from k3bundle.errors import CodecError
from k3bundle.formats import e2m1, mxfp4

RULES = ("floor", "rceil", "even")


def ocp_e2m1(code: int) -> float:
    """Scalar E2M1 decoder from the OCP MX v1.0 bit layout."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return math.copysign(mag, sign)


ORACLE_LUT = np.array([ocp_e2m1(c) for c in range(16)])
MAGS = ORACLE_LUT[:8]


def oracle_encode(y: np.ndarray) -> np.ndarray:
    """Nearest E2M1 code in float64, ties to the even code, saturating, sign kept."""
    y = np.asarray(y, dtype=np.float64)
    a = np.minimum(np.abs(y), 6.0)
    d = np.abs(a[..., None] - MAGS)
    best = d == d.min(-1, keepdims=True)
    prefer_even = best * (1 + (np.arange(8) % 2 == 0))
    code = prefer_even.argmax(-1).astype(np.uint8)
    code = np.where(np.isnan(y), 0, code)
    return code | (np.signbit(y).astype(np.uint8) << 3)


def oracle_exponent(amax: float, rule: str) -> int:
    """Unbiased E8M0 exponent from the rule definitions, via exact math.frexp."""
    if rule == "rceil":
        d = float(np.float32(amax) / np.float32(6.0))  # the f32 division of the rule
        if d == 0:
            return -127
        m, e = math.frexp(d)  # d = m * 2^e, m in [0.5, 1)
        x = e - 1 if m == 0.5 else e
    else:
        if amax == 0:
            return -127
        m, e = math.frexp(amax)
        x = e - 1 - 2 + (1 if rule == "even" and 2 * m >= 1.75 else 0)
    return max(-127, min(127, x))


def oracle_quantize(x: torch.Tensor, rule: str):
    """Reference MXFP4 quantization of finite f32 data, float64 arithmetic."""
    x64 = x.to(torch.float32).double().numpy().reshape(-1, 32)
    exps = np.array([oracle_exponent(float(np.abs(b).max()), rule) for b in x64])
    codes = oracle_encode(x64 * np.ldexp(1.0, -exps)[:, None])
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    lead = x.shape[:-1]
    return (
        torch.from_numpy(packed.reshape(*lead, -1)),
        torch.from_numpy((exps + 127).astype(np.uint8).reshape(*lead, -1)),
    )


def f32_bits(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).view(torch.int32)


# ---- E2M1 element codec -------------------------------------------------------


def test_every_code_decodes_and_reencodes():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1.decode(codes)
    for c in range(16):
        want = ocp_e2m1(c)
        got = float(values[c])
        assert got == want and math.copysign(1, got) == math.copysign(1, want), c
    assert torch.equal(e2m1.encode(values), codes)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(e2m1.encode(e2m1.decode(codes, dtype)), codes)


@pytest.mark.parametrize("mid", [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
def test_ties_go_to_even_code(mid):
    lo = max(c for c in range(8) if MAGS[c] < mid)
    want = lo if lo % 2 == 0 else lo + 1
    assert MAGS[lo] + MAGS[lo + 1] == 2 * mid
    got = e2m1.encode(torch.tensor([mid, -mid]))
    assert got.tolist() == [want, want | 0x8]
    # one f32 ulp either side goes to the nearer neighbour
    below = torch.tensor(mid).nextafter(torch.tensor(0.0))
    above = torch.tensor(mid).nextafter(torch.tensor(10.0))
    assert e2m1.encode(below).item() == lo and e2m1.encode(above).item() == lo + 1


def test_encode_matches_float64_oracle():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(20000, generator=g) * 3
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 8.0, 1e30])
    y = torch.cat([y, ties, -ties, torch.tensor([0.0, -0.0, 1e-40, -1e-40])])
    assert torch.equal(e2m1.encode(y), torch.from_numpy(oracle_encode(y.numpy())))


def test_signed_zero_nan_inf_rule():
    y = torch.tensor([0.0, -0.0, -0.1, 0.1, -0.25, float("inf"), -float("inf"), float("nan")])
    assert e2m1.encode(y).tolist() == [0, 8, 8, 0, 8, 7, 15, 0]
    assert torch.signbit(e2m1.decode(torch.tensor([8], dtype=torch.uint8))).item()


def test_pack_low_nibble_is_even_index():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]], dtype=torch.uint8)
    packed = e2m1.pack(codes)
    assert packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    assert torch.equal(e2m1.unpack(packed), codes)
    with pytest.raises(CodecError, match=r"\(3,\)"):
        e2m1.pack(torch.zeros(3, dtype=torch.uint8))


# ---- MXFP4 dequantize -----------------------------------------------------------


def random_mxfp4(rows, blocks, scale_lo=0, scale_hi=254, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, blocks * 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(scale_lo, scale_hi + 1, (rows, blocks), generator=g, dtype=torch.uint8)
    return packed, scales


def oracle_dequantize(packed, scales) -> np.ndarray:
    p = packed.numpy()
    codes = np.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1)
    vals = ORACLE_LUT[codes].reshape(p.shape[0], -1, 32)
    s = scales.numpy().astype(np.int64)
    with np.errstate(over="ignore"):
        out = vals * np.ldexp(1.0, s - 127)[..., None]
    out[s == 255] = np.nan
    return out.reshape(p.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_exact(dtype):
    packed, scales = random_mxfp4(16, 8, 0, 255)
    got = mxfp4.dequantize(packed, scales, dtype)
    want = torch.from_numpy(oracle_dequantize(packed, scales)).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])
    assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


def test_bf16_dequantize_is_exact_for_every_code_byte_and_scale_byte():
    """bf16 output is computed in bf16: every (byte, scale byte) pair equals the float64 oracle
    rounded once to bf16, subnormal 2^-128, overflow to Inf and the 0xFF NaN blocks included."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 16)  # every byte in every block row
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, packed.shape[1] * 2 // 32).contiguous()
    got = mxfp4.dequantize(packed, scales, torch.bfloat16)
    want = torch.from_numpy(oracle_dequantize(packed, scales)).to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == packed.shape[1] * 2
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int16), want[ok].view(torch.int16))  # bits, signed zeros too
    assert got[ok].isinf().any() and (got[ok].abs() == 2.0**-128).any()


def test_dequantize_scale_byte_0_is_2_pow_minus_127_and_ff_is_nan():
    packed = torch.full((1, 32), 0x11, dtype=torch.uint8)  # every code 1 = 0.5
    out = mxfp4.dequantize(packed, torch.tensor([[0, 255]], dtype=torch.uint8))
    assert (out[0, :32] == 2.0**-128).all() and out[0, 32:].isnan().all()


# ---- MXFP4 quantize ---------------------------------------------------------------


def mixed_blocks(rows=8, blocks=16, seed=0, dtype=torch.float32):
    """N(0,1) blocks at random magnitudes, some made of exact E2M1 ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks, 32, generator=g)
    mag = torch.randint(-30, 30, (rows, blocks, 1), generator=g).float()
    x = x * torch.exp2(mag)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    idx = torch.randint(0, 8, (rows, 4, 32), generator=g)
    sign = torch.randint(0, 2, (rows, 4, 32), generator=g) * 2 - 1
    # with a 4.0 in the block, FLOOR scales by 1, so the ties stay ties
    x[:, :4] = ties[idx] * sign * torch.exp2(mag[:, :4])
    x[:, :4, 0] = 4.0 * torch.exp2(mag[:, :4, 0])
    return x.reshape(rows, blocks * 32).to(dtype)


@pytest.mark.parametrize("rule", RULES)
def test_quantize_matches_oracle(rule):
    x = mixed_blocks()
    packed, scales = mxfp4.quantize(x, rule)
    want_packed, want_scales = oracle_quantize(x, rule)
    assert torch.equal(scales, want_scales)
    assert torch.equal(packed, want_packed)


@pytest.mark.parametrize("rule", RULES)
def test_edge_blocks_match_oracle(rule):
    f32max = torch.finfo(torch.float32).max
    blocks = [
        torch.zeros(32),  # zero block -> scale byte 0
        -torch.zeros(32),  # signed zeros keep their sign bit
        torch.linspace(-3, 3, 32) * 2.0**-130,  # f32 subnormals: exponent clamps at -127
        torch.linspace(-6, 6, 32) * 2.0**-127,  # exactly representable at scale byte 0
        torch.linspace(-5, 5, 32) * 2.0**-126,  # RCEIL: amax/6 is a subnormal above 2^-127
        torch.linspace(-1, 1, 32) * f32max,  # the largest f32 values
        torch.full((32,), 7.9),  # FLOOR: 7.9 / 1 saturates to 6
        torch.tensor([7.0, -6.5] + [1.0] * 30),  # over-range after FLOOR -> +-6
        torch.linspace(-5, 5, 32) * 2.0**100,
    ]
    x = torch.stack(blocks).reshape(1, -1)
    packed, scales = mxfp4.quantize(x, rule)
    want_packed, want_scales = oracle_quantize(x, rule)
    assert torch.equal(scales, want_scales) and torch.equal(packed, want_packed)


def test_floor_edge_values():
    x = torch.stack([torch.zeros(32), torch.full((32,), 7.5), torch.full((32,), 3.4e38)]).reshape(1, -1)
    packed, scales = mxfp4.quantize(x, "floor")
    assert scales.tolist() == [[0, 127, 252]]
    codes = e2m1.unpack(packed).reshape(3, 32)
    assert (codes[0] == 0).all() and (codes[1] == 7).all() and (codes[2] == 7).all()
    out = mxfp4.dequantize(packed, scales).reshape(3, 32)
    assert (out[1] == 6.0).all() and (out[2] == 1.5 * 2.0**127).all()


@pytest.mark.parametrize("rule", RULES)
def test_nan_and_inf_blocks_get_scale_ff(rule):
    x = torch.randn(1, 128)
    x[0, 5] = float("nan")
    x[0, 40] = float("inf")
    x[0, 70] = -float("inf")
    packed, scales = mxfp4.quantize(x, rule)
    assert scales[0, :3].tolist() == [255, 255, 255] and scales[0, 3] != 255
    assert (e2m1.unpack(packed)[0, :96] == 0).all()
    out = mxfp4.dequantize(packed, scales)
    assert out[0, :96].isnan().all() and not out[0, 96:].isnan().any()


def blocks_with_max_code(rows, blocks, seed):
    """Random MXFP4 bytes whose per-block largest magnitude code is 6 or 7."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, blocks, 32), generator=g, dtype=torch.uint8)
    pos = torch.randint(0, 32, (rows, blocks, 1), generator=g)
    top = torch.randint(6, 8, (rows, blocks, 1), generator=g, dtype=torch.uint8)
    top |= torch.randint(0, 2, (rows, blocks, 1), generator=g, dtype=torch.uint8) << 3
    codes.scatter_(-1, pos, top)
    scales = torch.randint(0, 253, (rows, blocks), generator=g, dtype=torch.uint8)
    return e2m1.pack(codes.reshape(rows, -1)), scales


@pytest.mark.parametrize("rule", RULES)
def test_round_trip_bytes(rule):
    packed, scales = blocks_with_max_code(64, 32, seed=3)
    x = mxfp4.dequantize(packed, scales)
    assert torch.isfinite(x).all()
    p2, s2 = mxfp4.quantize(x, rule)
    assert torch.equal(s2, scales) and torch.equal(p2, packed)
    # the same values through bf16 (exact) give the same bytes
    p3, s3 = mxfp4.quantize(x.to(torch.bfloat16), rule)
    assert torch.equal(s3, scales) and torch.equal(p3, packed)


def test_floor_keeps_values_of_any_byte_pattern():
    packed, scales = random_mxfp4(64, 32, 0, 252, seed=4)
    x = mxfp4.dequantize(packed, scales)
    x2 = mxfp4.dequantize(*mxfp4.quantize(x, "floor"))
    assert torch.equal(f32_bits(x2), f32_bits(x))
    # a block whose largest code is 5 (3.0) does not keep its bytes
    codes = torch.full((1, 32), 5, dtype=torch.uint8)
    p, s = mxfp4.quantize(mxfp4.dequantize(e2m1.pack(codes), torch.tensor([[130]], dtype=torch.uint8)))
    assert s.item() == 129 and (e2m1.unpack(p) == 7).all()


def test_f64_input_is_rounded_to_f32_first():
    x = torch.full((1, 32), 4.0, dtype=torch.float64)
    x[0, 1] = 0.25 + 1e-12  # rounds to the tie 0.25 in f32 -> even code 0
    codes = e2m1.unpack(mxfp4.quantize(x)[0])
    assert codes[0, 1].item() == 0


# ---- torchao agreement ------------------------------------------------------------


def torchao_mx(x, rule):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    mode = {"floor": ScaleCalculationMode.FLOOR, "rceil": ScaleCalculationMode.RCEIL,
            "even": ScaleCalculationMode.EVEN}[rule]
    scale, data = to_mx(x, torch.float4_e2m1fn_x2, 32, mode)
    return data.view(torch.uint8), scale.view(torch.uint8)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_agrees_with_torchao(rule, dtype):
    """Bytes equal to torchao to_mx on data whose scale bytes are all >= 1.

    (torchao quantizes scale-byte-0 blocks with a 2^-126 or 1.0 divisor instead of
    2^-127, and with f32 RCEIL input its eager log2 can land one byte low.)
    """
    x = mixed_blocks(rows=32, blocks=16, seed=7, dtype=dtype)
    if rule == "rceil" and dtype == torch.float32:
        x = x.to(torch.bfloat16).to(torch.float32)
    packed, scales = mxfp4.quantize(x, rule)
    t_packed, t_scales = torchao_mx(x, rule)
    assert (scales > 0).all()
    assert torch.equal(scales, t_scales)
    assert torch.equal(packed, t_packed)


def test_torchao_packs_low_nibble_first():
    x = torch.tensor([[0.5, 1.0] + [6.0] * 30])  # FLOOR scale 1: codes 1, 2, 7 ...
    t_packed, t_scales = torchao_mx(x, "floor")
    assert t_scales.item() == 127 and t_packed[0, 0].item() == 0x21


def test_rceil_uses_exact_ceiling_on_f32_input():
    d = 2.0**10 * (1 + 2.0**-23)  # amax / 6, one f32 ulp above 2^10
    x = torch.zeros(1, 32)
    x[0, 0] = float(np.float32(d) * np.float32(6.0))
    want = oracle_exponent(float(x[0, 0]), "rceil") + 127
    assert want == 138
    assert mxfp4.quantize(x, "rceil")[1].item() == want


# ---- validation ---------------------------------------------------------------------


def test_validation_errors_name_shapes():
    with pytest.raises(CodecError, match=r"\(4, 48\)"):
        mxfp4.quantize(torch.zeros(4, 48))
    with pytest.raises(CodecError, match="scale_rule"):
        mxfp4.quantize(torch.zeros(4, 32), "ceil")
    with pytest.raises(CodecError, match="int32"):
        mxfp4.quantize(torch.zeros(4, 32, dtype=torch.int32))
    with pytest.raises(CodecError, match=r"\(4, 16\).*\(4, 2\)"):
        mxfp4.dequantize(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(CodecError, match=r"\(3, 16\).*\(4, 1\)"):
        mxfp4.dequantize(torch.zeros(3, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8))
