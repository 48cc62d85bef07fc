"""The reference backend: each op of ``ops.contract.OP_CONTRACTS`` as the executor's own block functions.

Nothing here is new math: the KDA and MLA ops are the reference forms their block modules keep
next to their equations (``executor.kda``, ``executor.mla``), and the router and grouped-expert
ops call ``latent_moe.route`` and ``routed``. So the executor with this backend is the executor in
its readable forms (``Executor(forms="readable")``; the fast forms are the same function, tested
against these), and a conformance run of this backend against itself in float64 is exact.
"""

from __future__ import annotations

import types
from collections.abc import Callable

from k3bundle.executor import latent_moe
from k3bundle.executor.kda import (causal_short_conv1d_with_state, kda_chunked_prefill,  # noqa: F401
                                   kda_recurrent_decode)
from k3bundle.executor.mla import gated_mla_decode_latent_cache, gated_mla_prefill  # noqa: F401
from k3bundle.ops.expert_weight import logical

NAME = "reference"


def sigmoid_biased_topk_router(x, w, bias, *, top_k, scaling, forced_ids=None):
    text = types.SimpleNamespace(num_experts_per_token=top_k, routed_scaling_factor=scaling)
    r = latent_moe.route(x, w, bias, text, forced_ids)  # (R1-R3)
    return r.ids_TK, r.weights_TK


def mxfp4_weight_gemm_grouped(z, ids, weights, experts, *, situ_beta, situ_cap):
    return latent_moe.routed(z, ids, weights, lambda e: logical(experts(e)), situ_beta, situ_cap)  # (R5)


def routed_experts(z, ids, weights, experts, *, situ_beta, situ_cap):
    """The grouped-expert op of any storage format (the weights come decoded by the source)."""
    return mxfp4_weight_gemm_grouped(z, ids, weights, experts, situ_beta=situ_beta, situ_cap=situ_cap)


def op(name: str) -> Callable:
    """The reference implementation of op ``name`` (any ``*_gemm_grouped``: ``routed_experts``)."""
    if name.endswith("_gemm_grouped") and name not in globals():
        return routed_experts
    return globals()[name]
