"""KDA's delta rule (K5) against fla-core's naive reference functions, and chunked == recurrent.

Oracle: ``fla/ops/kda/naive.py`` of fla-core (``naive_recurrent_kda``, ``naive_chunk_kda``),
loaded as a plain file: importing ``fla.ops`` pulls in triton, which CPU machines lack.
Those functions compute in ``torch.float`` (float32); to compare at float64 precision the
file is loaded against a torch proxy whose ``float`` is float64 (nothing else changes).

Argument mapping (fla -> spec K2-K5): q, k are the L2-normalised q̃, k̃ *before* the
d^(-1/2) scale (fla applies ``scale``, default K^-0.5 = d^(-1/2)); g is log α (log-space,
per key channel); beta is β; state is [B, H, K, V], key channels on rows — the executor's
S[h] = [dk, dv] layout, so states compare without a transpose.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
import torch

from k3bundle.executor import kda


def _load_fla_naive():
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed (it is in the test extras: pip install -e .[test])")
    path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
    if not path.is_file():
        pytest.skip(f"fla-core has no {path}")
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive_f64", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    # run the oracle in float64: its only dtype choice is ``torch.float``
    proxy = types.ModuleType("torch_f64")
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.float = torch.float64
    mod.torch = proxy
    return mod


@pytest.fixture(scope="module")
def fla():
    return _load_fla_naive()


def _inputs(T, H=4, K=16, V=16, seed=0, dtype=torch.float64, lower=-5.0):
    g = torch.Generator().manual_seed(seed)
    qn = torch.randn(T, H, K, generator=g, dtype=dtype)
    kn = torch.randn(T, H, K, generator=g, dtype=dtype)
    qn = qn / torch.sqrt(qn.pow(2).sum(-1, keepdim=True) + 1e-6)  # K2 L2 norm (unscaled)
    kn = kn / torch.sqrt(kn.pow(2).sum(-1, keepdim=True) + 1e-6)
    v = torch.randn(T, H, V, generator=g, dtype=dtype)
    # K3 gate: log α in (-5, 0), spread so some channels forget fast and some barely
    gate = lower * torch.sigmoid(2 * torch.randn(T, H, K, generator=g, dtype=dtype) - 1)
    beta = torch.sigmoid(torch.randn(T, H, generator=g, dtype=dtype))
    S0 = torch.randn(H, K, V, generator=g, dtype=dtype)
    return qn, kn, v, gate, beta, S0


def _fla_call(fn, qn, kn, v, gate, beta, S0, **kw):
    o, S = fn(qn[None], kn[None], v[None], gate[None], beta[None], scale=qn.shape[-1] ** -0.5,
              initial_state=None if S0 is None else S0[None], output_final_state=True, **kw)
    return o[0], S[0]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_kda_matches_fla_naive_recurrent(fla, with_state, form):
    qn, kn, v, gate, beta, S0 = _inputs(T=150, seed=1)
    S0 = S0 if with_state else torch.zeros_like(S0)
    o_ref, S_ref = _fla_call(fla.naive_recurrent_kda, qn, kn, v, gate, beta, S0 if with_state else None)
    q = qn * qn.shape[-1] ** -0.5  # K2: the executor's q carries d^(-1/2)
    if form == "recurrent":
        o, S = kda.recurrent(q, kn, v, gate, beta, S0)
    else:
        o, S, _ = kda.chunked(q, kn, v, gate, beta, S0, chunk=64)
    assert o.dtype == torch.float64 and S_ref.dtype == torch.float64
    assert _rel(o, o_ref) < 1e-12 and _rel(S, S_ref) < 1e-12


@pytest.mark.parametrize("with_state", [False, True])
def test_kda_chunked_matches_fla_naive_chunk(fla, with_state):
    qn, kn, v, gate, beta, S0 = _inputs(T=128, seed=2)
    S0 = S0 if with_state else torch.zeros_like(S0)
    o_ref, S_ref = _fla_call(fla.naive_chunk_kda, qn, kn, v, gate, beta, S0 if with_state else None,
                             chunk_size=64)
    o, S, _ = kda.chunked(qn * qn.shape[-1] ** -0.5, kn, v, gate, beta, S0, chunk=64)
    assert _rel(o, o_ref) < 1e-12 and _rel(S, S_ref) < 1e-12


def test_fla_naive_forms_agree(fla):
    """Sanity of the oracle itself under the float64 proxy."""
    qn, kn, v, gate, beta, S0 = _inputs(T=64, seed=3)
    a = _fla_call(fla.naive_recurrent_kda, qn, kn, v, gate, beta, S0)
    b = _fla_call(fla.naive_chunk_kda, qn, kn, v, gate, beta, S0, chunk_size=64)
    assert _rel(b[0], a[0]) < 1e-12


@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 64), (64, 64), (200, 64), (200, 16)])
def test_chunked_equals_recurrent_float64(T, chunk):
    qn, kn, v, gate, beta, S0 = _inputs(T=T, seed=T)
    o_r, S_r = kda.recurrent(qn, kn, v, gate, beta, S0)
    o_c, S_c, saved = kda.chunked(qn, kn, v, gate, beta, S0, chunk=chunk, boundaries=(chunk,))
    assert _rel(o_c, o_r) < 1e-12 and _rel(S_c, S_r) < 1e-12
    if T >= chunk:  # the snapshot after one chunk is the recurrence's state there
        _, S_mid = kda.recurrent(qn[:chunk], kn[:chunk], v[:chunk], gate[:chunk], beta[:chunk], S0)
        assert _rel(saved[chunk], S_mid) < 1e-12


def test_chunked_is_stable_in_float32_at_the_gate_lower_bound():
    """Γ over a 64-chunk reaches -320 at the -5 bound: exp(±320) must never be formed in FP32."""
    qn, kn, v, gate, beta, S0 = _inputs(T=192, seed=5, dtype=torch.float32)
    gate = torch.full_like(gate, -4.999)  # strongest forgetting everywhere
    gate[::7] = -1e-3  # and some near-identity steps
    o32, S32, _ = kda.chunked(qn, kn, v, gate, beta, S0)
    o64, S64 = kda.recurrent(*(t.double() for t in (qn, kn, v, gate, beta, S0)))
    assert torch.isfinite(o32).all() and torch.isfinite(S32).all()
    assert _rel(o32.double(), o64) < 1e-5 and _rel(S32.double(), S64) < 1e-5
