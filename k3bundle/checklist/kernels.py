"""Kernel coverage: the primitives a target must implement, each with its shapes at the layout.

The op list is the bundle's ``graph_manifest.json`` (``custom_ops``); the shapes are per rank,
from the plan's parallel degrees (heads / TP, intermediates / TP or moe_tp, experts / EP) and, for
the quantized GEMMs, the stored device tensors of one rank (``Plan.parts``). An op with a backend
contract (``ops.contract.OP_CONTRACTS``) is shown in the contract's own notation — its arguments
and results in order, the contract's letters replaced by this layout's per-rank sizes — so the
checklist and docs/kernels.md name one shape one way. Letters left: T tokens in a step, B
requests, N sequences of a varlen prefill, S keys attended (``ops.contract.SHAPE_LEGEND``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from k3bundle.checklist.quantity import flops
from k3bundle.checklist.vision import describe, row_flops, vision_shapes
from k3bundle.executor.kda import CHUNK
from k3bundle.ops.contract import OP_CONTRACTS, Arg
from k3bundle.plan import Plan


@dataclass(frozen=True)
class Kernel:
    op: str
    spec: str
    layers: int  # decoder layers that call it (0 for ops outside the decoder)
    shapes: str  # per rank, at this layout

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _rows(plan: Plan, role: str, default: int) -> int:
    """Rows of one rank's slice of ``role`` (padding included), or ``default`` if the model lacks it."""
    for t in plan.targets:
        if t.role.role == role:
            return plan.slice_shape(t)[0]
    return default


def _dims(plan: Plan) -> dict[str, int]:
    t, par = plan.config.text, plan.layout.parallel
    la = t.linear_attn_config
    return {"H": la.num_heads // par.tp, "d": la.head_dim, "kc": la.short_conv_kernel_size,
            "Hm": t.num_attention_heads // par.tp, "qk": t.qk_nope_head_dim + t.qk_rope_head_dim,
            "dv": t.v_head_dim, "lat": t.kv_lora_rank + t.qk_rope_head_dim, "kv": t.kv_lora_rank,
            "D": t.hidden_size, "cand": len(t.block_openings) + 1,
            # per-rank intermediates as the plan slices them (layout padding included)
            "I": _rows(plan, "dense.gate_proj", t.intermediate_size // par.tp),
            "S": _rows(plan, "moe.shared.gate_proj", t.num_shared_experts * t.moe_intermediate_size // par.tp),
            "Ie": _rows(plan, "moe.expert.w1", t.moe_intermediate_size // par.moe_tp),
            "E": t.num_experts, "k": t.num_experts_per_token,
            "Er": t.num_experts // par.ep, "Rq": t.q_lora_rank, "Lr": t.routed_expert_hidden_size,
            "tp": par.tp}


def contract_sizes(x: dict, op: str) -> dict[str, int]:
    """The per-rank size of each letter of ``op``'s contract (``SHAPE_LEGEND``) at this layout; H and
    V are the MLA heads and v_head_dim for an MLA op, the KDA heads and head dim otherwise."""
    rope = x["lat"] - x["kv"]
    sizes = {"K": x["d"], "P": x["H"] * x["d"], "W": x["kc"], "Q": x["qk"], "Qn": x["qk"] - rope, "R": rope,
             "L": x["kv"], "D": x["D"], "X": x["E"], "Kx": x["k"], "Lr": x["Lr"]}
    mla = op.startswith("gated_mla")
    return {**sizes, "H": x["Hm"] if mla else x["H"], "V": x["dv"] if mla else x["d"]}


_TERM = re.compile(r"([+-]?)([^+-]+)")
_DTYPE = {"act": "", "f32": " F32", "int64": " I64"}  # act: the activation dtype, BF16 on a serving target


def _dim(expr: str, sizes: dict[str, int]) -> str:
    """One dimension of a contract shape (``H``, ``W-1``, ``H·V``, ``N+1``) as a number where every
    letter has a size here, else as the contract writes it."""
    total = 0
    for sign, term in _TERM.findall(expr):
        prod = 1
        for f in term.split("·"):
            f = f.strip()
            if f.isdigit():
                prod *= int(f)
            elif f in sizes:
                prod *= sizes[f]
            else:
                return expr
        total += -prod if sign == "-" else prod
    return str(total)


def _arg(a: Arg, sizes: dict[str, int]) -> str:
    dims = ", ".join(_dim(d.strip(), sizes) for d in a.shape.strip("[]").split(","))
    return f"{a.name} [{dims}]{_DTYPE.get(a.dtype, ' ' + a.dtype)}"


def contract_shapes(op: str, sizes: dict[str, int]) -> str:
    """``op``'s tensors in its contract's order and notation: the arguments (positional, then keyword
    tensors) → the results."""
    c = OP_CONTRACTS[op]
    ins = [_arg(a, sizes) for a in (*c.args, *c.keywords) if a.shape]
    return ", ".join(ins) + " → " + ", ".join(_arg(r, sizes) for r in c.returns if r.shape)


#: what the contract's shapes leave unsaid at a layout, after them
_CONTRACT_NOTES: dict[str, Callable[[dict], str]] = {
    "kda_chunked_prefill": lambda x: f"q, k L2-normed in the kernel; chunk {CHUNK}",
    "kda_recurrent_decode": lambda x: "state read and written in place per request",
    "causal_short_conv1d_with_state": lambda x: "once each for q, k and v; state per request",
    "gated_mla_prefill": lambda x: f"causal, scale {x['qk']}^-1/2, no RoPE; k_pe shared by heads",
    "gated_mla_decode_latent_cache": lambda x: f"latent cache whole on each of {x['tp']} TP ranks",
    "sigmoid_biased_topk_router": lambda x: f"top-{x['k']}, bias selects only, renormalised weights",
}

#: ops without a backend contract
_SHAPES: dict[str, Callable[[dict], str]] = {
    "attn_res_depth_softmax": lambda x: (
        f"≤ {x['cand']} candidates [T, {x['D']}] → [T, {x['D']}], FP32 softmax over depth (replicated)"),
    "situ_glu": lambda x: (
        f"dense [T, {x['I']}], shared [T, {x['S']}], routed [tokens, {x['Ie']}] per expert slice; FP32"),
    "rmsnorm_fp32_stats": lambda x: (
        f"widths {x['D']} (layer norms), {x['Rq']} (q_a), {x['kv']} (kv_a), {x['Lr']} (latent), {x['d']} "
        "(KDA o_norm per head)"),
}


def _gemm_shapes(plan: Plan, roles: list[str]) -> str:
    first: dict[str, object] = {}
    for t in plan.targets:
        if t.role.role in roles and t.role.role not in first:
            first[t.role.role] = t
    parts = []
    for role in roles:
        t = first.get(role)
        if t is None:
            continue
        logical = "×".join(map(str, plan.slice_shape(t)))
        stored = ", ".join(f"{p.part} {p.dtype} {list(p.shape)}" for p in plan.parts(t))
        per = f"{t.n_experts} experts × " if t.experts is not None else ""
        parts.append(f"{role}: {per}[{logical}] as {stored}")
    return "; ".join(parts)


def _vision_shapes(plan: Plan) -> str:
    """The tower's attention at the stated image (``checklist.vision``: the media size rule's grid)."""
    s = vision_shapes(plan)
    if s is None:
        v = plan.config.vision
        return (f"patch {v.patch_size} or merge {v.merge_kernel_size} is not the processor's: no image grid; "
                f"width {v.vt_hidden_size}, {v.vt_num_attention_heads} heads; replicated on stage 0")
    return (f"{describe(s)}; {flops(sum(row_flops(s).values()))} per image (roofline: vision); "
            "replicated on stage 0, one card per image")


def kernel_coverage(plan: Plan, manifest: dict) -> list[Kernel]:
    """One row per ``custom_ops`` entry of ``manifest``, with per-rank shapes at ``plan``'s layout."""
    x = _dims(plan)
    out = []
    for op in manifest["custom_ops"]:
        name = op["op"]
        layers = len(op.get("layers", []))
        if name in OP_CONTRACTS and "roles" not in op:
            note = _CONTRACT_NOTES.get(name)
            shapes = contract_shapes(name, contract_sizes(x, name)) + (f"; {note(x)}" if note else "")
        elif name in _SHAPES:
            shapes = _SHAPES[name](x)
        elif "roles" in op:
            shapes = (f"{op['storage']} weights, {op['scale_layout']} scales; " + _gemm_shapes(plan, op["roles"]))
            layers = len({layer for r, layer in plan.schema.instances() if r.role in op["roles"]})
        elif name == "moonvit_rope2d_attention" and plan.config.vision is not None:
            shapes = _vision_shapes(plan)
        else:
            shapes = "(no shape rule for this op in k3bundle.checklist.kernels)"
        spec = op.get("spec") or f"storage {op.get('storage')}"
        out.append(Kernel(name, spec, layers, shapes))
    return out
