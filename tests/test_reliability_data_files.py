"""Data files a bring-up team passes around (cases, layouts, tolerance files) as a careless or
hostile colleague would write them: every one refused in one line naming the file and key,
before any work."""

from __future__ import annotations

import os
import re
import time

import pytest

from k3bundle.errors import YamlFileError
from k3bundle.golden.cases import MAX_STEPS, MAX_TOKENS, CaseError, TapPlan, load_case, load_cases
from k3bundle.golden.tolerances import load_tolerances, tolerance_path
from k3bundle.golden.errors import ToleranceError
from k3bundle.io.strict_yaml import MAX_ALIASES, read_yaml
from k3bundle.layouts import LayoutError, load_layout
from tests.conftest import REPO, run_cli

TINY_TP2 = REPO / "tests" / "layouts" / "tiny-tp2.yaml"
#: 550 bytes that PyYAML expands to 10^6 strings: nine levels of nine aliases
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdef", "bcdefg"))


@pytest.mark.parametrize("text, problem, key", [
    ("a: 1\nb: {c: 1, c: 2}\n", r"duplicate key b\.c \(lines 2 and 2\)", "b.c"),
    ("added: {default: {nmse: 1}}\nadded: {default: {nmse: 9}}\n", "duplicate key added", "added"),
    (ALIAS_BOMB, f"more than {MAX_ALIASES} aliases", "c.7"),
    ("a: &a [*a]\n", "recursive alias", "a.0"),
    ("a: !!python/object/apply:os.system [ls]\n", "the tag !!python/object/apply:os.system is not allowed", "a"),
    ("a: {b: !!binary aGk=}\n", "the tag !!binary is not allowed", "a.b"),
    ("base: &b {x: 1}\nc: {<<: *b}\n", "merge keys", "c.<<"),
    ("card: {hbm_bytes: .inf}\n", r"card\.hbm_bytes must be a finite number", "card.hbm_bytes"),
])
def test_the_strict_yaml_reader_names_the_file_and_key(tmp_path, text, problem, key):
    p = tmp_path / "data.yaml"
    p.write_text(text)
    with pytest.raises(YamlFileError, match=problem) as e:
        read_yaml(p)
    assert e.value.key == key and str(e.value).startswith(f"{p}: ") and "\n" not in str(e.value)


def test_the_strict_yaml_reader_refuses_non_utf8_fifos_and_huge_files(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(YamlFileError, match=r"not UTF-8 \(byte 9, line 1\)"):
        read_yaml(p)
    os.mkfifo(tmp_path / "fifo.yaml")
    t0 = time.monotonic()
    with pytest.raises(YamlFileError, match="is a FIFO, not a regular file"):
        read_yaml(tmp_path / "fifo.yaml")
    assert time.monotonic() - t0 < 5
    (tmp_path / "big.yaml").write_bytes(b"#" * (5 << 20))
    with pytest.raises(YamlFileError, match="larger than 4 MiB"):
        read_yaml(tmp_path / "big.yaml")
    assert read_yaml(TINY_TP2)["card"]["count"] == 2  # a plain data file reads as before


# ---- tolerance files ------------------------------------------------------------------------


def test_a_second_section_appended_to_a_tolerance_file_is_refused(tmp_path):
    p = tmp_path / "bf16.yaml"
    p.write_text(tolerance_path("bf16").read_text() + "\nadded:\n  default: {nmse: 1.0, cosine: -1.0}\n")
    with pytest.raises(ToleranceError, match=r"bf16\.yaml: duplicate key added \(lines \d+ and \d+\)"):
        load_tolerances(p)


@pytest.mark.parametrize("section, value, problem", [
    ("added:\n  default: {cosine: -5}", "", r"added\.default\.cosine must be from -1 to 1, got -5"),
    ("logits: {top1: 7.0}", "", r"logits\.top1 must be from 0 to 1, got 7\.0"),
    ("added:\n  default: {nmse: -1}", "", r"added\.default\.nmse must be >= 0, got -1"),
    ("router: {expert_set: 1.5}", "", r"router\.expert_set must be from 0 to 1"),
    ("logits: {kld_mean: -0.1}", "", r"logits\.kld_mean must be >= 0"),
    ("added:\n  default: {max_abs: .nan}", "", r"added\.default\.max_abs must be a finite number"),
])
def test_a_limit_outside_its_metrics_range_is_refused(tmp_path, section, value, problem):
    p = tmp_path / "t.yaml"
    p.write_text(f"schema_version: 1\n{section}\n")
    with pytest.raises(ToleranceError, match=problem):
        load_tolerances(p)


def test_the_shipped_tolerance_files_load():
    for name in ("bf16", "fp8", "mxfp4"):
        assert load_tolerances(tolerance_path(name)).added["default"]["nmse"] >= 0


# ---- layouts --------------------------------------------------------------------------------


@pytest.mark.parametrize("edit, problem", [
    (lambda t: t + "parallel: {tp: 1, attention_dp: 1, ep: 1, pp: 2}\n", "duplicate key parallel"),
    (lambda t: t + "card: {name: x, count: 2, hbm_bytes: 1, hbm_bandwidth_bytes_per_s: 1, "
                   "link_bandwidth_bytes_per_s: 1, peak_flops: {bf16: 1}}\n", "duplicate key card"),
    (lambda t: t.replace("3.0e+12", ".nan"), r"card\.hbm_bandwidth_bytes_per_s must be a finite number"),
    (lambda t: t.replace("bf16: 1.0e+15", "bf16: .nan"), r"card\.peak_flops\.bf16 must be a finite number"),
    (lambda t: t.replace("80_000_000_000", ".inf"), r"card\.hbm_bytes must be a finite number"),
    (lambda t: t.replace("80_000_000_000", "1.0e+300"), r"card\.hbm_bytes must be a finite positive number up to"),
    (lambda t: t.replace("1.0e+15", "1.0e+30"), r"card\.peak_flops\.bf16 must be a finite positive number up to"),
    (lambda t: t + "files: {data_alignment: 1099511627776}\n",
     r"files\.data_alignment must be a positive integer up to 1,048,576, got 1099511627776"),
    (lambda t: t + "files: {max_bytes: 1099511627777}\n", r"files\.max_bytes must be a positive integer up to"),
    (lambda t: t.replace("count: 2", "count: 1000000"), r"card\.count must be a positive integer up to 65,536"),
    (lambda t: t + "padding: {V: 100000000}\n", r"padding\.V must be a positive integer multiple up to 65,536"),
])
def test_a_layout_with_duplicate_sections_or_absurd_numbers_is_refused(tmp_path, edit, problem):
    p = tmp_path / "tiny-tp2.yaml"
    p.write_text(edit(TINY_TP2.read_text()))
    with pytest.raises(LayoutError, match=problem):
        load_layout(str(p))


def test_plan_on_a_layout_with_a_nan_card_number_is_one_line_before_any_work(tmp_path):
    p = tmp_path / "tiny-tp2.yaml"
    p.write_text(TINY_TP2.read_text().replace("3.0e+12", ".nan"))
    r = run_cli("plan", "--target", str(p), "--preset", "tiny")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "card.hbm_bandwidth_bytes_per_s" in r.stderr


def test_a_non_utf8_layout_is_one_line(tmp_path):
    p = tmp_path / "tiny-tp2.yaml"
    p.write_bytes(TINY_TP2.read_bytes().replace(b"test card", "t\u00e9st card".encode("latin-1")))
    with pytest.raises(LayoutError, match=r"tiny-tp2\.yaml: not UTF-8"):
        load_layout(str(p))


# ---- golden case files ----------------------------------------------------------------------

CASE = "schema_version: 1\nname: c\nkind: greedy\nprompt: hello\ngenerate: {steps: 2}\ntaps: all\n"


@pytest.mark.parametrize("edit, problem", [
    (lambda t: t.replace("taps: all", "taps: {sample_positions: abc}"),
     r"taps\.sample_positions must be an integer from 0 to 65,536, got 'abc'"),
    (lambda t: t.replace("taps: all", "taps: {sample_positions: -4}"), r"taps\.sample_positions must be an integer"),
    (lambda t: t.replace("taps: all", "taps: {}"), "taps must be 'all' or"),
    (lambda t: t.replace("generate: {steps: 2}", "generate: 5"), "generate must be a mapping, got 5"),
    (lambda t: t.replace("steps: 2", "steps: true"), r"generate\.steps must be an integer from 0 to 4,096, got True"),
    (lambda t: t.replace("steps: 2", "steps: 1000000000"), r"generate\.steps must be an integer from 0 to 4,096"),
    (lambda t: t + "requires: 5\n", "requires must be a list of feature names, got 5"),
    (lambda t: t.replace("prompt: hello", "prompt: 12345"), "prompt must be a string, got 12345"),
    (lambda t: t.replace("name: c", "name: 7"), "name must be a non-empty string, got 7"),
    (lambda t: t.replace("generate: {steps: 2}", "generate: {steps: 2, step: 3}"), r"unknown key generate\.step"),
    (lambda t: t.replace("prompt: hello", "long_context: {target_tokens: 1000000000000}"),
     r"long_context\.target_tokens must be an integer from 1 to 1,048,576"),
    (lambda t: t.replace("prompt: hello", "long_context: {target_tokens: 1e12}"),
     r"long_context\.target_tokens must be an integer from 1 to 1,048,576, got '1e12'"),
    (lambda t: "description: &a [x,x,x,x,x,x,x,x,x]\n" + t.replace("name: c", "name: &n c") + "\n".join(
        f"x{i}: [*a, *a, *a, *a]" for i in range(5)) + "\n", "more than 16 aliases"),
])
def test_a_case_field_of_the_wrong_type_or_range_is_one_line(tmp_path, edit, problem):
    p = tmp_path / "c.yaml"
    p.write_text(edit(CASE))
    with pytest.raises(CaseError, match=problem) as e:
        load_case(p)
    assert str(e.value).startswith(f"{p}: ") and "\n" not in str(e.value)


def test_a_tap_plan_of_only_the_last_positions_taps_those():
    assert TapPlan(False, 0, 3).positions(10) == [7, 8, 9]  # no division by a zero sample count
    assert TapPlan(False, 2, 1).positions(10) == [0, 5, 9]
    assert MAX_STEPS == 4096 and MAX_TOKENS == 1 << 20


def test_the_shipped_cases_load():
    assert {c.kind for c in load_cases()} >= {"greedy", "long_context", "tool_call"}


def _cases_dir(tmp_path, text: str = CASE):
    d = tmp_path / "cases"
    d.mkdir()
    (d / "c.yaml").write_text(text)
    return d


@pytest.mark.parametrize("extra, problem", [
    (["--long-tokens", "-5"], "--long-tokens must be an integer from 1 to 1,048,576"),
    (["--long-tokens", "0"], "context), got 0"),
    (["--long-tokens", "2000000"], "--long-tokens must be an integer from 1 to 1,048,576"),
])
def test_golden_refuses_a_long_context_length_outside_its_range(tiny_ckpt, tmp_path, extra, problem):
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "g"), "--cases", str(_cases_dir(tmp_path)), *extra)
    assert r.returncode == 2 and problem in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "g").exists()


def test_golden_refuses_a_fifo_case_file_and_a_bombed_or_non_utf8_input_before_any_work(tiny_ckpt, tmp_path):
    d = _cases_dir(tmp_path)
    os.mkfifo(d / "z.yaml")
    t0 = time.monotonic()
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "g"), "--cases", str(d))
    assert r.returncode == 2 and re.search(r"z\.yaml: cannot read: is a FIFO", r.stderr), r.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "g").exists()
    (d / "z.yaml").unlink()
    (d / "z.yaml").write_text(ALIAS_BOMB.replace("a:", "description:", 1).replace("*a", "*description")
                              .replace("&a", "&description") + CASE.replace("name: c", "name: z"))
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "g"), "--cases", str(d))
    assert r.returncode == 2 and "aliases" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "g").exists()
    (d / "z.yaml").unlink()
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(tolerance_path("bf16").read_bytes() + "\n# caf\u00e9\n".encode("latin-1"))
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "g"), "--cases", str(d), "--tolerances", str(bad))
    assert r.returncode == 2 and "latin1.yaml: not UTF-8" in r.stderr, r.stderr
    assert not (tmp_path / "g").exists()


def test_golden_refuses_a_case_longer_than_the_models_context_before_any_forward(tiny_ckpt, tmp_path):
    d = tmp_path / "cases"
    d.mkdir()
    (d / "long_context.yaml").write_text((REPO / "golden" / "cases" / "long_context.yaml").read_text())
    r = run_cli("golden", str(tiny_ckpt), "--out", str(tmp_path / "g"), "--cases", str(d), "--long-tokens", "70000")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert re.search(r"long_context\.yaml: 7\d,\d{3} prompt tokens \+ 8 steps exceed the model's context, "
                     r"max_position_embeddings 65,536 in .*config\.json", r.stderr), r.stderr
    assert not (tmp_path / "g").exists()
