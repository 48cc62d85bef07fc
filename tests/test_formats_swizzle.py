"""128x4 swizzled scale layout: the cuBLAS index formula, torchao, round trips."""

import pytest
import torch

from k3bundle.errors import CodecError
from k3bundle.formats import scale_swizzle

SHAPES = [(128, 4), (256, 8), (130, 5), (1, 1), (300, 17), (7168, 224)]


def random_scales(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (rows, cols), generator=g, dtype=torch.uint8)


def formula_swizzle(scales):
    """Oracle from the cuBLAS layout text: tile-major, (r%32)*16 + (r//32)*4 + c inside."""
    rows, cols = scales.shape
    n_rt, n_ct = -(-rows // 128), -(-cols // 4)
    out = torch.zeros(n_rt * n_ct * 512, dtype=scales.dtype)
    r = torch.arange(rows)[:, None].expand(rows, cols)
    c = torch.arange(cols)[None, :].expand(rows, cols)
    tile = (r // 128) * n_ct + c // 4
    rr, cc = r % 128, c % 4
    out[tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + cc] = scales
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_formula_and_round_trips(shape):
    s = random_scales(*shape)
    flat = scale_swizzle.swizzle(s)
    assert flat.numel() == scale_swizzle.swizzled_size(*shape)
    assert torch.equal(flat, formula_swizzle(s))
    assert torch.equal(scale_swizzle.unswizzle(flat, *shape), s)


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_torchao(shape):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.utils import from_blocked, to_blocked

    s = random_scales(*shape, seed=1)
    flat = scale_swizzle.swizzle(s)
    assert torch.equal(flat, to_blocked(s).flatten())
    assert torch.equal(scale_swizzle.unswizzle(flat, *shape), from_blocked(flat, *shape))
    e8 = s.view(torch.float8_e8m0fnu)
    assert torch.equal(scale_swizzle.swizzle(e8).view(torch.uint8), to_blocked(e8).view(torch.uint8))


def test_padding_is_zero():
    flat = scale_swizzle.swizzle(torch.full((1, 1), 7, dtype=torch.uint8))
    assert flat.numel() == 512 and flat[0] == 7 and (flat[1:] == 0).all()


def test_validation_errors_name_shapes():
    with pytest.raises(CodecError, match=r"\(2, 3, 4\)"):
        scale_swizzle.swizzle(torch.zeros(2, 3, 4, dtype=torch.uint8))
    with pytest.raises(CodecError, match=r"\(100,\).*\[130, 5\]"):
        scale_swizzle.unswizzle(torch.zeros(100, dtype=torch.uint8), 130, 5)


def test_swizzle_stack_is_swizzle_of_each_matrix():
    g = torch.Generator().manual_seed(3)
    for rows, cols in ((32, 2), (128, 4), (200, 9)):
        stack = torch.randint(0, 256, (5, rows, cols), generator=g, dtype=torch.uint8)
        out = scale_swizzle.swizzle_stack(stack)
        assert out.shape == (5, scale_swizzle.swizzled_size(rows, cols))
        for t in range(5):
            assert torch.equal(out[t], scale_swizzle.swizzle(stack[t]))


def test_unswizzle_stack_inverts_swizzle_stack():
    g = torch.Generator().manual_seed(4)
    stack = torch.randint(0, 256, (3, 200, 9), generator=g, dtype=torch.uint8)
    flat = scale_swizzle.swizzle_stack(stack)
    assert torch.equal(scale_swizzle.unswizzle_stack(flat, 200, 9), stack)
    assert torch.equal(scale_swizzle.unswizzle_stack(flat, 200, 9)[1], scale_swizzle.unswizzle(flat[1], 200, 9))
