"""The Kimi K3 tensor schema as data: one row per tensor role (spec/kimi-k3.md §2).

Each row gives the role's checkpoint name template, its logical shape as dimension names
(resolved from the config by ``dimensions``), its storage format and its tensor-parallel
rule. Code in ``k3bundle.schema`` only expands these rows; no other module spells a
tensor name.

Templates: ``{lm}`` is the text prefix (``language_model.`` in the multimodal release,
empty in a text-only export, spec §2.2), ``{bid}`` a block index, ``{eid}`` an expert id.
An MXFP4 role names the pair stem; the stored tensors are ``<stem>.weight_packed`` and
``<stem>.weight_scale`` (spec §2.10).

TP rules (spec §5.1): ``column`` splits dim 0 into equal parts of ``unit`` (e.g. heads),
``row`` splits dim 1, ``vocab`` splits the rows of the vocabulary, ``replicate`` copies.
Per-expert roles are placed whole by expert parallelism; their rule says how a TP-only
layout slices inside one expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from k3bundle.config import TextConfig, VisionConfig


class Section(str, Enum):
    TEXT = "text"
    VISION = "vision"
    PROJECTOR = "projector"


class Scope(str, Enum):
    """Where a role occurs."""

    GLOBAL = "global"  # once per model (embedding, head, final norms, projector)
    LAYER = "layer"  # once per decoder layer, whatever its kind
    KDA = "kda"  # KDA mixer layers
    MLA = "mla"  # Gated MLA mixer layers
    DENSE = "dense"  # dense FFN layers (layer 0)
    MOE = "moe"  # Stable LatentMoE layers
    EXPERT = "expert"  # once per routed expert of each MoE layer
    VIT_BLOCK = "vit_block"  # once per MoonViT encoder block


class Format(str, Enum):
    BF16 = "bf16"
    F32 = "f32"
    MXFP4 = "mxfp4"  # stored as weight_packed U8 [out, in/2] + weight_scale U8 [out, in/group]


class TP(str, Enum):
    REPLICATE = "replicate"
    COLUMN = "column"
    ROW = "row"
    VOCAB = "vocab"


@dataclass(frozen=True)
class Role:
    role: str
    template: str
    shape: tuple[str, ...]  # logical shape, dimension names (see ``dimensions``)
    fmt: Format
    scope: Scope
    tp: TP = TP.REPLICATE
    unit: str | None = None  # dimension counting the atomic TP units (heads, rows)
    padded: str | None = None  # dim 0 is stored padded to this dimension (A_log)
    section: Section = Section.TEXT


def _r(role, template, shape, fmt, scope, tp=TP.REPLICATE, unit=None, **kw) -> Role:
    return Role(role, template, tuple(shape.split()), Format(fmt), scope, TP(tp), unit, **kw)


L = "{lm}model.layers.{bid}."
A = L + "self_attn."
M = L + "block_sparse_moe."
V = "vision_tower.encoder.blocks.{bid}."
G, Y, K, Q, D_, E, X, B = (Scope.GLOBAL, Scope.LAYER, Scope.KDA, Scope.MLA, Scope.DENSE,
                           Scope.MOE, Scope.EXPERT, Scope.VIT_BLOCK)

ROLES: tuple[Role, ...] = (
    # --- global text tensors (spec §2.3) ---
    _r("embed", "{lm}model.embed_tokens.weight", "V D", "bf16", G, "vocab", "V"),
    _r("lm_head", "{lm}lm_head.weight", "V D", "bf16", G, "vocab", "V"),  # untied
    _r("final_norm", "{lm}model.norm.weight", "D", "bf16", G),
    _r("out_res.norm", "{lm}model.output_attn_res_norm.weight", "D", "bf16", G),
    _r("out_res.proj", "{lm}model.output_attn_res_proj.weight", "1 D", "bf16", G),
    # --- every decoder layer (spec §2.4); layer 0's attn_res pair is stored but unused ---
    _r("input_norm", L + "input_layernorm.weight", "D", "bf16", Y),
    _r("post_attn_norm", L + "post_attention_layernorm.weight", "D", "bf16", Y),
    _r("attn_res.norm", L + "self_attention_res_norm.weight", "D", "bf16", Y),
    _r("attn_res.proj", L + "self_attention_res_proj.weight", "1 D", "bf16", Y),
    _r("ffn_res.norm", L + "mlp_res_norm.weight", "D", "bf16", Y),
    _r("ffn_res.proj", L + "mlp_res_proj.weight", "1 D", "bf16", Y),
    # --- KDA mixer (spec §2.5); g_proj/o_proj share names with MLA, resolved by layer kind ---
    _r("kda.q_proj", A + "q_proj.weight", "P D", "bf16", K, "column", "H"),
    _r("kda.k_proj", A + "k_proj.weight", "P D", "bf16", K, "column", "H"),
    _r("kda.v_proj", A + "v_proj.weight", "P D", "bf16", K, "column", "H"),
    _r("kda.q_conv", A + "q_conv1d.weight", "P 1 Kc", "f32", K, "column", "H"),
    _r("kda.k_conv", A + "k_conv1d.weight", "P 1 Kc", "f32", K, "column", "H"),
    _r("kda.v_conv", A + "v_conv1d.weight", "P 1 Kc", "f32", K, "column", "H"),
    _r("kda.f_a_proj", A + "f_a_proj.weight", "d D", "bf16", K),  # low-rank gate down: replicated
    _r("kda.f_b_proj", A + "f_b_proj.weight", "P d", "bf16", K, "column", "H"),
    _r("kda.dt_bias", A + "dt_bias", "P", "f32", K, "column", "H"),
    _r("kda.A_log", A + "A_log", "Ap", "f32", K, "column", "H", padded="Ap"),  # [H] zero-padded
    _r("kda.b_proj", A + "b_proj.weight", "H D", "bf16", K, "column", "H"),
    _r("kda.g_proj", A + "g_proj.weight", "P D", "bf16", K, "column", "H"),
    _r("kda.o_norm", A + "o_norm.weight", "d", "f32", K),
    _r("kda.o_proj", A + "o_proj.weight", "D P", "bf16", K, "row", "H"),
    # --- Gated MLA mixer (spec §2.6) ---
    _r("mla.q_a_proj", A + "q_a_proj.weight", "Rq D", "bf16", Q),
    _r("mla.q_a_norm", A + "q_a_layernorm.weight", "Rq", "bf16", Q),
    _r("mla.q_b_proj", A + "q_b_proj.weight", "Hq_qk Rq", "bf16", Q, "column", "Hm"),
    _r("mla.kv_a_proj", A + "kv_a_proj_with_mqa.weight", "Rkv_pe D", "bf16", Q),
    _r("mla.kv_a_norm", A + "kv_a_layernorm.weight", "Rkv", "bf16", Q),
    _r("mla.kv_b_proj", A + "kv_b_proj.weight", "Hkv Rkv", "bf16", Q, "column", "Hm"),
    _r("mla.g_proj", A + "g_proj.weight", "Hv D", "bf16", Q, "column", "Hm"),
    _r("mla.o_proj", A + "o_proj.weight", "D Hv", "bf16", Q, "row", "Hm"),
    # --- dense FFN, layer 0 (spec §2.7) ---
    _r("dense.gate_proj", L + "mlp.gate_proj.weight", "I D", "bf16", D_, "column", "I"),
    _r("dense.up_proj", L + "mlp.up_proj.weight", "I D", "bf16", D_, "column", "I"),
    _r("dense.down_proj", L + "mlp.down_proj.weight", "D I", "bf16", D_, "row", "I"),
    # --- Stable LatentMoE (spec §2.8) ---
    _r("moe.router", M + "gate.weight", "E D", "bf16", E),
    _r("moe.router_bias", M + "gate.e_score_correction_bias", "E", "f32", E),
    _r("moe.latent_down", M + "routed_expert_down_proj.weight", "Lr D", "bf16", E),
    _r("moe.latent_norm", M + "routed_expert_norm.weight", "Lr", "bf16", E),
    _r("moe.latent_up", M + "routed_expert_up_proj.weight", "D Lr", "bf16", E),
    _r("moe.shared.gate_proj", M + "shared_experts.gate_proj.weight", "S D", "bf16", E, "column", "S"),
    _r("moe.shared.up_proj", M + "shared_experts.up_proj.weight", "S D", "bf16", E, "column", "S"),
    _r("moe.shared.down_proj", M + "shared_experts.down_proj.weight", "D S", "bf16", E, "row", "S"),
    # routed experts: w1 = gate, w3 = up, w2 = down (spec §2.8); EP places whole experts
    _r("moe.expert.w1", M + "experts.{eid}.w1", "Ie Lr", "mxfp4", X, "column", "Ie"),
    _r("moe.expert.w2", M + "experts.{eid}.w2", "Lr Ie", "mxfp4", X, "row", "Ie"),
    _r("moe.expert.w3", M + "experts.{eid}.w3", "Ie Lr", "mxfp4", X, "column", "Ie"),
    # --- MoonViT-V2 vision tower (spec §2.9): replicated ---
    _r("vit.patch_embed", "vision_tower.patch_embed.proj.weight", "Dv 3 Pt Pt", "bf16", G,
       section=Section.VISION),
    _r("vit.pos_emb", "vision_tower.patch_embed.pos_emb.weight", "Ph Pw Dv", "bf16", G,
       section=Section.VISION),
    _r("vit.norm0", V + "norm0.weight", "Dv", "bf16", B, section=Section.VISION),
    _r("vit.wqkv", V + "wqkv.weight", "Qkv3 Dv", "bf16", B, section=Section.VISION),
    _r("vit.wo", V + "wo.weight", "Dv Qkv", "bf16", B, section=Section.VISION),
    _r("vit.norm1", V + "norm1.weight", "Dv", "bf16", B, section=Section.VISION),
    _r("vit.fc0", V + "mlp.fc0.weight", "Iv Dv", "bf16", B, section=Section.VISION),
    _r("vit.fc1", V + "mlp.fc1.weight", "Dv Iv", "bf16", B, section=Section.VISION),
    _r("vit.final_norm", "vision_tower.encoder.final_layernorm.weight", "Dv", "bf16", G,
       section=Section.VISION),
    # --- patchmergerv2 projector (spec §2.9) ---
    _r("proj.fc1", "mm_projector.proj.0.weight", "Dm Dm", "bf16", G, section=Section.PROJECTOR),
    _r("proj.fc2", "mm_projector.proj.2.weight", "D Dm", "bf16", G, section=Section.PROJECTOR),
    _r("proj.post_norm", "mm_projector.post_norm.weight", "D", "bf16", G, section=Section.PROJECTOR),
)

ROLE_BY_NAME: dict[str, Role] = {r.role: r for r in ROLES}
assert len(ROLE_BY_NAME) == len(ROLES), "duplicate role name"

# Stored parts of an MXFP4 pair: (part, name suffix, stored dtype).
MXFP4_PARTS = (("packed", ".weight_packed", "U8"), ("scale", ".weight_scale", "U8"))
STORED_DTYPE = {Format.BF16: "BF16", Format.F32: "F32"}


def dimensions(text: TextConfig, vision: VisionConfig | None) -> dict[str, int]:
    """Resolve the dimension names used in ``ROLES`` from a config (spec §1)."""
    la = text.linear_attn_config
    h_mla = text.num_attention_heads
    dims = {
        "1": 1, "3": 3,
        "D": text.hidden_size, "V": text.vocab_size,
        # KDA
        "H": la.num_heads, "d": la.head_dim, "P": la.num_heads * la.head_dim,
        "Kc": la.short_conv_kernel_size, "Ap": text.a_log_len,
        # Gated MLA
        "Hm": h_mla, "Rq": text.q_lora_rank, "Rkv": text.kv_lora_rank,
        "Rkv_pe": text.kv_lora_rank + text.qk_rope_head_dim,
        "Hq_qk": h_mla * (text.qk_nope_head_dim + text.qk_rope_head_dim),
        "Hkv": h_mla * (text.qk_nope_head_dim + text.v_head_dim),
        "Hv": h_mla * text.v_head_dim,
        # FFNs
        "I": text.intermediate_size, "E": text.num_experts,
        "Lr": text.routed_expert_hidden_size, "Ie": text.moe_intermediate_size,
        "S": text.num_shared_experts * text.moe_intermediate_size,
    }
    if vision is not None:
        mk = vision.merge_kernel_size[0] * vision.merge_kernel_size[1]
        dims.update({
            "Dv": vision.vt_hidden_size, "Iv": vision.vt_intermediate_size,
            "Qkv": vision.qkv_hidden_size, "Qkv3": 3 * vision.qkv_hidden_size,
            "Pt": vision.patch_size, "Ph": vision.init_pos_emb_height,
            "Pw": vision.init_pos_emb_width, "Dm": mk * vision.mm_hidden_size,
        })
    return dims


# --- device-side names (k3bundle plan/convert; docs/bundle-format.md "Bundle files"); the
# tensors each storage format writes are declared by its module in ``k3bundle.storage`` ---

# Stacked per-rank routed-expert tensors (layouts with ``stack_experts: true``): one tensor per
# projection and MoE layer holds a rank's experts along a new leading dim, so the stem drops the
# expert id. The stored parts keep their suffixes (``.weight_packed``, ``.weight_scale``, ...).
STACKED_EXPERT_TEMPLATES: dict[str, str] = {
    "moe.expert.w1": M + "experts.w1",
    "moe.expert.w2": M + "experts.w2",
    "moe.expert.w3": M + "experts.w3",
}
