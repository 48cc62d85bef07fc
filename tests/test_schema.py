"""The tensor schema: full-scale totals from the released config and release names."""

from __future__ import annotations

import pytest

from k3bundle.errors import SchemaError
from k3bundle.presets import preset_config
from k3bundle.schema import Schema


@pytest.fixture(scope="module")
def full(release_config):
    return Schema(release_config)


def test_full_scale_totals(full):
    # numbers from spec/kimi-k3.md §1.4 and §2.1 (CFG-DUMP tensor table, AUDIT byte totals)
    t = full.totals
    assert t.tensors == 497_220
    assert t.stored_bytes == 1_560_860_324_864
    assert t.routed_expert_bytes == 1_446_456_066_048
    assert t.text_params == 2_779_484_478_208
    assert round(t.active_params / 1e9, 2) == 104.19
    assert t.stored_bytes - t.routed_expert_bytes - t.vision_projector_bytes == 113_509_540_864
    assert t.vision_projector_bytes == 894_717_952
    assert round(t.vision_params / 1e6, 1) == 401.2 and round(t.projector_params / 1e6, 1) == 46.1


def test_enumeration_agrees_with_totals(full):
    n = b = 0
    for spec in full.tensors():
        n += 1
        b += spec.nbytes
    assert (n, b) == (full.totals.tensors, full.totals.stored_bytes)


@pytest.mark.parametrize("name,shape,dtype,role", [
    # hand-copied from spec/kimi-k3.md §2.3-§2.9
    ("language_model.model.embed_tokens.weight", (163840, 7168), "BF16", "embed"),
    ("language_model.lm_head.weight", (163840, 7168), "BF16", "lm_head"),
    ("language_model.model.output_attn_res_proj.weight", (1, 7168), "BF16", "out_res.proj"),
    ("language_model.model.layers.0.mlp.gate_proj.weight", (33792, 7168), "BF16", "dense.gate_proj"),
    ("language_model.model.layers.0.self_attn.A_log", (128,), "F32", "kda.A_log"),
    ("language_model.model.layers.0.self_attn.q_conv1d.weight", (12288, 1, 4), "F32", "kda.q_conv"),
    ("language_model.model.layers.5.self_attn.f_a_proj.weight", (128, 7168), "BF16", "kda.f_a_proj"),
    ("language_model.model.layers.5.self_attn.g_proj.weight", (12288, 7168), "BF16", "kda.g_proj"),
    ("language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight", (576, 7168), "BF16", "mla.kv_a_proj"),
    ("language_model.model.layers.3.self_attn.q_b_proj.weight", (18432, 1536), "BF16", "mla.q_b_proj"),
    ("language_model.model.layers.92.self_attn.kv_b_proj.weight", (24576, 512), "BF16", "mla.kv_b_proj"),
    ("language_model.model.layers.92.self_attn.g_proj.weight", (12288, 7168), "BF16", "mla.g_proj"),
    ("language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias", (896,), "F32", "moe.router_bias"),
    ("language_model.model.layers.1.block_sparse_moe.experts.10.w2.weight_scale", (3584, 96), "U8", "moe.expert.w2"),
    ("language_model.model.layers.1.block_sparse_moe.experts.895.w1.weight_packed", (3072, 1792), "U8", "moe.expert.w1"),
    ("language_model.model.layers.7.block_sparse_moe.experts.0.w3.weight_scale", (3072, 112), "U8", "moe.expert.w3"),
    ("language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight", (7168, 6144), "BF16", "moe.shared.down_proj"),
    ("vision_tower.encoder.blocks.26.wqkv.weight", (4608, 1024), "BF16", "vit.wqkv"),
    ("vision_tower.patch_embed.proj.weight", (1024, 3, 14, 14), "BF16", "vit.patch_embed"),
    ("mm_projector.proj.2.weight", (7168, 4096), "BF16", "proj.fc2"),
])
def test_release_names_shapes_roles(full, name, shape, dtype, role):
    s = full.get(name)
    assert (s.shape, s.dtype, s.role.role) == (shape, dtype, role)


def test_layer_kinds_and_tp_rules(full):
    kda = full.get("language_model.model.layers.0.self_attn.q_proj.weight")
    assert (kda.layer, kda.mixer, kda.ffn, kda.tp_rule) == (0, "kda", "dense", "column by H")
    mla_o = full.get("language_model.model.layers.3.self_attn.o_proj.weight")
    assert (mla_o.role.role, mla_o.mixer, mla_o.tp_rule) == ("mla.o_proj", "mla", "row by Hm")
    assert full.get("language_model.model.layers.5.self_attn.f_a_proj.weight").tp_rule == "replicate"
    assert full.get("language_model.lm_head.weight").tp_rule == "vocab by V"
    w2 = full.get("language_model.model.layers.2.block_sparse_moe.experts.3.w2.weight_packed")
    assert w2.expert == 3 and w2.tp_rule.startswith("expert") and "row by Ie" in w2.tp_rule
    assert w2.logical_shape == (3584, 3072)
    assert w2.pair_name.endswith("experts.3.w2.weight_scale")


def test_g_proj_means_two_roles(full):
    # one checkpoint name, two tensors: the KDA gate and the MLA output gate (spec §2.4)
    roles = {full.get(f"language_model.model.layers.{l}.self_attn.g_proj.weight").role.role for l in (2, 3)}
    assert roles == {"kda.g_proj", "mla.g_proj"}


def test_release_shard_layout(full):
    assert full.num_shards == 96
    assert full.shard_name(1) == "model-00001-of-000096.safetensors"
    names = {full.shard_index(full.get(n)) for n in (
        "language_model.model.layers.0.input_layernorm.weight",)}
    assert names == {1}
    assert full.shard_index(full.get("language_model.model.layers.92.input_layernorm.weight")) == 93
    assert full.shard_index(full.get("language_model.lm_head.weight")) == 94
    assert full.shard_index(full.get("mm_projector.post_norm.weight")) == 95
    vision = list(full.shard_tensors(96))
    assert len(vision) == 165 and all(v.name.startswith("vision_tower.") for v in vision)


def test_text_only_prefix(release_config):
    s = Schema(release_config, prefix="", vision=False)
    assert "lm_head.weight" in s and "model.layers.0.self_attn.A_log" in s
    assert s.totals.tensors == 497_220 - 165 - 3


def test_check_keys_names_unknown_and_missing():
    s = Schema(preset_config("tiny"))
    keys = {t.name for t in s.tensors()}
    s.check_keys(keys)
    keys.discard("language_model.model.layers.4.self_attn.q_proj.weight")
    keys.add("language_model.model.layers.4.self_attn.bogus")
    with pytest.raises(SchemaError) as e:
        s.check_keys(keys, where="ckpt")
    assert str(e.value) == ("ckpt: 1 unknown tensor(s), first 'language_model.model.layers.4.self_attn.bogus'; "
                            "1 missing tensor(s), first 'language_model.model.layers.4.self_attn.q_proj.weight'")
    with pytest.raises(SchemaError, match="not part of the Kimi K3 schema"):
        s.get("language_model.model.layers.99.input_layernorm.weight")


def test_full_depth_preset_has_the_release_tensor_list(full):
    """synth --preset full-depth: the release's every name, dtype and shard (the released
    config's schema is the oracle), A_log padded as released, at narrow widths."""
    narrow = Schema(preset_config("full-depth"))
    want = [(s.name, s.dtype, full.shard_index(s)) for s in full.tensors()]
    got = [(s.name, s.dtype, narrow.shard_index(s)) for s in narrow.tensors()]
    assert got == want and len(got) == narrow.totals.tensors == 497_220
    assert [narrow.shard_name(i) for i in (1, 96)] == [full.shard_name(i) for i in (1, 96)]
    a_log = "language_model.model.layers.0.self_attn.A_log"
    assert narrow.get(a_log).shape == full.get(a_log).shape == (128,)  # 96 (16 here) heads, padded to 128
    assert narrow.totals.stored_bytes < 1.5e9  # "a few GB" at most: about 1.2 GB
