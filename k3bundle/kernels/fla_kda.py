"""The ``fla`` backend: fla-core's KDA kernels as the device under test for K2-K5.

On CUDA: ``chunk_kda`` (prefill) and ``fused_recurrent_kda`` (decode), Triton kernels, with
K3's settings passed to the kernel, as vLLM's KDA layer calls them:
- ``use_qk_l2norm_in_kernel`` (K2, eps 1e-6 inside the sqrt; the K^-1/2 scale as ``scale``),
- the gate in the kernel: ``use_gate_in_kernel`` with ``safe_gate`` and ``lower_bound=-5``,
  i.e. ``-5 · sigmoid(exp(A_log) · (g + dt_bias))`` (K3; prefill). The decode kernel gets the
  gate computed outside in FP32 and passed in log space (its in-kernel gate is fla's
  softplus form unless ``lower_bound`` is honoured; computing it outside is exact either way),
- ``use_beta_sigmoid_in_kernel`` (K4), FP32 state in fla's [K, V] layout (key rows, as ours),
  chunk 64, variable-length batches through ``cu_seqlens``.
q, k, v and the gate input reach the kernel in the activation dtype (BF16 on a serving device).

On CPU (no Triton): fla's pure-torch ``naive_recurrent_kda`` from ``fla/ops/kda/naive.py``, loaded
as a file (importing ``fla.ops`` needs Triton), with K2-K4 computed here in FP32. It is the
recurrence, for prefill too: fla's ``naive_chunk_kda`` needs T a multiple of 64.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from k3bundle.errors import K3Error

NAME = "fla"
L2_EPS = 1e-6
_NAIVE = None


def setup(device: torch.device) -> None:
    if importlib.util.find_spec("fla") is None:
        raise K3Error("backend 'fla' needs fla-core (pip install fla-core)")
    if device.type == "cuda":
        try:
            import fla.ops.kda  # noqa: F401
        except Exception as e:  # Triton missing or too old for this GPU
            raise K3Error(f"backend 'fla': cannot load fla's Triton KDA kernels on {device}: {e}") from None
    else:
        _naive()


def _naive():
    global _NAIVE
    if _NAIVE is None:
        spec = importlib.util.find_spec("fla")
        if spec is None:
            raise K3Error("backend 'fla' needs fla-core (pip install fla-core)")
        path = Path(list(spec.submodule_search_locations)[0]) / "ops" / "kda" / "naive.py"
        mod_spec = importlib.util.spec_from_file_location("k3bundle_fla_kda_naive", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
        _NAIVE = mod
    return _NAIVE


def _gate(g, A_log, dt_bias, lower_bound):
    """(K3) log α in FP32, outside the kernel."""
    return lower_bound * torch.sigmoid(A_log.float().exp()[:, None] * (g.float() + dt_bias.float()))


def _l2(x):
    x = x.float()
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)  # (K2), fla's l2norm


def _cpu(q, k, v, g, beta, A_log, dt_bias, state, cu, lower_bound):
    naive = _naive()
    outs, finals = [], []
    for n in range(len(cu) - 1):
        p = slice(int(cu[n]), int(cu[n + 1]))
        o, S = naive.naive_recurrent_kda(
            _l2(q[p])[None], _l2(k[p])[None], v[p].float()[None], _gate(g[p], A_log, dt_bias, lower_bound)[None],
            torch.sigmoid(beta[p].float())[None], scale=q.shape[-1] ** -0.5,
            initial_state=state[n:n + 1].float(), output_final_state=True)
        outs.append(o[0])
        finals.append(S[0])
    return torch.cat(outs), torch.stack(finals).to(state.dtype)


def kda_chunked_prefill(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, *, lower_bound, chunk=64):
    if q.device.type != "cuda":
        return _cpu(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens.tolist(), lower_bound)
    from fla.ops.kda import chunk_kda

    o, S = chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
                     initial_state=state.float().contiguous(), output_final_state=True,
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=True, lower_bound=lower_bound, A_log=A_log.float().contiguous(),
                     dt_bias=dt_bias.float().reshape(-1).contiguous(), cu_seqlens=cu_seqlens.to(q.device),
                     chunk_size=chunk)
    return o[0], S


def kda_recurrent_decode(q, k, v, g, beta, A_log, dt_bias, state, *, lower_bound):
    B = q.shape[0]
    cu = torch.arange(B + 1, dtype=torch.long, device=q.device)  # one token per request
    if q.device.type != "cuda":
        return _cpu(q, k, v, g, beta, A_log, dt_bias, state, cu.tolist(), lower_bound)
    from fla.ops.kda import fused_recurrent_kda

    o, S = fused_recurrent_kda(q[None], k[None], v[None], _gate(g, A_log, dt_bias, lower_bound)[None],
                               beta[None], scale=q.shape[-1] ** -0.5, initial_state=state.float().contiguous(),
                               output_final_state=True, use_qk_l2norm_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, cu_seqlens=cu)
    return o[0], S
