"""Backends with one planted bug each: the bugs that broke real Kimi K3 ports.

``--backend planted:<bug>`` runs the reference with that one op wrong, so a user (and the tests)
can see ``k3bundle kernels`` exit 1 naming the op and the failing case, and ``validate`` exit 1
naming the layer. Each is what a real port got wrong:

- ``kda_state_transposed``: the prefill kernel writes its final state [V, K] where [K, V] is read
  (vLLM's KDA chunked prefill: decode after a long prompt broke, short prompts were fine).
- ``gate_no_lower_bound``: the gate as fla's default ``-exp(A_log) · softplus(g + dt_bias)``, the
  −5 · sigmoid lower-bound form lost (prefill and decode).
- ``beta_no_sigmoid``: beta used as the raw logit (prefill and decode).
- ``mxfp4_nvfp4_scale_stride``: MXFP4 E8M0 scales read one per 16 columns (NVFP4's block), not 32.
- ``router_bias_in_weights``: the correction bias added to the combine weights, not only to the selection.
- ``mla_scale_128``: the MLA softmax scale from the value head dim (128^-1/2), not q's 192^-1/2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3bundle.errors import K3Error
from k3bundle.executor import kda, latent_moe, mla
from k3bundle.kernels import reference
from k3bundle.ops.contract import Backend
from k3bundle.ops.expert_weight import ExpertWeight
from k3bundle.kernels.torch_ops import e2m1_values, e8m0_pow2


def kda_ops(gates) -> dict:
    """Prefill and decode ops of the reference with ``gates`` in place of ``kda.gates`` (K2-K4)."""

    def prefill(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, *, lower_bound, chunk=kda.CHUNK):
        cu, outs, finals = [int(x) for x in cu_seqlens], [], []
        for n in range(len(cu) - 1):
            p = slice(cu[n], cu[n + 1])
            o, S, _ = kda.chunked(*gates(q[p], k[p], v[p], g[p], beta[p], A_log, dt_bias, lower_bound, state.dtype),
                                  state[n], chunk)
            outs.append(o)
            finals.append(S)
        return torch.cat(outs), torch.stack(finals)

    def decode(q, k, v, g, beta, A_log, dt_bias, state, *, lower_bound):
        outs, finals = [], []
        for b in range(q.shape[0]):
            p = slice(b, b + 1)
            o, S = kda.recurrent(*gates(q[p], k[p], v[p], g[p], beta[p], A_log, dt_bias, lower_bound, state.dtype),
                                 state[b])
            outs.append(o)
            finals.append(S)
        return torch.cat(outs), torch.stack(finals)

    return {"kda_chunked_prefill": prefill, "kda_recurrent_decode": decode}


def _softplus_gates(q, k, v, g, beta, A_log, dt_bias, lower, c):
    q_, k_, v_, _, b_ = kda.gates(q, k, v, g, beta, A_log, dt_bias, lower, c)
    g_ = -A_log.to(c).exp()[:, None] * F.softplus(g.to(c) + dt_bias.to(c))  # BUG: no −5·sigmoid bound
    return q_, k_, v_, g_, b_


def _raw_beta_gates(q, k, v, g, beta, A_log, dt_bias, lower, c):
    q_, k_, v_, g_, _ = kda.gates(q, k, v, g, beta, A_log, dt_bias, lower, c)
    return q_, k_, v_, g_, beta.to(c)  # BUG: beta not through sigmoid


def _transposed_state_prefill(*args, **kw):
    o, S = reference.kda_chunked_prefill(*args, **kw)
    return o, S.transpose(-1, -2).contiguous()  # BUG: [V, K] written where [K, V] is read


def _nvfp4_stride_decode(packed, scale, dtype):
    rows, cols = packed.shape[0], packed.shape[1] * 2
    flat = scale.reshape(-1)
    # BUG: column j reads scale byte row·(cols/32) + j // 16 (NVFP4's block of 16), running into the next row
    idx = (torch.arange(rows, device=packed.device)[:, None] * scale.shape[1]
           + torch.arange(cols, device=packed.device)[None, :] // 16).clamp(max=flat.numel() - 1)
    return (e2m1_values(packed) * e8m0_pow2(flat[idx])).to(dtype)


def _stride_experts(z, ids, weights, experts, *, situ_beta, situ_cap):
    def wrong(e):
        E = experts(e)
        if E is None:
            return None
        out = {}
        for role, w in E.items():
            packed = w.mxfp4()
            out[role] = w if packed is None else ExpertWeight(_nvfp4_stride_decode(*packed, z.dtype))
        return out

    return reference.mxfp4_weight_gemm_grouped(z, ids, weights, wrong, situ_beta=situ_beta, situ_cap=situ_cap)


def _bias_router(x, w, bias, *, top_k, scaling, forced_ids=None):
    ids, _ = reference.sigmoid_biased_topk_router(x, w, bias, top_k=top_k, scaling=scaling, forced_ids=forced_ids)
    c = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = torch.sigmoid(x.to(c) @ w.to(c).T) + bias.to(c)  # BUG: the bias reaches the combine weights
    return ids, latent_moe.weights(s, ids, scaling)


def _mla_prefill_128(q, k, v, gate, *, offset, scale):
    return mla.output_gate(mla.attend_naive(q, k, v, offset, v.shape[-1] ** -0.5), gate)  # BUG: 1/sqrt(v dim)


def _mla_decode_128(q_nope, q_pe, latent, lengths, w_kvb, gate, *, scale):
    v_dim = w_kvb.shape[1] - q_nope.shape[-1]
    return reference.gated_mla_decode_latent_cache(q_nope, q_pe, latent, lengths, w_kvb, gate,
                                                   scale=v_dim ** -0.5)  # BUG


BUGS: dict[str, tuple[str, dict]] = {
    "kda_state_transposed": ("KDA prefill writes its final state transposed",
                             {"kda_chunked_prefill": _transposed_state_prefill}),
    "gate_no_lower_bound": ("KDA gate without its -5 lower bound (softplus form)", kda_ops(_softplus_gates)),
    "beta_no_sigmoid": ("KDA beta not through sigmoid", kda_ops(_raw_beta_gates)),
    "mxfp4_nvfp4_scale_stride": ("MXFP4 E8M0 scales read with an NVFP4 stride (16)",
                                 {"mxfp4_weight_gemm_grouped": _stride_experts}),
    "router_bias_in_weights": ("router bias added to the combine weights",
                               {"sigmoid_biased_topk_router": _bias_router}),
    "mla_scale_128": ("MLA softmax scale 128^-1/2 instead of 192^-1/2",
                      {"gated_mla_prefill": _mla_prefill_128, "gated_mla_decode_latent_cache": _mla_decode_128}),
}


def backend(bug: str) -> Backend:
    if bug not in BUGS:
        raise K3Error(f"backend 'planted:{bug}': no such planted bug; known: {', '.join(BUGS)}")
    return Backend(f"planted:{bug}", dict(BUGS[bug][1]), module=__name__)
