"""The MXFP4 Triton kernel (formats/mxfp4_gpu.py) against the float64 oracle of the OCP MX spec.

Every (code byte, scale byte) pair, bit for bit: on a CUDA device where there is one, and in
Triton's CPU interpreter (a child process: ``TRITON_INTERPRET`` is read when kernels are defined),
so the kernel's arithmetic is checked on every machine that has Triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from k3bundle.formats import mxfp4, mxfp4_gpu
from tests.test_formats_mxfp4 import oracle_dequantize

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton")


def every_pair(device="cpu"):
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 16)  # every byte in every block row
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, packed.shape[1] * 2 // 32).contiguous()
    return packed.to(device), scales.to(device)


def assert_bits_equal_oracle(got: torch.Tensor, packed, scales):
    want = torch.from_numpy(oracle_dequantize(packed.cpu(), scales.cpu())).to(got.dtype)
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == packed.shape[1] * 2
    ok = ~want.isnan()
    word = {2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got[ok].view(word), want[ok].view(word))  # bits: signed zeros, subnormals, Inf


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [{root!r}]
    from k3bundle.formats import mxfp4_gpu
    from tests.test_formats_mxfp4_gpu import every_pair, assert_bits_equal_oracle
    packed, scales = every_pair()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert_bits_equal_oracle(mxfp4_gpu.dequantize(packed, scales, dtype), packed, scales)
    odd = torch.randint(0, 256, (3, 5, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    osc = torch.randint(100, 140, (3, 5, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(mxfp4_gpu.dequantize(odd, osc, torch.bfloat16).view(torch.int16),
                       torch.from_numpy(__import__("tests.test_formats_mxfp4", fromlist=["x"]).oracle_dequantize(
                           odd.reshape(15, 48), osc.reshape(15, 3))).to(torch.bfloat16).reshape(3, 5, 96).view(torch.int16))
    stack = torch.full((2, 15, 96), float("inf"), dtype=torch.bfloat16)  # decoded into a slice: no copy
    got = mxfp4_gpu.dequantize(odd.reshape(15, 48), osc.reshape(15, 3), torch.bfloat16, out=stack[1])
    assert got.data_ptr() == stack[1].data_ptr() and stack[0].isinf().all()
    assert torch.equal(stack[1], mxfp4_gpu.dequantize(odd, osc, torch.bfloat16).reshape(15, 96))
    parts = [torch.randint(0, 256, (4, 32), dtype=torch.uint8) for _ in range(3)]  # one launch, three tensors
    scs = [torch.randint(0, 256, (4, 2), dtype=torch.uint8) for _ in range(3)]
    many = mxfp4_gpu.dequantize_many(parts, scs, torch.empty(3, 4, 64, dtype=torch.float32))
    for i in range(3):
        one = mxfp4_gpu.dequantize(parts[i], scs[i], torch.float32)
        assert torch.equal(many[i].isnan(), one.isnan()) and torch.equal(many[i].nan_to_num(), one.nan_to_num())
    g = torch.Generator().manual_seed(3)  # the fused matmul: weights decoded in registers
    ws = [torch.randint(0, 256, (40, 512), dtype=torch.uint8, generator=g) for _ in range(3)]
    wsc = [torch.randint(118, 124, (40, 32), dtype=torch.uint8, generator=g) for _ in range(3)]
    for dtype, limit in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        x = torch.randn(3, 2, 1024, generator=g).to(dtype)
        y = mxfp4_gpu.matmul_many(x, ws, wsc)
        ref = torch.stack([x[i].double() @ mxfp4_gpu.dequantize(ws[i], wsc[i], torch.float32).double().T
                           for i in range(3)])
        assert y.dtype == dtype and y.shape == (3, 2, 40)
        assert ((y.double() - ref).norm() / ref.norm()).item() < limit
    # a row block and a step that do not divide the shape; 3 and 5 tokens
    ws = [torch.randint(0, 256, (70, 48), dtype=torch.uint8, generator=g) for _ in range(2)]
    wsc = [torch.randint(118, 124, (70, 3), dtype=torch.uint8, generator=g) for _ in range(2)]
    for n in (3, 5):
        x = torch.randn(2, n, 96, generator=g)
        y = mxfp4_gpu.matmul_many(x, ws, wsc)
        ref = torch.stack([x[i].double() @ mxfp4_gpu.dequantize(ws[i], wsc[i], torch.float32).double().T
                           for i in range(2)])
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
    print("ok")
""")


def test_kernel_in_the_triton_interpreter_equals_the_oracle_for_every_byte_and_scale():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT))], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_codec_uses_the_kernel_only_on_cuda_for_16_and_32_bit_floats():
    assert not mxfp4_gpu.available(torch.zeros(2, 16, dtype=torch.uint8), torch.bfloat16)
    if torch.cuda.is_available():
        cuda = torch.zeros(2, 16, dtype=torch.uint8, device="cuda")
        assert mxfp4_gpu.available(cuda, torch.float32) and not mxfp4_gpu.available(cuda, torch.float64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_on_cuda_equals_the_oracle_for_every_byte_and_scale(dtype):
    packed, scales = every_pair("cuda")
    assert_bits_equal_oracle(mxfp4.dequantize(packed, scales, dtype), packed, scales)  # the codec's GPU path
    halves = [packed[:128], packed[128:]]  # the stacked form: one launch for both halves
    stack = mxfp4.dequantize_stack(halves, [scales[:128], scales[128:]],
                                   torch.empty(2, 128, packed.shape[1] * 2, dtype=dtype, device="cuda"))
    assert_bits_equal_oracle(stack.reshape(256, -1), packed, scales)
    # rows of the release's expert width; > 2^31 output elements, so offsets must be 64-bit
    big_p = torch.randint(0, 256, (600_000, 1792), dtype=torch.uint8, device="cuda")
    big_s = torch.randint(110, 130, (600_000, 112), dtype=torch.uint8, device="cuda")
    got = mxfp4_gpu.dequantize(big_p, big_s, dtype)
    rows = torch.from_numpy(np.r_[np.random.default_rng(0).integers(0, 600_000, 62), 0, 599_999]).cuda()
    flat_p, flat_s = big_p[rows], big_s[rows]
    want = torch.from_numpy(oracle_dequantize(flat_p.cpu(), flat_s.cpu())).to(dtype)
    word = {2: torch.int16, 4: torch.int32}[want.element_size()]
    assert torch.equal(got.reshape(-1, 3584)[rows].cpu().view(word), want.view(word))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_step_experts_read_mxfp4_directly_and_match_the_readable_form(dtype):
    """A decode step's experts (few tokens each) go through the fused matmul: the same E_i(z) as
    the readable form's decode-then-GEMM, to the GEMMs' summation order."""
    from k3bundle.executor import latent_moe
    from k3bundle.ops.expert_weight import ExpertWeight

    g = torch.Generator(device="cuda").manual_seed(0)
    L, I, E, T, K = 3584, 3072, 24, 2, 8
    parts = {e: {r: (torch.randint(0, 256, (rows, cols // 2), generator=g, device="cuda", dtype=torch.uint8),
                     torch.randint(119, 122, (rows, cols // 32), generator=g, device="cuda", dtype=torch.uint8))
                 for r, (rows, cols) in (("moe.expert.w1", (I, L)), ("moe.expert.w3", (I, L)), ("moe.expert.w2", (L, I)))}
             for e in range(E)}
    stored = lambda e: {r: ExpertWeight(lambda p=p, s=s: mxfp4.dequantize(p, s, dtype), (p, s))  # noqa: E731
                        for r, (p, s) in parts[e].items()}
    z = torch.randn(T, L, generator=g, device="cuda").to(dtype)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, device="cuda")
    fast = latent_moe.routed_grouped(z, ids, w, stored, 4.0, 25.0)
    readable = latent_moe.routed(z, ids, w, lambda e: {r: v.value() for r, v in stored(e).items()}, 4.0, 25.0)
    exact = latent_moe.routed(z.double(), ids, w.double(), lambda e: {r: mxfp4.dequantize(p, s, torch.float64)
                                                                        for r, (p, s) in parts[e].items()}, 4.0, 25.0)
    err = lambda a: ((a.double() - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err(fast) <= 2 * err(readable) + 1e-6, (err(fast), err(readable))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_fused_matmul_on_cuda_is_as_exact_as_decode_then_gemm(dtype, n):
    """A decode step's token counts, against float64 of the codec's values: within 1.5x the
    readable decode-then-bmm's error; a NaN block poisons only its row."""
    g = torch.Generator(device="cuda").manual_seed(n)
    R, C, G = 3072 + 40, 3584, 3
    ws = [torch.randint(0, 256, (R, C // 2), generator=g, device="cuda", dtype=torch.uint8) for _ in range(G)]
    wsc = [torch.randint(116, 126, (R, C // 32), generator=g, device="cuda", dtype=torch.uint8) for _ in range(G)]
    wsc[1][7, 5] = 255
    x = torch.randn(G, n, C, generator=g, device="cuda").to(dtype)
    y = mxfp4.matmul_stack(x, ws, wsc)
    w = [mxfp4.dequantize(p, s, dtype) for p, s in zip(ws, wsc)]
    readable = torch.stack([x[i] @ w[i].T for i in range(G)])
    exact = torch.stack([x[i].double() @ w[i].double().T for i in range(G)])
    assert torch.equal(y.isnan(), exact.isnan()) and y[1, :, 7].isnan().all() and y.isnan().sum() == n
    ok = ~exact.isnan()
    err = lambda a: ((a[ok].double() - exact[ok]).norm() / exact[ok].norm()).item()  # noqa: E731
    assert err(y) <= 1.5 * err(readable) + 1e-7, (err(y), err(readable))
