"""NVFP4 codec and the MXFP4 -> NVFP4 transcode, against independent oracles.

Oracles: scalar E2M1 and E4M3 decoders written from the bit layouts (E2M1: OCP
MX v1.0; E4M3: OCP FP8 / torch.float8_e4m3fn, bias 7, no Inf, 0x7F/0xFF NaN),
float64 recomputation of every scale and element, and an MXFP4 dequantizer.
"""

import math

import numpy as np
import pytest
import torch

from k3bundle.errors import CodecError
from k3bundle.formats import e2m1, mxfp4, nvfp4


def ocp_e2m1(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return math.copysign(mag, sign)


def ocp_e4m3(byte: int) -> float:
    if byte & 0x7F == 0x7F:
        return float("nan")
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    mag = man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return sign * mag


E2M1 = np.array([ocp_e2m1(c) for c in range(16)])
E4M3 = np.array([ocp_e4m3(b) for b in range(256)])
E4M3_POS = np.arange(1, 0x7F)  # positive finite nonzero bytes, increasing values


def oracle_encode(y: np.ndarray) -> np.ndarray:
    a = np.minimum(np.abs(y), 6.0)
    d = np.abs(a[..., None] - E2M1[:8])
    best = d == d.min(-1, keepdims=True)
    code = (best * (1 + (np.arange(8) % 2 == 0))).argmax(-1).astype(np.uint8)
    return code | (np.signbit(y).astype(np.uint8) << 3)


def oracle_e4m3_byte(r: float, up: bool) -> int:
    vals = E4M3[E4M3_POS]
    if up:
        return int(E4M3_POS[np.argmax(vals >= r)])
    d = np.abs(vals - r)
    best = np.flatnonzero(d == d.min())
    even = [b for b in E4M3_POS[best] if b % 2 == 0]
    return int(even[0] if even else E4M3_POS[best][0])


def oracle_dequantize(packed, scales, g) -> torch.Tensor:
    p = packed.numpy().reshape(-1, packed.shape[-1])
    codes = np.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1, 16)
    s = E4M3[scales.numpy().reshape(p.shape[0], -1)]
    out = E2M1[codes] * s[..., None] * float(g)  # exact in float64
    return torch.from_numpy(out).reshape(*packed.shape[:-1], -1).to(torch.float32)


def codes_of(packed):
    return e2m1.unpack(packed)


@pytest.mark.parametrize("scale_round", ["nearest", "up"])
def test_quantize_matches_float64_oracle(scale_round):
    g_ = torch.Generator().manual_seed(0)
    x = torch.randn(8, 256, generator=g_) * torch.exp2(torch.randint(-8, 8, (8, 1), generator=g_).float())
    packed, scales, g = nvfp4.quantize(x, scale_round)
    assert g.dtype == torch.float32 and g.shape == ()
    assert float(g) == float(np.float32(np.float32(x.abs().max()) / np.float32(2688.0)))

    x64 = x.double().numpy().reshape(-1, 16)
    want_scales = [
        oracle_e4m3_byte(min(max(np.abs(b).max() / 6 / float(g), 2.0**-9), 448.0), scale_round == "up")
        for b in x64
    ]
    assert scales.flatten().tolist() == want_scales
    denom = E4M3[np.array(want_scales)] * float(g)
    want_codes = oracle_encode(x64 / denom[:, None]).reshape(8, 256)
    assert torch.equal(codes_of(packed), torch.from_numpy(want_codes))


def test_dequantize_exact():
    g_ = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (4, 64), generator=g_, dtype=torch.uint8)
    scales = torch.randint(0, 0x7F, (4, 8), generator=g_, dtype=torch.uint8)
    g = torch.tensor(0.0123, dtype=torch.float32)
    got = nvfp4.dequantize(packed, scales, g)
    assert torch.equal(got.view(torch.int32), oracle_dequantize(packed, scales, g).view(torch.int32))
    got_f8 = nvfp4.dequantize(packed, scales.view(torch.float8_e4m3fn), float(g), torch.bfloat16)
    assert torch.equal(got_f8, got.to(torch.bfloat16))


def test_error_on_gaussian_is_at_the_known_floor():
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(2))
    out = nvfp4.dequantize(*nvfp4.quantize(x)).double()
    rel_rmse = ((out - x.double()).norm() / x.double().norm()).item()
    assert 0.09 < rel_rmse < 0.10, rel_rmse


def test_zero_tensor_and_nan_blocks():
    packed, scales, g = nvfp4.quantize(torch.zeros(2, 32))
    assert float(g) == 1.0 and (scales == 0x01).all() and (packed == 0).all()
    x = torch.randn(2, 48)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    packed, scales, g = nvfp4.quantize(x)
    assert scales[0, 0] == 0x7F and scales[1, 2] == 0x7F and (scales[:, 1] != 0x7F).all()
    finite = x[torch.isfinite(x)]
    assert float(g) == float(finite.abs().max() / 2688.0)
    out = nvfp4.dequantize(packed, scales, g)
    assert out[0, :16].isnan().all() and out[1, 32:].isnan().all()
    assert not out[0, 16:].isnan().any() and not out[1, :32].isnan().any()


def test_largest_block_uses_scale_448():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    packed, scales, g = nvfp4.quantize(x)
    row, col = divmod(int(x.abs().argmax()), 64)
    assert scales[row, col // 16].item() == 0x7E  # 448
    assert (codes_of(packed)[row, col] & 0x7).item() == 7


# ---- MXFP4 -> NVFP4 -------------------------------------------------------------


def random_mxfp4(rows, blocks, exp_lo, exp_hi, seed):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, blocks * 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(exp_lo + 127, exp_hi + 128, (rows, blocks), generator=g, dtype=torch.uint8)
    return packed, scales


def bits(t):
    return t.view(torch.int32)


@pytest.mark.parametrize("exp_lo,exp_hi", [(-20, -3), (-127, -110), (-127, -120), (100, 117), (0, 0)])
def test_from_mxfp4_lossless_in_range(exp_lo, exp_hi):
    packed, scales = random_mxfp4(16, 24, exp_lo, exp_hi, seed=exp_lo & 0xFF)
    p16, s16, g, bad = nvfp4.from_mxfp4(packed, scales)
    assert bad.shape == scales.shape and not bad.any()
    assert torch.equal(p16, packed)  # element codes copied unchanged
    top = int(scales.max()) - 127
    assert float(g) == 2.0 ** (top - 8)
    assert s16.shape == (16, 48)
    want = mxfp4.dequantize(packed, scales)
    assert torch.equal(bits(nvfp4.dequantize(p16, s16, g)), bits(want))


def test_from_mxfp4_wide_spread_reports_exactly_the_bad_blocks():
    packed, scales = random_mxfp4(8, 32, -40, 20, seed=5)
    codes = e2m1.unpack(packed).reshape(8, 32, 32)
    codes[0, 0] = 0  # an all-zero block at the smallest exponent still fits
    codes[0, 1] = 0x8
    scales[0, :2] = 127 - 40
    codes[1, 0, 0] = 0x7  # make sure the top exponent block is nonzero
    scales[1, 0] = 127 + 20
    scales[2, 5] = 255  # a NaN block
    packed = e2m1.pack(codes.reshape(8, -1))

    p16, s16, g, bad = nvfp4.from_mxfp4(packed, scales)
    assert float(g) == 2.0 ** (20 - 8)
    exps = scales.int() - 127
    nonzero = (codes & 0x7).amax(-1) > 0
    want_bad = nonzero & (exps < 20 - 17) & (scales != 255)
    assert torch.equal(bad, want_bad) and 0 < int(bad.sum()) < bad.numel()

    src = mxfp4.dequantize(packed, scales).reshape(8, 32, 32)
    out = nvfp4.dequantize(p16, s16, g).reshape(8, 32, 32)
    keep = ~bad
    same_codes = e2m1.unpack(p16).reshape(8, 32, 32)[keep] == codes[keep]
    assert same_codes.all()
    assert torch.equal(out[keep].isnan(), src[keep].isnan())
    fin = ~src[keep].isnan()
    assert torch.equal(bits(out[keep][fin]), bits(src[keep][fin]))
    # re-quantized blocks: within half an E2M1 step at the smallest E4M3 scale
    err = (out[bad].double() - src[bad].double()).abs().max().item()
    assert err <= 0.5 * 2.0**-9 * float(g)


def test_from_mxfp4_nan_block_maps_to_e4m3_nan():
    packed = torch.full((1, 32), 0x77, dtype=torch.uint8)
    scales = torch.tensor([[255, 130]], dtype=torch.uint8)
    p16, s16, g, bad = nvfp4.from_mxfp4(packed, scales)
    assert s16[0, :2].tolist() == [0x7F, 0x7F] and not bad.any()
    out = nvfp4.dequantize(p16, s16, g)
    assert out[0, :32].isnan().all() and (out[0, 32:] == 6 * 8.0).all()


def test_validation_errors_name_shapes():
    with pytest.raises(CodecError, match=r"\(2, 24\)"):
        nvfp4.quantize(torch.zeros(2, 24))
    with pytest.raises(CodecError, match=r"\(2, 8\).*\(2, 2\)"):
        nvfp4.dequantize(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), 1.0)
    with pytest.raises(CodecError, match=r"\(2, 16\).*\(2, 2\)"):
        nvfp4.from_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))


def test_from_mxfp4_stack_equals_from_mxfp4_on_each_tensor():
    """The batched transcode (convert's path for many small experts) gives each tensor's own
    from_mxfp4 bytes: per-tensor global scales, a NaN block, an all-zero tensor and a tensor
    with blocks to re-quantize among lossless ones."""
    stack = [random_mxfp4(8, 32, lo, hi, seed=i) for i, (lo, hi) in
             enumerate([(-20, -3), (-127, -110), (100, 117), (-40, 20), (0, 0)])]
    packed = torch.stack([p for p, _ in stack])
    scales = torch.stack([s for _, s in stack])
    scales[1, 2, 5] = 255  # a NaN block
    packed[4] = 0  # no live block: global exponent as from_mxfp4's default
    p16, s16, g, bad = nvfp4.from_mxfp4_stack(packed, scales)
    assert bad[3].any() and not bad[0].any()  # the wide-spread tensor has re-quantized blocks
    for t in range(len(stack)):
        want = nvfp4.from_mxfp4(packed[t], scales[t])
        assert torch.equal(p16[t], want[0]) and torch.equal(s16[t], want[1])
        assert torch.equal(bits(g[t]), bits(want[2])) and torch.equal(bad[t], want[3])
