"""Kernel coverage: the primitives a target must implement, each with its shapes at the layout.

The op list is the bundle's ``graph_manifest.json`` (``custom_ops``); the shapes are per rank,
from the plan's parallel degrees (heads / TP, intermediates / TP or moe_tp, experts / EP) and, for
the quantized GEMMs, the stored device tensors of one rank (``Plan.parts``).
Legend: T tokens in a step, B requests, S cached tokens of a request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from k3bundle.executor.kda import CHUNK
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


_SHAPES: dict[str, Callable[[dict], str]] = {
    "kda_chunked_prefill": lambda x: (
        f"q, k [T, {x['H']}, {x['d']}] (L2-normed in kernel), v [T, {x['H']}, {x['d']}], gate g [T, {x['H']}, "
        f"{x['d']}] F32, beta [T, {x['H']}], state [{x['H']}, {x['d']}, {x['d']}] F32 in/out, chunk {CHUNK}"),
    "kda_recurrent_decode": lambda x: (
        f"q, k, v [B, {x['H']}, {x['d']}], g [B, {x['H']}, {x['d']}], beta [B, {x['H']}], state "
        f"[B, {x['H']}, {x['d']}, {x['d']}] F32 read + write"),
    # the op contract's own notation (ops.contract: u [T, P], weight [P, 1, W], state [W-1, P])
    "causal_short_conv1d_with_state": lambda x: (
        f"u [T, {x['H'] * x['d']}], weight [{x['H'] * x['d']}, 1, {x['kc']}] F32, state [{x['kc'] - 1}, "
        f"{x['H'] * x['d']}] BF16 per request; once each for q, k and v"),
    "gated_mla_prefill": lambda x: (
        f"q [T, {x['Hm']}, {x['qk']}], k [T, {x['Hm']}, {x['qk']}] (k_pe shared by heads), v [T, {x['Hm']}, "
        f"{x['dv']}], sigmoid gate [T, {x['Hm'] * x['dv']}], causal, scale {x['qk']}^-1/2, no RoPE"),
    "gated_mla_decode_latent_cache": lambda x: (
        f"latent cache [S, {x['lat']}] BF16 (whole on each of {x['tp']} TP ranks), absorbed q [B, {x['Hm']}, "
        f"{x['lat']}], out [B, {x['Hm']}, {x['kv']}] before W_UV"),
    "attn_res_depth_softmax": lambda x: (
        f"≤ {x['cand']} candidates [T, {x['D']}] → [T, {x['D']}], FP32 softmax over depth (replicated)"),
    "situ_glu": lambda x: (
        f"dense [T, {x['I']}], shared [T, {x['S']}], routed [tokens, {x['Ie']}] per expert slice; FP32"),
    "sigmoid_biased_topk_router": lambda x: (
        f"logits [T, {x['E']}] FP32, bias [{x['E']}] F32 (selects only), top-{x['k']}, renormalised weights"),
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
    v = plan.config.vision
    heads = v.vt_num_attention_heads
    return (f"q, k, v [patches, {heads}, {v.qkv_hidden_size // heads}] with 2-D RoPE on the ({v.patch_size}-px) "
            f"patch grid, width {v.vt_hidden_size}, non-causal within each image; replicated on stage 0")


def kernel_coverage(plan: Plan, manifest: dict) -> list[Kernel]:
    """One row per ``custom_ops`` entry of ``manifest``, with per-rank shapes at ``plan``'s layout."""
    x = _dims(plan)
    out = []
    for op in manifest["custom_ops"]:
        name = op["op"]
        layers = len(op.get("layers", []))
        if name in _SHAPES:
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
