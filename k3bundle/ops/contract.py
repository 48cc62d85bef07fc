"""The op contracts of ``graph_manifest.json`` ``custom_ops`` and ``Backend``, the set of op
implementations a device brings. ``OP_CONTRACTS`` is the calling convention, argument by
argument; ``contracts_markdown`` renders it as docs/kernels.md "Op contracts", and a test keeps
that page and the shipped implementations' signatures equal to it.

The executor's blocks ask a backend for an op with their own reference form as the fallback
(``Backend.op(name, reference)``): an op a backend lacks runs on the reference and is reported
"not covered". Where backends come from (built-in names, entry points, module paths) is
``k3bundle.kernels.backend.load``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from k3bundle.errors import K3Error

@dataclass(frozen=True)
class Arg:
    """One argument or result of an op. ``shape`` in the legend of ``SHAPE_LEGEND`` ("" for a
    scalar or a callable); ``dtype``: ``act`` (the activation dtype of the dtype policy: bf16 on
    a serving device, float64 for the reference), ``f32`` (the state dtype: FP32, FP64 under
    float64), ``int64``, or a Python type for a scalar."""

    name: str
    shape: str = ""
    dtype: str = ""
    note: str = ""
    default: str | None = None  # keyword arguments: the value when the caller leaves it out


@dataclass(frozen=True)
class OpContract:
    """How the executor calls an op: ``op(*args, **keywords) -> returns`` (a tuple where several)."""

    args: tuple[Arg, ...]  # positional, in this order
    keywords: tuple[Arg, ...]  # keyword-only
    returns: tuple[Arg, ...]
    does: str  # the math, with its equation numbers (docs/kimi-k3.md)
    block: str = ""  # where a layer calls it: "kda" or "mla" (the mixer), "moe" (the routed FFN)
    runs: str = "both"  # when: "prefill" (the prompt), "decode" (a decode step) or "both"

    def signature(self) -> str:
        kw = [k.name if k.default is None else f"{k.name}={k.default}" for k in self.keywords]
        res = ", ".join(r.name for r in self.returns)
        return (f"({', '.join([a.name for a in self.args] + (['*'] + kw if kw else []))}) -> "
                + (f"({res})" if len(self.returns) > 1 else res))


#: the letters of the shapes below
SHAPE_LEGEND: dict[str, str] = {
    "T": "new tokens of one request (prefill), or of all requests concatenated (varlen)",
    "B": "requests, one new token each (decode)",
    "N": "sequences of a varlen prefill (cu_seqlens has N+1 entries)",
    "S": "keys a query may attend: cached plus new tokens",
    "H": "heads on this rank (KDA or MLA)",
    "K": "KDA key head dim",
    "V": "value head dim (KDA, or MLA v_head_dim)",
    "P": "one KDA projection's width on this rank, H·K (the conv runs once each for q, k and v)",
    "W": "short-conv kernel width (short_conv_kernel_size)",
    "Q": "MLA query/key head dim, qk_nope_head_dim + qk_rope_head_dim",
    "Qn": "qk_nope_head_dim",
    "R": "qk_rope_head_dim",
    "L": "kv_lora_rank (the latent width)",
    "D": "hidden size",
    "X": "routed experts",
    "Kx": "experts per token (top_k)",
    "Lr": "routed expert hidden size (the latent MoE width)",
}

_KDA_IN = (
    Arg("q", "[T, H, K]", "act", "before the L2 norm (the op normalises)"),
    Arg("k", "[T, H, K]", "act", "before the L2 norm"),
    Arg("v", "[T, H, V]", "act"),
    Arg("g", "[T, H, K]", "act", "gate input, before dt_bias"),
    Arg("beta", "[T, H]", "act", "logits (the op applies the sigmoid)"),
    Arg("A_log", "[H]", "f32"),
    Arg("dt_bias", "[H, K]", "f32"),
)
_KDA_MATH = ("K2-K5: L2 norm and K^-1/2 scaling of q, k inside; gate lower_bound·sigmoid(exp(A_log)·(g + dt_bias)); "
             "beta through sigmoid; the state holds key channels on rows")


def _decode(a: Arg) -> Arg:
    return Arg(a.name, a.shape.replace("[T,", "[B,"), a.dtype, a.note)


#: op -> how the executor calls it (docs/kernels.md "Op contracts" is rendered from this table)
OP_CONTRACTS: dict[str, OpContract] = {
    "kda_chunked_prefill": OpContract(
        _KDA_IN + (Arg("state", "[N, H, K, V]", "f32", "initial state per sequence"),
                   Arg("cu_seqlens", "[N+1]", "int64", "sequence starts in T, then T")),
        (Arg("lower_bound", "", "float", "gate lower bound (-5)"), Arg("chunk", "", "int", "chunk length", "64")),
        (Arg("o", "[T, H, V]", "act"), Arg("state", "[N, H, K, V]", "f32", "final state per sequence")),
        _KDA_MATH,
        block="kda", runs="prefill"),
    "kda_recurrent_decode": OpContract(
        tuple(_decode(a) for a in _KDA_IN) + (Arg("state", "[B, H, K, V]", "f32"),),
        (Arg("lower_bound", "", "float"),),
        (Arg("o", "[B, H, V]", "act"), Arg("state", "[B, H, K, V]", "f32", "the new state")),
        "one token per request; " + _KDA_MATH,
        block="kda", runs="decode"),
    "causal_short_conv1d_with_state": OpContract(
        (Arg("u", "[T, P]", "act", "pre-conv input of q, k or v"), Arg("weight", "[P, 1, W]", "f32", "depthwise"),
         Arg("state", "[W-1, P]", "act", "the previous W-1 inputs")),
        (),
        (Arg("out", "[T, P]", "act", "SiLU(causal conv)"), Arg("state", "[W-1, P]", "act", "the last W-1 inputs")),
        "K1: depthwise causal conv over [state ‖ u], then SiLU",
        block="kda"),
    "gated_mla_prefill": OpContract(
        (Arg("q", "[T, H, Q]", "act"), Arg("k", "[S, H, Q]", "act"), Arg("v", "[S, H, V]", "act"),
         Arg("gate", "[T, H·V]", "act", "logits")),
        (Arg("offset", "", "int", "position of query 0 (cached tokens before it)"),
         Arg("scale", "", "float", "softmax scale, Q^-1/2")),
        (Arg("y", "[T, H·V]", "act"),),
        "M4-M5: softmax_causal(q kᵀ·scale) v ⊙ sigmoid(gate); query t at position offset + t sees keys "
        "0..offset+t",
        block="mla", runs="prefill"),
    "gated_mla_decode_latent_cache": OpContract(
        (Arg("q_nope", "[B, H, Qn]", "act"), Arg("q_pe", "[B, H, R]", "act"),
         Arg("latent", "[B, S, L+R]", "act", "[ĉ_kv ‖ k_pe] rows"), Arg("lengths", "[B]", "int64"),
         Arg("w_kvb", "[H, Qn+V, L]", "act", "kv_b_proj: W_UK rows then W_UV rows per head"),
         Arg("gate", "[B, H·V]", "act", "logits")),
        (Arg("scale", "", "float"),),
        (Arg("y", "[B, H·V]", "act"),),
        "M4-M5 with W_UK/W_UV absorbed; request b attends latent[b, :lengths[b]]",
        block="mla", runs="decode"),
    "sigmoid_biased_topk_router": OpContract(
        (Arg("x", "[T, D]", "act"), Arg("w", "[X, D]", "act"), Arg("bias", "[X]", "f32")),
        (Arg("top_k", "", "int"), Arg("scaling", "", "float", "routed_scaling_factor"),
         Arg("forced_ids", "[T, Kx]", "int64", "ids to use instead of choosing (teacher-forced runs)", "None")),
        (Arg("ids", "[T, Kx]", "int64"), Arg("weights", "[T, Kx]", "f32")),
        "R1-R3: sigmoid scores; the bias selects the top_k, it never weights; weights are the unbiased "
        "scores renormalised × scaling (of forced_ids when given)",
        block="moe"),
    "mxfp4_weight_gemm_grouped": OpContract(
        (Arg("z", "[T, Lr]", "act"), Arg("ids", "[T, Kx]", "int64"), Arg("weights", "[T, Kx]", "f32"),
         Arg("experts", "", "callable", "experts(e) -> {'w1', 'w3', 'w2': ExpertWeight}, or None for "
             "another rank's expert")),
        (Arg("situ_beta", "", "float"), Arg("situ_cap", "", "float")),
        (Arg("r", "[T, Lr]", "f32"),),
        "R5: r = Σ_k w_k·GLU_e(z) over each token's experts. An ExpertWeight has .value() (dense), .mxfp4() "
        "(packed codes + E8M0 scales) and .shape; ops.expert_weight.values(ws) decodes a group at once",
        block="moe"),
}
OPS = tuple(OP_CONTRACTS)


def contracts_markdown() -> str:
    """``OP_CONTRACTS`` and ``SHAPE_LEGEND`` as docs/kernels.md's "Op contracts" (generated)."""
    out = ["| letter | size |", "|---|---|"] + [f"| {k} | {v} |" for k, v in SHAPE_LEGEND.items()]
    for op, c in OP_CONTRACTS.items():
        out += ["", f"### `{op}`", "", "```python", f"{op}{c.signature()}", "```", "", c.does + ".", "",
                "| argument | passed | shape | dtype | meaning |", "|---|---|---|---|---|"]
        out += [f"| `{a.name}` | positional {i + 1} | {a.shape} | {a.dtype} | {a.note} |" for i, a in enumerate(c.args)]
        out += [f"| `{a.name}` | keyword{'' if a.default is None else f', default {a.default}'} | {a.shape} "
                f"| {a.dtype} | {a.note} |" for a in c.keywords]
        out += [f"| → `{r.name}` | returned {i + 1} of {len(c.returns)} | {r.shape} | {r.dtype} | {r.note} |"
                for i, r in enumerate(c.returns)]
    return "\n".join(out) + "\n"


@dataclass
class Backend:
    """A named set of op implementations; ``op(name)`` falls back to the reference."""

    name: str
    ops: dict[str, Callable] = field(default_factory=dict)
    devices: tuple[str, ...] | None = None  # device types it runs on (None: any)
    setup_fn: Callable | None = None
    warnings: tuple[str, ...] = ()  # e.g. a function named near an op but none (kernels.backend.near_misses)
    module: str = ""  # the module its ops come from, for reports ("" where it is none)
    # the kernels of particular layers, in place of this set: a kernel wrong in one layer only
    # (a device fault of calibrate's catalogue, k3bundle.calibrate.device_faults)
    layers: dict[int, Backend] = field(default_factory=dict)

    def provides(self, op: str) -> bool:
        return op in self.ops

    def for_layer(self, layer: int) -> Backend:
        """The kernels layer ``layer`` runs: its own set where ``layers`` has one, else this one."""
        return self.layers.get(layer, self)

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
