"""Layout files: the shipped ones load, and every layout-level rule rejects with its name."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from k3bundle.layouts import (
    LayoutError, find_layout, layout_dirs, layout_names, load_layout, parse_layout,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ["b200-tp8-pp2", "b300-tp8", "gb300-dep16", "h200-tp16-ep16", "mi355x-tp8", "new-accelerator.example"]


def _raw(name: str) -> dict:
    return yaml.safe_load((REPO / "layouts" / f"{name}.yaml").read_text())


def test_shipped_layouts_are_found_repo_root_first():
    assert set(SHIPPED) <= set(layout_names())
    assert layout_dirs()[0] == REPO / "layouts"
    assert find_layout("b300-tp8") == REPO / "layouts" / "b300-tp8.yaml"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_layout_loads_and_round_trips(name):
    lay = load_layout(name)
    assert lay.name == name
    par = lay.parallel
    assert par.tp * par.attention_dp * par.pp == lay.card.count
    assert lay.card.hbm_bytes > 0 and lay.card.peak_flops and lay.card.hbm_bandwidth_bytes_per_s > 0
    # the resolved form parses back to the same layout (it is what a bundle stores)
    resolved = lay.resolved(93)
    again = parse_layout(yaml.safe_load(resolved.to_yaml()), "resolved")
    assert again.to_dict() == resolved.to_dict()
    assert again.to_yaml() == resolved.to_yaml()


@pytest.mark.parametrize("name", [n for n in SHIPPED if "example" not in n])
def test_card_numbers_cite_a_public_source(name):
    lines = (REPO / "layouts" / f"{name}.yaml").read_text().splitlines()
    for field in ("hbm_bytes:", "hbm_bandwidth_bytes_per_s:", "link_bandwidth_bytes_per_s:", "peak_flops:"):
        i = next(i for i, line in enumerate(lines) if line.strip().startswith(field))
        above = lines[i - 1].strip()
        assert above.startswith("#"), (name, field)
        # the comment names where the number comes from (a vendor datasheet / spec page), or points up to it
        block = " ".join(line for line in lines[max(0, i - 4): i] if line.strip().startswith("#"))
        assert re.search(r"datasheet|spec|product page|same page|NVIDIA|AMD", block), (name, field, block)


def _expect(data: dict, *rules: str) -> LayoutError:
    with pytest.raises(LayoutError) as e:
        parse_layout(data, "test.yaml")
    for rule in rules:
        assert rule in e.value.rules, (rule, str(e.value))
        assert f"[{rule}]" in str(e.value)
    return e.value


def test_cards_must_match_degrees():
    d = _raw("b200-tp8-pp2")
    d["card"]["count"] = 8
    err = _expect(d, "cards-match-degrees")
    assert "tp (8) x attention_dp (1) x pp (2) = 16 must equal card.count (8)" in str(err)


def test_ep_must_divide_stage_ranks():
    d = _raw("h200-tp16-ep16")
    d["parallel"]["ep"] = 32
    err = _expect(d, "ep-divides-stage")
    assert "ep (32)" in str(err) and "= 16" in str(err)


def test_moe_tp_given_must_agree():
    d = _raw("b300-tp8")
    d["parallel"]["moe_tp"] = 4
    _expect(d, "ep-divides-stage")


def test_expert_placement_must_be_known():
    d = _raw("b300-tp8")
    d["parallel"]["expert_placement"] = "co-occurrence"
    _expect(d, "expert-placement")


def test_unknown_format_and_scale_rule():
    d = _raw("b300-tp8")
    d["formats"] = {"moe.expert.*": "int4", "dense.*": {"format": "mxfp4-from-bf16"}, "*": "source"}
    err = _expect(d, "format-name")
    assert "int4" in str(err) and "scale_rule" in str(err)


def test_format_pattern_must_match_a_role():
    d = _raw("b300-tp8")
    d["formats"] = {"kda.qproj": "fp8-e4m3-channel", "*": "source"}
    _expect(d, "format-pattern-unused")


@pytest.mark.parametrize("fmt,pattern,why", [
    ("nvfp4", "kda.q_proj", "needs an MXFP4 source"),
    ("fp8-e4m3-channel", "kda.dt_bias", "quantizes BF16 weights"),
    ("fp8-e4m3-block128", "final_norm", "2-D linear weights"),
    ("mxfp4", "dense.up_proj", "use mxfp4-from-bf16"),
    ("bf16", "kda.A_log", "is stored f32"),
])
def test_format_must_fit_the_roles_source(fmt, pattern, why):
    d = _raw("b300-tp8")
    d["formats"] = {pattern: fmt, "*": "source"}
    err = _expect(d, "format-source-dtype")
    assert why in str(err)


def test_padding_rules():
    d = _raw("b300-tp8")
    d["padding"] = {"H": 16, "Ie": 48}
    err = _expect(d, "padding-dim", "padding-mxfp4-block")
    assert "padding.Ie (48)" in str(err)


def test_pp_layers_must_match_pp():
    d = _raw("b200-tp8-pp2")
    d["parallel"]["pp_layers"] = [40, 30, 23]
    _expect(d, "pp-covers-layers")


def test_numbers_given_as_strings_get_a_hint():
    d = _raw("b300-tp8")
    d["card"]["hbm_bandwidth_bytes_per_s"] = "8.0e12"
    err = _expect(d, "layout-field")
    assert "8.0e+12" in str(err)


def test_unknown_fields_and_every_problem_at_once():
    d = copy.deepcopy(_raw("b300-tp8"))
    d["card"]["hbm_gb"] = 288
    d["parallel"]["ep"] = 3
    d["scale_layout"] = "swizzled"
    err = _expect(d, "layout-field", "ep-divides-stage")
    assert "card.hbm_gb" in str(err) and "swizzled" in str(err)


def test_unknown_layout_lists_the_available_ones():
    with pytest.raises(LayoutError) as e:
        load_layout("b300-tp9")
    assert "b300-tp8" in str(e.value) and "h200-tp16-ep16" in str(e.value)


def test_layout_name_must_match_file(tmp_path):
    d = _raw("b300-tp8")
    p = tmp_path / "layouts-copy.yaml"
    p.write_text(yaml.safe_dump(d))
    assert load_layout(str(p)).name == "b300-tp8"  # a path may hold any name
