"""k3bundle plan: full-K3 numbers derived by hand, every shape rule by name, capacity, speed."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from k3bundle.config import parse_config
from k3bundle.layouts import LayoutError, load_layout, parse_layout
from k3bundle.plan import make_plan
from k3bundle.plan.files import all_files, device_tensors
from k3bundle.presets import preset_config, preset_config_dict
from tests.conftest import REPO, run_cli

SHIPPED = ["b200-tp8-pp2", "b300-tp8", "gb300-dep16", "h200-tp16-ep16", "mi355x-tp8", "new-accelerator.example"]
EXPERT_PAGE = 17_547_264  # one routed expert, MXFP4: 3 x (5,505,024 packed + 344,064 scale) (spec §2.1)


def _layout(name: str, **parallel) -> dict:
    d = yaml.safe_load((REPO / "layouts" / f"{name}.yaml").read_text())
    d["parallel"].update(parallel)
    return d


def _plan(cfg, data: dict):
    return make_plan(cfg, parse_layout(data, "test"))


def test_full_k3_plans_fast_and_small():
    code = """
import json, resource, time
from k3bundle.config import load_config, release_config_path
from k3bundle.layouts import load_layout
from k3bundle.plan import make_plan
cfg = load_config(release_config_path())
out = {}
for name in %r:
    t = time.monotonic()
    s = make_plan(cfg, load_layout(name)).summary()
    out[name] = [time.monotonic() - t, s["fits"]]
# VmHWM, not ru_maxrss: ru_maxrss survives exec and would include the forking pytest process
out["rss_mb"] = int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
print(json.dumps(out))
""" % (SHIPPED,)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    for name in SHIPPED:
        seconds, fits = got[name]
        assert seconds < 10, (name, seconds)
        assert fits, name
    assert got["rss_mb"] < 2048


def test_ep16_rank_holds_56_experts_of_92_layers(release_config):
    for name in ("h200-tp16-ep16", "gb300-dep16"):
        plan = make_plan(release_config, load_layout(name))
        for groups in plan.rank_breakdown:
            assert groups["routed_experts"] == 56 * 92 * EXPERT_PAGE, name  # 90,403,504,128 bytes


def test_b300_nvfp4_rank_bytes_by_hand(release_config):
    # TP8 inside each expert: w1/w3 keep 384 of 3072 rows, w2 keeps 384 of 3072 columns.
    # NVFP4 per row: packed cols/2 + one E4M3 scale per 16 (+ one f32 global scale per tensor).
    w13 = 384 * (3584 // 2 + 3584 // 16)  # 774,144
    w2 = 3584 * (384 // 2 + 384 // 16)  # 774,144
    per_expert = 2 * w13 + w2 + 3 * 4
    plan = make_plan(release_config, load_layout("b300-tp8"))
    for groups in plan.rank_breakdown:
        assert groups["routed_experts"] == 896 * 92 * per_expert


def test_h200_tp16_slices_by_hand(release_config):
    plan = make_plan(release_config, load_layout("h200-tp16-ep16"))
    rank3 = [t for t in plan.targets if t.rank == 3 and t.layer == 0]
    shapes = {d.name.split("model.layers.0.")[1]: d.shape for t in rank3 for d in device_tensors(plan, t)
              if "model.layers.0." in d.name}
    assert shapes["self_attn.q_proj.weight"] == (12288 // 16, 7168)  # 6 KDA heads x 128
    assert shapes["self_attn.o_proj.weight"] == (7168, 12288 // 16)
    assert shapes["self_attn.A_log"] == (6,)  # heads 18..23, never the zero padding
    assert shapes["self_attn.f_a_proj.weight"] == (128, 7168)  # replicated
    assert shapes["mlp.gate_proj.weight"] == (33792 // 16, 7168)
    a_log = next(t for t in rank3 if t.role.role == "kda.A_log")
    assert (a_log.start, a_log.stop) == (18, 24)


def test_8x_b200_cannot_hold_k3_at_tp8_but_pp2_fits(release_config):
    one_node = _layout("b200-tp8-pp2", pp=1)
    one_node["card"]["count"] = 8
    plan = _plan(release_config, one_node)
    assert not plan.fits
    assert min(plan.rank_bytes) > plan.layout.card.hbm_bytes  # not even with a zero runtime reserve
    two = make_plan(release_config, load_layout("b200-tp8-pp2"))
    assert two.fits and two.stage_layers == (47, 46)
    assert max(two.rank_bytes) < 0.6 * min(plan.rank_bytes)


def _rules(cfg, data) -> list[str]:
    with pytest.raises(LayoutError) as e:
        _plan(cfg, data)
    return e.value.rules


def _card(d: dict, count: int) -> dict:
    d["card"]["count"] = count
    return d


def test_rule_tp_divides_kda_heads(release_config):
    assert "tp-divides-kda-heads" in _rules(release_config, _card(_layout("b300-tp8", tp=64), 64))


def test_rule_tp_divides_mla_heads():
    d = preset_config_dict("tiny")
    d["text_config"]["num_attention_heads"] = d["text_config"]["num_key_value_heads"] = 24
    cfg = parse_config(d)
    assert _rules(cfg, _card(_layout("h200-tp16-ep16"), 16)) == ["tp-divides-mla-heads"]


def test_rule_ep_divides_experts(release_config):
    d = _card(_layout("gb300-dep16", attention_dp=48, ep=48), 48)
    assert _rules(release_config, d) == ["ep-divides-experts"]


def test_rule_mxfp4_slice_on_block(release_config):
    d = _card(_layout("gb300-dep16", attention_dp=64, ep=1), 64)  # moe_tp 64: 3072 / 64 = 48 columns
    rules = _rules(release_config, d)
    assert rules == ["mxfp4-slice-on-block"]


def test_rule_moe_tp_divides_expert_intermediate():
    d = _card(_layout("gb300-dep16", attention_dp=3, ep=1), 3)
    assert _rules(preset_config("tiny"), d) == ["moe-tp-divides-expert-intermediate"]


def test_rule_padding_on_mxfp4_blocks():
    d = yaml.safe_load((REPO / "layouts" / "new-accelerator.example.yaml").read_text())
    d["padding"] = {"S": 100}  # shared experts are MXFP4-from-BF16 here: 256 -> 300 columns per rank
    assert "padding-mxfp4-block" in _rules(preset_config("tiny"), d)


def test_rule_dense_and_vocab_divisibility():
    d = preset_config_dict("tiny")
    d["text_config"]["intermediate_size"] = 520
    d["text_config"]["vocab_size"] = 1032
    rules = _rules(parse_config(d), _layout("h200-tp16-ep16"))
    assert set(rules) == {"tp-divides-dense-intermediate", "tp-divides-vocab"}


def test_rule_pp_covers_layers(release_config):
    assert "pp-covers-layers" in _rules(release_config, _layout("b200-tp8-pp2", pp_layers=[50, 50]))
    tiny16 = _card(_layout("b300-tp8", tp=1, pp=16, ep=1), 16)
    assert "pp-covers-layers" in _rules(preset_config("tiny"), tiny16)


def test_rules_that_need_the_source_shard_map():
    cfg = preset_config("tiny")
    lay = load_layout("b300-tp8")  # ep 1: every rank stacks all 16 experts of a layer

    def split_experts(spec):  # a checkpoint whose layer-1 experts sit in two files
        return "b.safetensors" if spec.layer == 1 and (spec.expert or 0) >= 3 else "a.safetensors"
    with pytest.raises(LayoutError) as e:
        make_plan(cfg, lay, shard_of=split_experts)
    assert e.value.rules == ["stack-experts-one-shard"]

    def split_pair(spec):
        return "b.safetensors" if spec.part == "scale" else "a.safetensors"
    with pytest.raises(LayoutError) as e:
        make_plan(cfg, lay, shard_of=split_pair)
    assert "parts-in-one-shard" in e.value.rules


def test_plan_from_source_equals_plan_from_config(tiny_ckpt):
    from k3bundle.plan import plan_for_source
    from k3bundle.checkpoint import SourceCheckpoint

    lay = load_layout("b200-tp8-pp2")
    with SourceCheckpoint(tiny_ckpt) as src:
        a = plan_for_source(src, lay)
    b = make_plan(preset_config("tiny"), lay)
    assert a.targets == b.targets and a.rank_bytes == b.rank_bytes


def test_rank_bytes_equal_the_device_files(tiny_ckpt):
    plan = make_plan(preset_config("tiny"), load_layout("b300-tp8"))
    per_rank = [0] * len(plan.ranks)
    for f in all_files(plan):
        per_rank[f.rank] += sum(d.nbytes for d in f.tensors)
    assert per_rank == plan.rank_bytes


def test_cli_plan_text_json_and_exit_code(tmp_path, release_config_dict):
    r = run_cli("plan", "--target", "b200-tp8-pp2", "--preset", "full")
    assert r.returncode == 0, r.stderr
    assert "FITS" in r.stdout and "[47, 46]" in r.stdout
    r = run_cli("plan", "--target", "h200-tp16-ep16", "--preset", "full", "--json")
    s = json.loads(r.stdout)
    assert s["schema_version"] == 1 and s["fits"] and len(s["ranks"]) == 16
    one_node = _layout("b200-tp8-pp2", pp=1)
    one_node["card"]["count"] = 8
    (tmp_path / "b200-tp8.yaml").write_text(yaml.safe_dump(one_node))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(release_config_dict))
    r = run_cli("plan", "--target", str(tmp_path / "b200-tp8.yaml"), "--config", str(cfg))
    assert r.returncode == 1 and "DOES NOT FIT" in r.stdout
    r = run_cli("plan", "--target", "b300-tp8", "--preset", "tiny", "--tensors", "--json")
    doc = json.loads(r.stdout)
    assert len(doc["tensors"]) == sum(len(f.tensors) for f in all_files(
        make_plan(preset_config("tiny"), load_layout("b300-tp8"))))
    r = run_cli("plan", "--target", "b300-tp9", "--preset", "tiny")
    assert r.returncode == 2 and "available:" in r.stderr


def test_cli_rejects_a_broken_layout_naming_the_rule(tmp_path):
    d = copy.deepcopy(_card(_layout("b300-tp8", tp=64), 64))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(d))
    r = run_cli("plan", "--target", str(tmp_path / "bad.yaml"), "--preset", "full")
    assert r.returncode == 2
    assert "[tp-divides-kda-heads] tp (64) must divide the KDA heads H (96" in r.stderr
