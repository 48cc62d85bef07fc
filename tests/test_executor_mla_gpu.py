"""The fused MLA prefill kernel (executor/mla_gpu.py) against the readable form and float64.

Oracle: ``mla.attend_naive`` in float64 (the equations M4 as written). The kernel changes only
the summation order and the exponential's last bits, so in FP32 it sits at FP32 rounding of the
float64 result, as the readable FP32 form does; in BF16 it keeps P in FP32 (three exact BF16
parts), so its error is the BF16 output rounding, as the readable BF16 form's. The FP32 path runs
in Triton's CPU interpreter on every machine with Triton (a child process: ``TRITON_INTERPRET`` is
read when kernels are defined); the interpreter's BF16 dot is not a BF16 dot (numpy has no BF16),
so the BF16 path, the one the fast form uses on CUDA, is checked on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from k3bundle.executor import mla, mla_gpu

ROOT = Path(__file__).resolve().parents[1]
triton = pytest.importorskip("triton")

# Triton 3.6's interpreter reads a loop bound that depends on the program id with int() of a
# one-element array, which numpy 2 refuses: the child reads its first element instead.
INTERPRETER_SHIM = """
import triton.runtime.interpreter as _interp
_orig = _interp._patch_lang_tensor
def _patched(tensor, scope):
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
_interp._patch_lang_tensor = _patched
"""

SHAPES = [  # (T, offset, H, E, V, tile config): several query blocks, a prefix, a ragged last tile, E = 2^k
    (40, 0, 2, 48, 16, (16, 16, 4, 1)),
    (37, 21, 3, 32, 32, (32, 16, 4, 1)),
    (20, 5, 1, 16, 16, (16, 16, 4, 1)),
]

CHILD = textwrap.dedent("""
import sys, torch
sys.path.insert(0, {root!r})
{shim}
from k3bundle.executor import mla, mla_gpu
g = torch.Generator().manual_seed(0)
worst = 0.0
for T, off, H, E, V, cfg in {shapes!r}:
    S = off + T
    q, k, v = (torch.randn(n, H, d, generator=g) for n, d in ((T, E), (S, E), (S, V)))
    assert mla_gpu.available(q, V)
    o = mla_gpu.attend(q, k, v, off, E ** -0.5, config=cfg)
    ref = mla.attend_naive(q.double(), k.double(), v.double(), off, E ** -0.5)
    readable = mla.attend_naive(q, k, v, off, E ** -0.5)
    err = ((o.double() - ref).norm() / ref.norm()).item()
    err_readable = ((readable.double() - ref).norm() / ref.norm()).item()
    assert o.dtype == torch.float32 and o.shape == (T, H, V)
    assert err < 1e-6 and err < 4 * err_readable, (T, off, err, err_readable)
    worst = max(worst, err)
via = mla.gated_mla_prefill(q, k, v, torch.zeros(T, H * V), offset=off, scale=E ** -0.5, fast=True)
direct = mla_gpu.attend(q, k, v, off, E ** -0.5)  # the default tiles, as the fast form calls it
assert torch.equal(via, mla.output_gate(direct, torch.zeros(T, H * V)))  # the fast form is the kernel here
print("ok", worst)
""")


def test_kernel_in_the_triton_interpreter_equals_float64_to_fp32_rounding():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    child = CHILD.format(root=str(ROOT), shim=INTERPRETER_SHIM, shapes=SHAPES)
    out = subprocess.run([sys.executable, "-c", child], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


def test_the_kernel_serves_only_cuda_bf16_with_tileable_heads():
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not mla_gpu.available(torch.zeros(4, 2, 192), 128)  # a CPU tensor: attend_blocked
        assert not mla_gpu.available(torch.zeros(4, 2, 192, dtype=torch.bfloat16), 128)
    if torch.cuda.is_available():
        cuda = lambda e, dt=torch.bfloat16: torch.zeros(4, 2, e, dtype=dt, device="cuda")  # noqa: E731
        assert mla_gpu.available(cuda(192), 128)
        assert not mla_gpu.available(cuda(192, torch.float32), 128)  # FP32: attend_blocked (cuBLAS)
        assert mla_gpu.available(cuda(128), 64)  # E = 2^k: one dot
        assert not mla_gpu.available(cuda(192, torch.float64), 128)  # float64: attend_blocked
        assert not mla_gpu.available(cuda(24), 16)  # the tiny preset's 16 + 8: 8 does not tile
        assert not mla_gpu.available(cuda(192), 96)
    assert mla_gpu._head_split(192) == (128, 64) and mla_gpu._head_split(96) == (64, 32)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T,offset,H", [(300, 0, 4), (257, 100, 3), (1, 63, 2), (2048, 0, 8)])
def test_kernel_on_cuda_is_as_exact_as_the_readable_form(T, offset, H):
    """Full-width head dims (128 + 64, values 128), BF16 (the dtype it serves on CUDA). The
    kernel's error against float64 is at most that of the readable form (with a margin for the
    summation order); the fast form is the kernel."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(T + offset)
    S, E, V = offset + T, 192, 128
    q, k, v = (torch.randn(n, H, d, generator=g, dtype=torch.float64) for n, d in ((T, E), (S, E), (S, V)))
    q, k, v = (x.to(dtype).cuda() for x in (q, k, v))
    ref = mla.attend_naive(q.double(), k.double(), v.double(), offset, E ** -0.5)
    got = mla_gpu.attend(q, k, v, offset, E ** -0.5)
    readable = mla.attend_naive(q, k, v, offset, E ** -0.5)
    err = ((got.double() - ref).norm() / ref.norm()).item()
    err_readable = ((readable.double() - ref).norm() / ref.norm()).item()
    assert got.dtype == dtype and got.shape == (T, H, V)
    assert err <= 1.5 * err_readable + 1e-4, (err, err_readable)
    assert err < 5e-3
    assert torch.equal(mla.attend_fast(q, k, v, offset, E ** -0.5), got)


@gpu
@pytest.mark.gpu
def test_kernel_reads_v_as_the_strided_slice_expand_hands_over():
    """``mla.expand`` hands V over as a slice of [k_nope | v] rows: the kernel takes its strides."""
    g = torch.Generator().manual_seed(5)
    T, H = 130, 4
    q = torch.randn(T, H, 192, generator=g).bfloat16().cuda()
    kv = torch.randn(T, H, 128 + 128, generator=g).bfloat16().cuda()
    k = torch.cat([kv[..., :128], torch.randn(T, 1, 64, generator=g).bfloat16().cuda().expand(T, H, 64)], -1)
    v = kv[..., 128:]
    assert not v.is_contiguous()
    a = mla_gpu.attend(q, k, v, 0, 192 ** -0.5)
    b = mla_gpu.attend(q, k.contiguous(), v.contiguous(), 0, 192 ** -0.5)
    assert torch.equal(a, b)
