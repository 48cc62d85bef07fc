"""``graph_manifest.json``: the layers, the custom ops a runtime must provide, the state schema.

Everything here follows from the config, the layout and docs/kimi-k3.md §3 and §5.3; nothing is
measured. Cache/state sizes (§5.3, dtypes as vLLM allocates them):

* KDA (per layer, per request): recurrent state FP32 [H, d_k, d_v] and short-conv state in the
  model dtype (BF16) [3 * H * d, kernel - 1]; both shard by KDA head under TP.
* Gated MLA (per layer, per token): the latent [kv_lora_rank + qk_rope_head_dim] = 576 values in
  BF16, replicated on every TP rank (no decode context parallelism).
"""

from __future__ import annotations

from k3bundle.plan import Plan, storage_name
from k3bundle.schema import Section
from k3bundle.storage import STORAGE

GRAPH_SCHEMA_VERSION = 1


def _ops(plan: Plan, kda: list[int], mla: list[int], moe: list[int]) -> list[dict]:
    t = plan.config.text
    ops = [
        {"op": "kda_chunked_prefill", "spec": "kimi-k3.md §3.3 (K1-K7), chunk 64", "layers": kda},
        {"op": "kda_recurrent_decode", "spec": "kimi-k3.md §3.3 (K5), FP32 state", "layers": kda},
        {"op": "causal_short_conv1d_with_state",
         "spec": f"kimi-k3.md §3.3 (K1), kernel {t.linear_attn_config.short_conv_kernel_size}, F32 weights",
         "layers": kda},
        {"op": "gated_mla_prefill", "spec": "kimi-k3.md §3.4 (M1-M5), NoPE, sigmoid output gate", "layers": mla},
        {"op": "gated_mla_decode_latent_cache", "spec": "kimi-k3.md §3.4, absorbed form on the 576-value latent",
         "layers": mla},
        {"op": "attn_res_depth_softmax", "spec": "kimi-k3.md §3.2 (A1, A2): twice per layer and once at the output",
         "layers": list(range(t.num_hidden_layers))},
        {"op": "situ_glu", "spec": f"kimi-k3.md §3.5: beta {t.activation_situ_beta}, cap {t.activation_situ_linear_beta}",
         "layers": list(range(t.num_hidden_layers))},
        {"op": "sigmoid_biased_topk_router",
         "spec": f"kimi-k3.md §3.7 (R1-R3): top-{t.num_experts_per_token} of {t.num_experts}, bias selects only",
         "layers": moe},
        {"op": "rmsnorm_fp32_stats", "spec": "kimi-k3.md §3.0 (N1): round to input dtype before the gain",
         "layers": list(range(t.num_hidden_layers))},
    ]
    # GEMMs by storage format (layout `formats`), with the roles that need them
    by_fmt: dict[str, set[str]] = {}
    for role, _ in plan.schema.instances():
        name = storage_name(plan.layout.rule_for(role), role)
        if STORAGE[name].gemm_op:
            by_fmt.setdefault(name, set()).add(role.role)
    for fmt in sorted(by_fmt):
        roles = sorted(by_fmt[fmt])
        grouped = any(r.startswith("moe.expert.") for r in roles)
        ops.append({"op": STORAGE[fmt].gemm_op + ("_grouped" if grouped else ""), "storage": fmt,
                    "scale_layout": plan.layout.scale_layout if STORAGE[fmt].swizzles_scales else "row-major",
                    "roles": roles})
    if plan.config.vision is not None:
        ops.append({"op": "moonvit_rope2d_attention", "spec": "kimi-k3.md §3.9 (V2), 2-D RoPE, theta 10000",
                    "stage": 0})
    return ops


def graph_manifest(plan: Plan) -> dict:
    """The ``graph_manifest.json`` document of a plan."""
    cfg, t, lay = plan.config, plan.config.text, plan.layout
    par = lay.parallel
    la = t.linear_attn_config
    stage_of = plan.stage_of_layer
    kda, mla, moe = t.kda_layers, t.mla_layers, t.moe_layers
    layers = [{"index": i, "mixer": plan.schema.mixer(i), "ffn": plan.schema.ffn(i), "pp_stage": stage_of[i],
               "attn_res_block": i // t.attn_res_block_size, "opens_attn_res_block": i % t.attn_res_block_size == 0}
              for i in range(t.num_hidden_layers)]
    H, d, kc = la.num_heads, la.head_dim, la.short_conv_kernel_size
    rec = {"dtype": "F32", "shape": [H, d, d], "bytes": H * d * d * 4}
    conv = {"dtype": "BF16", "shape": [3 * H * d, kc - 1], "bytes": 3 * H * d * (kc - 1) * 2}
    latent_values = t.kv_lora_rank + t.qk_rope_head_dim
    lat = {"dtype": "BF16", "values": latent_values, "bytes": latent_values * 2}
    per_rank = []
    for r in plan.ranks:
        n_kda = sum(1 for i in kda if stage_of[i] == r.stage)
        n_mla = sum(1 for i in mla if stage_of[i] == r.stage)
        per_rank.append({"rank": r.rank, "stage": r.stage, "kda_layers": n_kda, "mla_layers": n_mla,
                         "kda_bytes_per_request": n_kda * (rec["bytes"] + conv["bytes"]) // par.tp,
                         "mla_bytes_per_token": n_mla * lat["bytes"]})
    experts = {"num_experts": t.num_experts, "top_k": t.num_experts_per_token, "ep": par.ep, "moe_tp": par.moe_tp,
               "placement": par.expert_placement,
               "experts_per_rank": t.num_experts // par.ep, "stacked": lay.stack_experts}
    vision = None
    if cfg.vision is not None:
        vision = {"blocks": cfg.vision.vt_num_hidden_layers, "stage": 0,
                  "roles": sorted({r.role for r, _ in plan.schema.instances() if r.section is not Section.TEXT}),
                  "replicated": True}
    return {
        "schema_version": GRAPH_SCHEMA_VERSION,
        "kind": "k3bundle.graph_manifest",
        "model_type": cfg.model_type,
        "target": lay.name,
        "parallel": {"world": len(plan.ranks), "tp": par.tp, "attention_dp": par.attention_dp, "ep": par.ep,
                     "moe_tp": par.moe_tp, "pp": par.pp, "pp_layers": list(plan.stage_layers)},
        "layers": layers,
        "routed_experts": experts,
        "vision": vision,
        "custom_ops": _ops(plan, kda, mla, moe),
        "state_schema": {
            "kda": {"layers": kda, "sharded_by": "tp (KDA heads)",
                    "per_layer_per_request": {"recurrent": rec, "conv": conv},
                    "bytes_per_request": len(kda) * (rec["bytes"] + conv["bytes"])},
            "mla": {"layers": mla, "replicated_across": "tp",
                    "per_layer_per_token": {"latent": lat},
                    "bytes_per_token": len(mla) * lat["bytes"]},
            "per_rank": per_rank,
        },
    }
