"""The op contracts of ``graph_manifest.json`` ``custom_ops`` and ``Backend``, the set of op
implementations a device brings (docs/kernels.md has the long form of each contract).

The executor's blocks ask a backend for an op with their own reference form as the fallback
(``Backend.op(name, reference)``): an op a backend lacks runs on the reference and is reported
"not covered". Where backends come from (built-in names, entry points, module paths) is
``k3bundle.kernels.backend.load``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from k3bundle.errors import K3Error

#: op -> its contract in one line (docs/kernels.md has the long form). Tensors named [T, ...] are
#: one request's new tokens; [B, ...] one row per request. "act" is the activation dtype of the
#: dtype policy (bf16 on a serving device), "f32" the state dtype (FP32; FP64 under float64).
OP_CONTRACTS: dict[str, str] = {
    "kda_chunked_prefill": (
        "(q, k [T,H,K] act (before L2 norm), v [T,H,V] act, g [T,H,K] act (gate input before dt_bias), "
        "beta [T,H] act (logits), A_log [H] f32, dt_bias [H,K] f32, state [N,H,K,V] f32 (key rows), "
        "cu_seqlens [N+1] long; lower_bound, chunk) -> (o [T,H,V], final state [N,H,K,V] f32); "
        "K2-K5: L2 norm and K^-1/2 inside, gate lower_bound*sigmoid(exp(A_log)*(g+dt_bias)), beta sigmoid"),
    "kda_recurrent_decode": (
        "(q, k [B,H,K], v [B,H,V], g [B,H,K], beta [B,H] act, A_log, dt_bias, state [B,H,K,V] f32; "
        "lower_bound) -> (o [B,H,V], new state [B,H,K,V]); one token per request, K2-K5"),
    "causal_short_conv1d_with_state": (
        "(u [T,P] act, weight [P,1,W] f32, state [W-1,P] act) -> (SiLU(conv) [T,P] act, new state [W-1,P]); K1"),
    "gated_mla_prefill": (
        "(q [T,H,E] act, k [S,H,E] act, v [S,H,V] act, gate [T,H*V] act (logits); offset, scale) -> "
        "y [T,H*V] act = softmax_causal(q k^T * scale) v ⊙ sigmoid(gate); query t at position offset + t; M4-M5"),
    "gated_mla_decode_latent_cache": (
        "(q_nope [B,H,N], q_pe [B,H,R] act, latent [B,S,L+R] act, lengths [B] long, w_kvb [H,N+V,L], "
        "gate [B,H*V] act; scale) -> y [B,H*V] act; request b reads latent[b, :lengths[b]], absorbed W_UK/W_UV"),
    "sigmoid_biased_topk_router": (
        "(x [T,D] act, w [E,D], bias [E] f32; top_k, scaling, forced_ids [T,K] or None) -> "
        "(ids [T,K] long, weights [T,K] f32); R1-R3, bias selects only, weights of forced_ids when given"),
    "mxfp4_weight_gemm_grouped": (
        "(z [T,Lr] act, ids [T,K] long, weights [T,K] f32, experts; situ_beta, situ_cap) -> r [T,Lr] f32; "
        "R5 = Σ_k w_k GLU_e(z) with experts(e) -> {w1, w3, w2: ExpertWeight} or None (another rank's)"),
}
OPS = tuple(OP_CONTRACTS)


@dataclass
class Backend:
    """A named set of op implementations; ``op(name)`` falls back to the reference."""

    name: str
    ops: dict[str, Callable] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None  # device types it runs on (None: any)
    setup_fn: Callable | None = None

    def provides(self, op: str) -> bool:
        return op in self.ops

    def op(self, name: str, reference: Callable) -> Callable:
        """The backend's implementation of op ``name``, else ``reference`` (the caller's own form)."""
        return self.ops.get(name, reference)

    def setup(self, device) -> None:
        import torch

        dev = torch.device(device)
        if self.devices is not None and dev.type not in self.devices:
            raise K3Error(f"backend {self.name!r} runs on {', '.join(self.devices)}, not on {dev.type}")
        if self.setup_fn is not None:
            self.setup_fn(dev)


#: the executor's default: no ops of its own, every op the reference's
REFERENCE = Backend("reference")
