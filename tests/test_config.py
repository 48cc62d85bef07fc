"""config.json parsing: the release parses, every preset parses, bad fields are named."""

from __future__ import annotations

import copy
import json

import pytest

from k3bundle.config import parse_config
from k3bundle.errors import ConfigError
from k3bundle.presets import preset_config, preset_names
from tests.conftest import run_cli


def test_release_config_values(release_config):
    t = release_config.text
    # spec §1.2: 0-based MLA layers are 3, 7, ..., 91 and the trailing 92
    assert t.mla_layers == list(range(3, 92, 4)) + [92]
    assert len(t.kda_layers) == 69 and 0 in t.kda_layers
    assert t.moe_layers == list(range(1, 93))
    assert t.block_openings == [0, 12, 24, 36, 48, 60, 72, 84]
    assert t.a_log_len == 128 and t.mxfp4_group == 32
    assert t.quantization_config.format == "mxfp4-pack-quantized"
    assert release_config.eos_token_id == 163586
    assert release_config.vision.qkv_hidden_size == 1536


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_presets_parse_and_keep_release_rules(name):
    assert name in preset_names()
    t = preset_config(name).text
    n = t.num_hidden_layers
    assert t.mla_layers == [l for l in range(n) if (l + 1) % 4 == 0 or l == n - 1]
    assert t.mla_layers[-1] == n - 1 and t.mla_layers[-2] == n - 2  # trailing extra MLA layer
    assert not t.is_moe(0) and all(t.is_moe(l) for l in range(1, n))
    assert len(t.block_openings) >= 3


def test_tiny_dimensions_let_every_layout_apply():
    t = preset_config("tiny").text
    assert t.num_hidden_layers >= 9 and t.num_experts_per_token >= 2
    assert t.linear_attn_config.num_heads == 16 and t.num_attention_heads == 16 and t.num_experts == 16
    for w in (t.vocab_size, t.hidden_size, t.intermediate_size, t.moe_intermediate_size,
              t.routed_expert_hidden_size):
        assert w % 16 == 0
    for tp in (2, 4, 8, 16):  # a TP slice of a routed expert is whole 32-element blocks
        assert (t.moe_intermediate_size // tp) % 32 == 0


def _broken(release_config_dict, path, value):
    d = copy.deepcopy(release_config_dict)
    node = d
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


@pytest.mark.parametrize("path,value,needle", [
    (("text_config", "hidden_size"), "7168", "text_config.hidden_size must be an integer, got \"7168\""),
    (("text_config", "num_experts"), KeyError, "required field text_config.num_experts is missing"),
    (("text_config", "rms_norm_eps"), True, "text_config.rms_norm_eps must be a number"),
    (("text_config", "num_key_value_heads"), 7, "num_key_value_heads (7) must divide num_attention_heads (96)"),
    (("vision_config", "vt_num_attention_heads"), 7, "vt_num_attention_heads (7) must divide qkv_hidden_size (1536)"),
    (("text_config", "moe_intermediate_size"), 3000, "group_size (32) must divide moe_intermediate_size (3000)"),
    (("text_config", "linear_attn_config", "full_attn_layers"), [4, 8], "layer 12 (1-based) is in neither"),
    (("text_config", "linear_attn_config", "kda_layers"), [1, 2, 3, 4], "layer 4 is in both"),
    (("text_config", "num_experts_per_token"), 1000, "num_experts_per_token (1000) exceeds num_experts (896)"),
    (("text_config", "linear_attn_config"), None, "text_config.linear_attn_config must be a JSON object, got null"),
    (("model_type",), "llama", "model_type must be \"kimi_k3\""),
    (("eos_token_id",), 999999, "eos_token_id (999999) must lie in 0..vocab_size-1"),
])
def test_bad_fields_are_named(release_config_dict, path, value, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(_broken(release_config_dict, path, value), source="cfg.json")
    msg = str(e.value)
    assert needle in msg and msg.startswith("cfg.json: ") and "\n" not in msg


def test_cli_bad_config_is_one_line_exit_2(tmp_path, release_config_dict):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(_broken(release_config_dict, ("text_config", "hidden_size"), -1)))
    r = run_cli("schema", "--config", str(bad))
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: {bad}: text_config.hidden_size must be positive, got -1"]
    assert r.stdout == ""


def test_cli_malformed_json(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text('{"model_type": "kimi_k3",')
    r = run_cli("schema", "--config", str(bad))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not valid JSON" in lines[0] and str(bad) in lines[0]
