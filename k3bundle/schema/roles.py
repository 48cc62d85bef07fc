"""The Kimi K3 tensor schema as data: one row per tensor role (docs/kimi-k3.md §2).

Each row gives the role's checkpoint name template, its logical shape as dimension names
(resolved from the config by ``dimensions``), its storage format and its tensor-parallel
rule. Code in ``k3bundle.schema`` only expands these rows; no other module spells a
tensor name.

Templates: ``{lm}`` is the text prefix (``language_model.`` in the multimodal release,
empty in a text-only export, docs/kimi-k3.md §2.2), ``{bid}`` a block index, ``{eid}`` an expert id.
An MXFP4 role names the pair stem; the stored tensors are ``<stem>.weight_packed`` and
``<stem>.weight_scale`` (docs/formats.md).

TP rules (docs/kimi-k3.md §5.1): ``column`` splits dim 0 into equal parts of ``unit`` (e.g. heads),
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


def _role(role: str, template: str, shape: str, fmt: str, scope: Scope, tp: str = "replicate",
          unit: str | None = None, **kw) -> Role:
    """A ``Role`` row written compactly: ``shape`` as space-separated dimension names."""
    return Role(role, template, tuple(shape.split()), Format(fmt), scope, TP(tp), unit, **kw)


# Name prefixes shared by the templates below.
LAYER = "{lm}model.layers.{bid}."
ATTN = LAYER + "self_attn."
MOE = LAYER + "block_sparse_moe."
VIT_BLOCK = "vision_tower.encoder.blocks.{bid}."

ROLES: tuple[Role, ...] = (
    # --- global text tensors (docs/kimi-k3.md §2.3) ---
    _role("embed", "{lm}model.embed_tokens.weight", "V D", "bf16", Scope.GLOBAL, tp="vocab", unit="V"),
    _role("lm_head", "{lm}lm_head.weight", "V D", "bf16", Scope.GLOBAL, tp="vocab", unit="V"),  # untied
    _role("final_norm", "{lm}model.norm.weight", "D", "bf16", Scope.GLOBAL),
    _role("out_res.norm", "{lm}model.output_attn_res_norm.weight", "D", "bf16", Scope.GLOBAL),
    _role("out_res.proj", "{lm}model.output_attn_res_proj.weight", "1 D", "bf16", Scope.GLOBAL),
    # --- every decoder layer (docs/kimi-k3.md §2.3); layer 0's attn_res pair is stored but unused ---
    _role("input_norm", LAYER + "input_layernorm.weight", "D", "bf16", Scope.LAYER),
    _role("post_attn_norm", LAYER + "post_attention_layernorm.weight", "D", "bf16", Scope.LAYER),
    _role("attn_res.norm", LAYER + "self_attention_res_norm.weight", "D", "bf16", Scope.LAYER),
    _role("attn_res.proj", LAYER + "self_attention_res_proj.weight", "1 D", "bf16", Scope.LAYER),
    _role("ffn_res.norm", LAYER + "mlp_res_norm.weight", "D", "bf16", Scope.LAYER),
    _role("ffn_res.proj", LAYER + "mlp_res_proj.weight", "1 D", "bf16", Scope.LAYER),
    # --- KDA mixer (docs/kimi-k3.md §2.3); g_proj/o_proj share names with MLA, resolved by layer kind ---
    _role("kda.q_proj", ATTN + "q_proj.weight", "P D", "bf16", Scope.KDA, tp="column", unit="H"),
    _role("kda.k_proj", ATTN + "k_proj.weight", "P D", "bf16", Scope.KDA, tp="column", unit="H"),
    _role("kda.v_proj", ATTN + "v_proj.weight", "P D", "bf16", Scope.KDA, tp="column", unit="H"),
    _role("kda.q_conv", ATTN + "q_conv1d.weight", "P 1 Kc", "f32", Scope.KDA, tp="column", unit="H"),
    _role("kda.k_conv", ATTN + "k_conv1d.weight", "P 1 Kc", "f32", Scope.KDA, tp="column", unit="H"),
    _role("kda.v_conv", ATTN + "v_conv1d.weight", "P 1 Kc", "f32", Scope.KDA, tp="column", unit="H"),
    _role("kda.f_a_proj", ATTN + "f_a_proj.weight", "d D", "bf16", Scope.KDA),  # low-rank gate down: replicated
    _role("kda.f_b_proj", ATTN + "f_b_proj.weight", "P d", "bf16", Scope.KDA, tp="column", unit="H"),
    _role("kda.dt_bias", ATTN + "dt_bias", "P", "f32", Scope.KDA, tp="column", unit="H"),
    _role("kda.A_log", ATTN + "A_log", "Ap", "f32", Scope.KDA, tp="column", unit="H", padded="Ap"),  # [H] zero-padded
    _role("kda.b_proj", ATTN + "b_proj.weight", "H D", "bf16", Scope.KDA, tp="column", unit="H"),
    _role("kda.g_proj", ATTN + "g_proj.weight", "P D", "bf16", Scope.KDA, tp="column", unit="H"),
    _role("kda.o_norm", ATTN + "o_norm.weight", "d", "f32", Scope.KDA),
    _role("kda.o_proj", ATTN + "o_proj.weight", "D P", "bf16", Scope.KDA, tp="row", unit="H"),
    # --- Gated MLA mixer (docs/kimi-k3.md §2.3) ---
    _role("mla.q_a_proj", ATTN + "q_a_proj.weight", "Rq D", "bf16", Scope.MLA),
    _role("mla.q_a_norm", ATTN + "q_a_layernorm.weight", "Rq", "bf16", Scope.MLA),
    _role("mla.q_b_proj", ATTN + "q_b_proj.weight", "Hq_qk Rq", "bf16", Scope.MLA, tp="column", unit="Hm"),
    _role("mla.kv_a_proj", ATTN + "kv_a_proj_with_mqa.weight", "Rkv_pe D", "bf16", Scope.MLA),
    _role("mla.kv_a_norm", ATTN + "kv_a_layernorm.weight", "Rkv", "bf16", Scope.MLA),
    _role("mla.kv_b_proj", ATTN + "kv_b_proj.weight", "Hkv Rkv", "bf16", Scope.MLA, tp="column", unit="Hm"),
    _role("mla.g_proj", ATTN + "g_proj.weight", "Hv D", "bf16", Scope.MLA, tp="column", unit="Hm"),
    _role("mla.o_proj", ATTN + "o_proj.weight", "D Hv", "bf16", Scope.MLA, tp="row", unit="Hm"),
    # --- dense FFN, layer 0 (docs/kimi-k3.md §2.3) ---
    _role("dense.gate_proj", LAYER + "mlp.gate_proj.weight", "I D", "bf16", Scope.DENSE, tp="column", unit="I"),
    _role("dense.up_proj", LAYER + "mlp.up_proj.weight", "I D", "bf16", Scope.DENSE, tp="column", unit="I"),
    _role("dense.down_proj", LAYER + "mlp.down_proj.weight", "D I", "bf16", Scope.DENSE, tp="row", unit="I"),
    # --- Stable LatentMoE (docs/kimi-k3.md §2.3) ---
    _role("moe.router", MOE + "gate.weight", "E D", "bf16", Scope.MOE),
    _role("moe.router_bias", MOE + "gate.e_score_correction_bias", "E", "f32", Scope.MOE),
    _role("moe.latent_down", MOE + "routed_expert_down_proj.weight", "Lr D", "bf16", Scope.MOE),
    _role("moe.latent_norm", MOE + "routed_expert_norm.weight", "Lr", "bf16", Scope.MOE),
    _role("moe.latent_up", MOE + "routed_expert_up_proj.weight", "D Lr", "bf16", Scope.MOE),
    _role("moe.shared.gate_proj", MOE + "shared_experts.gate_proj.weight", "S D", "bf16", Scope.MOE,
          tp="column", unit="S"),
    _role("moe.shared.up_proj", MOE + "shared_experts.up_proj.weight", "S D", "bf16", Scope.MOE,
          tp="column", unit="S"),
    _role("moe.shared.down_proj", MOE + "shared_experts.down_proj.weight", "D S", "bf16", Scope.MOE,
          tp="row", unit="S"),
    # routed experts: w1 = gate, w3 = up, w2 = down (docs/kimi-k3.md §2.3); EP places whole experts
    _role("moe.expert.w1", MOE + "experts.{eid}.w1", "Ie Lr", "mxfp4", Scope.EXPERT, tp="column", unit="Ie"),
    _role("moe.expert.w2", MOE + "experts.{eid}.w2", "Lr Ie", "mxfp4", Scope.EXPERT, tp="row", unit="Ie"),
    _role("moe.expert.w3", MOE + "experts.{eid}.w3", "Ie Lr", "mxfp4", Scope.EXPERT, tp="column", unit="Ie"),
    # --- MoonViT-V2 vision tower (docs/kimi-k3.md §2.3): replicated ---
    _role("vit.patch_embed", "vision_tower.patch_embed.proj.weight", "Dv 3 Pt Pt", "bf16", Scope.GLOBAL,
          section=Section.VISION),
    _role("vit.pos_emb", "vision_tower.patch_embed.pos_emb.weight", "Ph Pw Dv", "bf16", Scope.GLOBAL,
          section=Section.VISION),
    _role("vit.norm0", VIT_BLOCK + "norm0.weight", "Dv", "bf16", Scope.VIT_BLOCK, section=Section.VISION),
    _role("vit.wqkv", VIT_BLOCK + "wqkv.weight", "Qkv3 Dv", "bf16", Scope.VIT_BLOCK, section=Section.VISION),
    _role("vit.wo", VIT_BLOCK + "wo.weight", "Dv Qkv", "bf16", Scope.VIT_BLOCK, section=Section.VISION),
    _role("vit.norm1", VIT_BLOCK + "norm1.weight", "Dv", "bf16", Scope.VIT_BLOCK, section=Section.VISION),
    _role("vit.fc0", VIT_BLOCK + "mlp.fc0.weight", "Iv Dv", "bf16", Scope.VIT_BLOCK, section=Section.VISION),
    _role("vit.fc1", VIT_BLOCK + "mlp.fc1.weight", "Dv Iv", "bf16", Scope.VIT_BLOCK, section=Section.VISION),
    _role("vit.final_norm", "vision_tower.encoder.final_layernorm.weight", "Dv", "bf16", Scope.GLOBAL,
          section=Section.VISION),
    # --- patchmergerv2 projector (docs/kimi-k3.md §2.3) ---
    _role("proj.fc1", "mm_projector.proj.0.weight", "Dm Dm", "bf16", Scope.GLOBAL, section=Section.PROJECTOR),
    _role("proj.fc2", "mm_projector.proj.2.weight", "D Dm", "bf16", Scope.GLOBAL, section=Section.PROJECTOR),
    _role("proj.post_norm", "mm_projector.post_norm.weight", "D", "bf16", Scope.GLOBAL, section=Section.PROJECTOR),
)

ROLE_BY_NAME: dict[str, Role] = {r.role: r for r in ROLES}
assert len(ROLE_BY_NAME) == len(ROLES), "duplicate role name"

# Stored parts of an MXFP4 pair: (part, name suffix, stored dtype).
MXFP4_PARTS = (("packed", ".weight_packed", "U8"), ("scale", ".weight_scale", "U8"))
STORED_DTYPE = {Format.BF16: "BF16", Format.F32: "F32"}


def dimensions(text: TextConfig, vision: VisionConfig | None) -> dict[str, int]:
    """Resolve the dimension names used in ``ROLES`` from a config (docs/kimi-k3.md §1)."""
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
    "moe.expert.w1": MOE + "experts.w1",
    "moe.expert.w2": MOE + "experts.w2",
    "moe.expert.w3": MOE + "experts.w3",
}
