"""FP8 E4M3 per-channel and 128x128-block codecs against float64 recomputation."""

import numpy as np
import pytest
import torch

from k3bundle.errors import CodecError
from k3bundle.formats import fp8


def weights(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    return w * torch.exp2(torch.randint(-10, 10, (rows, 1), generator=g).float())


def check_e4m3_rounding(q, target64):
    """q is within half an E4M3 step of the f64 target (3 mantissa bits, 2^-9 subnormal step)."""
    q64 = q.to(torch.float64)
    assert not q64.isnan().any() and q64.abs().max() <= 448
    exp = torch.floor(torch.log2(target64.abs()))
    step = torch.where(target64.abs() < 2.0**-6, 2.0**-9, 2.0 ** (exp - 3))
    assert ((q64 - target64.clamp(-448, 448)).abs() <= step / 2 + 1e-12).all()


def test_channel_scales_and_dequant_match_float64():
    w = weights(64, 96, seed=0)
    w[5] = 0.0
    q, scale = fp8.quantize_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64,)
    amax64 = w.double().abs().amax(-1)
    want_scale = torch.where(amax64 == 0, 1.0, amax64 / 448).to(torch.float32)
    assert torch.equal(scale, want_scale)
    assert (q[5].to(torch.float32) == 0).all()
    check_e4m3_rounding(q, w.double() / scale.double()[:, None])
    # dequant: the f64 product (exact) rounded once to f32
    want = (q.to(torch.float64) * scale.to(torch.float64)[:, None]).to(torch.float32)
    got = fp8.dequantize_channel(q, scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(fp8.dequantize_channel(q, scale, torch.bfloat16), want.to(torch.bfloat16))
    rel = ((got - w).norm() / w.norm()).item()
    assert rel < 0.04


def test_channel_row_max_maps_to_448_and_nothing_overflows():
    w = weights(256, 64, seed=1)
    q, scale = fp8.quantize_channel(w)
    q32 = q.to(torch.float32)
    assert not q32.isnan().any()
    assert torch.equal(q32.abs().amax(-1), torch.full((256,), 448.0))


@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (5, 7)])
def test_block_scales_and_dequant_match_float64(shape):
    rows, cols = shape
    w = weights(rows, cols, seed=2)
    q, scale = fp8.quantize_block(w)
    nr, nc = -(-rows // 128), -(-cols // 128)
    assert scale.shape == (nr, nc) and q.shape == shape
    w64 = w.double().numpy()
    want_scale = np.empty((nr, nc))
    for i in range(nr):
        for j in range(nc):
            amax = np.abs(w64[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]).max()
            want_scale[i, j] = 1.0 if amax == 0 else amax / 448
    assert torch.equal(scale, torch.from_numpy(want_scale).to(torch.float32))
    r_idx = torch.arange(rows)[:, None] // 128
    c_idx = torch.arange(cols)[None, :] // 128
    per_elem = scale.double()[r_idx, c_idx]
    check_e4m3_rounding(q, w.double() / per_elem)
    want = (q.to(torch.float64) * per_elem).to(torch.float32)
    got = fp8.dequantize_block(q, scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(fp8.dequantize_block(q, scale, torch.float64), q.to(torch.float64) * per_elem)


def test_block_handles_batch_and_zero_tiles():
    w = torch.zeros(2, 130, 260)
    w[1, :3, :3] = torch.tensor([[448.0, -224.0, 1.5]] * 3) * 2.0**-10  # exact in E4M3 * 2^-10
    q, scale = fp8.quantize_block(w)
    assert scale.shape == (2, 2, 3)
    assert (scale[0] == 1).all() and scale[1, 0, 0] == 2.0**-10
    assert torch.equal(fp8.dequantize_block(q, scale), w)


def test_validation_errors_name_shapes():
    with pytest.raises(CodecError, match=r"\(2, 3\)"):
        fp8.quantize_channel(torch.tensor([[1.0, float("nan"), 0.0]] * 2))
    q, scale = fp8.quantize_block(torch.ones(200, 100))
    with pytest.raises(CodecError, match=r"\(1, 1\).*\(200, 100\)"):
        fp8.dequantize_block(q, scale[:, :1][:1])
    with pytest.raises(CodecError, match=r"\(200, 100\).*\(3,\)"):
        fp8.dequantize_channel(q, torch.ones(3))
