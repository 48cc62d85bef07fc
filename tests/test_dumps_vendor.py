"""An external runtime's dumps, written as a vendor would (numpy and the safetensors layout, no
k3bundle on the writing side), with exactly the required taps: the golden values rounded to
BF16 or F16 pass on every shipped case; one layer's output scaled by 1.01 is located to that
layer and tap (KDA, MLA and MoE layers); ``--cases`` judges a subset; every dump problem is
listed at once. docs/dump-format.md's tap table is the tap table, its shapes the goldens', and
its example writer (docs/examples/write_dumps.py, numpy and zstandard only) runs end to end."""

from __future__ import annotations

import ast
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from k3bundle.config import load_config
from k3bundle.executor.taps import SPEC, TAPS, tap_table_markdown
from k3bundle.golden.generate import generate_goldens
from k3bundle.golden.store import read_meta, read_npz
from k3bundle.validate.run import validate
from k3bundle.validate.device_options import open_device
from tests._docs import block
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_trained_ckpt) -> Path:
    """The trained tiny (its files linked) with goldens over every shipped case in validation/."""
    root = tmp_path_factory.mktemp("vendor") / "tiny-trained"
    root.mkdir()
    for f in tiny_trained_ckpt.iterdir():
        if f.name != "validation":
            (root / f.name).symlink_to(f)
    generate_goldens(root, out=root / "validation", long_tokens=300)
    return root


def _cases(ckpt: Path) -> dict[str, dict[str, np.ndarray]]:
    inter = read_npz(ckpt / "validation" / "golden_intermediates.npz")
    ran = [e["name"] for e in read_meta(inter)["cases"] if e.get("status") == "ok"]
    return {c: {k[len(c) + 1:]: v for k, v in inter.items() if k.startswith(c + "/")} for c in ran}


def _required(num_layers: int) -> list[str]:
    """The required taps, read off the tap table as docs/dump-format.md states them."""
    per_layer = [s.kind for s in TAPS if s.in_dump and s.where == "layer"]
    once = [s.kind for s in TAPS if s.in_dump and s.where == "model"]
    return [f"layers.{l}.{k}" for l in range(num_layers) for k in per_layer] + once


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns, round to nearest even (finite values)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    """The safetensors layout by hand: u64 header length, JSON header, raw little-endian bytes."""
    header, blobs, offset = {}, [], 0
    for name, x in tensors.items():
        if dtype == "BF16":
            raw = _bf16_bits(x).tobytes()
        else:
            raw = np.ascontiguousarray(x, dtype=np.float16 if dtype == "F16" else np.float32).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _dumps(ckpt: Path, out: Path, dtype: str, scale: str | None = None, cases=None) -> Path:
    """One file per case: the required taps of the goldens in ``dtype``; ``scale``: that tap x 1.01."""
    out.mkdir()
    layers = load_config(ckpt).text.num_hidden_layers
    for case, golden in _cases(ckpt).items():
        if cases is not None and case not in cases:
            continue
        taps = {n: golden[n].astype(np.float32) * (np.float32(1.01) if n == scale else np.float32(1))
                for n in _required(layers)}
        _write_safetensors(out / f"{case}.safetensors", taps, dtype)
    return out


def _judge(ckpt: Path, dumps: Path):
    rep = validate(ckpt, open_device(ckpt, dumps=dumps))
    return rep, {c.name: c for c in rep.cases}


def test_the_required_taps_are_the_mixer_and_ffn_outputs_final_hidden_and_logits():
    assert _required(2) == ["layers.0.mixer_out", "layers.0.ffn_out", "layers.1.mixer_out", "layers.1.ffn_out",
                            "final_hidden", "logits"]
    assert not SPEC["router_ids"].in_dump  # the emulation must cope without the device's expert choice


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_golden_values_rounded_with_required_taps_only_pass_every_case(ckpt, tmp_path, dtype):
    rep, cases = _judge(ckpt, _dumps(ckpt, tmp_path / "d", dtype))
    judged = set(_cases(ckpt))
    assert {n for n, c in cases.items() if c.status == "pass"} == judged, \
        {n: (c.status, c.first_failure and c.first_failure.tap) for n, c in cases.items()}
    assert len(judged) >= 4 and rep.passed
    # the short cases are judged layer by layer by the emulation, not only end to end
    greedy = cases["greedy"]
    assert any(r.mode == "emulation" and r.tap == "layers.1.ffn_out" for r in greedy.results)


def _layer(ckpt: Path, kind: str) -> int:
    """A layer of that kind past the first block, so a fault has layers above it."""
    text = load_config(ckpt).text
    pick = {"kda": lambda l: not text.is_mla(l), "mla": text.is_mla, "moe": text.is_moe}[kind]
    return [l for l in range(2, text.num_hidden_layers) if pick(l)][0]


@pytest.mark.parametrize("kind,tap", [("kda", "mixer_out"), ("mla", "mixer_out"), ("moe", "ffn_out")])
def test_one_scaled_layer_output_is_located_to_that_layer_and_tap(ckpt, tmp_path, kind, tap):
    name = f"layers.{_layer(ckpt, kind)}.{tap}"
    rep, cases = _judge(ckpt, _dumps(ckpt, tmp_path / "d", "BF16", scale=name))
    assert not rep.passed
    layered = [c for c in cases.values() if c.status != "not run" and not c.layer_checks]
    assert len(layered) >= 3  # every case with every position tapped
    for c in layered:
        ff = c.first_failure
        assert c.status == "fail" and (ff.tap, ff.mode) == (name, "emulation"), (c.name, ff)


def test_cases_judges_a_subset_and_a_dump_of_one_case_is_enough(ckpt, tmp_path):
    d = _dumps(ckpt, tmp_path / "d", "F16", cases={"greedy"})
    r = run_cli("validate", str(ckpt), "--dumps", str(d), "--cases", "greedy", "--json", "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    status = {c["name"]: (c["status"], c["reason"]) for c in json.loads(r.stdout)["cases"]}
    assert status.pop("greedy") == ("pass", "")
    assert set(status.values()) == {("not run", "not selected (--cases)")}
    r = run_cli("validate", str(ckpt), "--dumps", str(d), "--out", str(tmp_path / "r2"))  # all cases: refused
    assert r.returncode == 2 and "missing dump for case" in r.stderr


def test_an_unknown_case_is_one_line_naming_the_known_ones(ckpt, tmp_path):
    r = run_cli("validate", str(ckpt), "--dumps", str(tmp_path), "--cases", "greedy,gredy",
                "--out", str(tmp_path / "r"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "'gredy'" in lines[0] and all(c in lines[0] for c in _cases(ckpt))


def test_every_dump_problem_is_listed_at_once(ckpt, tmp_path):
    d = _dumps(ckpt, tmp_path / "d", "F16")
    (d / "thinking.safetensors").unlink()
    golden = _cases(ckpt)["greedy"]
    taps = {n: golden[n].astype(np.float32) for n in _required(load_config(ckpt).text.num_hidden_layers)}
    del taps["layers.3.ffn_out"]
    taps["layers.2.mixer_out"] = taps["layers.2.mixer_out"][:-1]
    taps["logits"][0, 0] = np.inf
    _write_safetensors(d / "greedy.safetensors", taps, "F16")
    r = run_cli("validate", str(ckpt), "--dumps", str(d), "--out", str(tmp_path / "r"))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and "4 problems" in lines[0] and len(lines) == 5, r.stderr
    found = sorted(lines[1:])
    assert "greedy.safetensors: required tap 'layers.3.ffn_out' is missing" in found[0]
    assert "greedy.safetensors: tensor 'layers.2.mixer_out' has shape" in found[1]
    assert "greedy.safetensors: tensor 'logits' has 1 NaN/Inf value(s)" in found[2]
    assert "thinking.safetensors: missing dump for case 'thinking'" in found[3]
    assert not (tmp_path / "r" / "signoff.json").exists()  # nothing judged, no report


def test_the_dump_format_tap_table_is_the_tap_table():
    assert block("dump-format.md", "taps") == tap_table_markdown(), "rerun `python -m tests._docs`"
    rows = [r.split("|")[1:-1] for r in tap_table_markdown().splitlines()[2:]]
    assert [r[0].strip().strip("`") for r in rows] == [s.name("{l}") for s in TAPS]
    required = [r[0].strip().strip("`") for r in rows if r[3].strip() == "yes"]
    assert _required(1) == [n.replace("{l}", "0") for n in required]


def _rank(shape: str) -> int:
    """``[P, kv_lora_rank + qk_rope_head_dim]`` -> 2."""
    return len(shape[shape.index("[") + 1: shape.index("]")].split(","))


def test_the_documented_tap_shapes_are_the_goldens(ckpt):
    """Each tap's documented shape has the rank of the golden arrays, P being the positions."""
    golden = _cases(ckpt)["greedy"]
    seen = set()
    for name, a in golden.items():
        spec = SPEC.get(name.rsplit(".", 1)[-1])
        if spec is None or name.startswith(("decode", "routes.", "chunk_states.", "bf16_noise.")) or "/" in name:
            continue
        seen.add(spec.kind)
        assert a.ndim == _rank(spec.shape), (name, a.shape, spec.shape)
        if spec.shape.startswith("[P"):
            assert a.shape[0] == golden["positions"].shape[0], name
        assert (a.dtype.kind == "i") == ("int64" in spec.shape), (name, a.dtype)
    assert seen == {s.kind for s in TAPS}


EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "write_dumps.py"


def test_the_example_writer_imports_no_k3bundle():
    mods = {a.name for n in ast.walk(ast.parse(EXAMPLE.read_text())) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(ast.parse(EXAMPLE.read_text())) if isinstance(n, ast.ImportFrom)}
    assert mods == {"__future__", "io", "json", "struct", "sys", "pathlib", "numpy", "zstandard"}


def _example(*args: str) -> None:
    r = subprocess.run([sys.executable, "-I", str(EXAMPLE), *args], capture_output=True, text=True, cwd="/")
    assert r.returncode == 0, r.stderr


def test_the_documented_example_passes_and_locates_a_planted_fault(ckpt, tmp_path):
    """docs/dump-format.md's example end to end: its dumps of the goldens in BF16 pass every case;
    its ``--scale`` of one MoE layer's output by 1.01 is located to that layer and tap."""
    _example(str(ckpt / "validation"), str(tmp_path / "ok"))
    assert sorted(p.stem for p in (tmp_path / "ok").iterdir()) == sorted(_cases(ckpt))
    rep, cases = _judge(ckpt, tmp_path / "ok")
    assert rep.passed and {n for n, c in cases.items() if c.status == "pass"} == set(_cases(ckpt)), \
        {n: (c.status, c.first_failure and c.first_failure.tap) for n, c in cases.items()}
    name = f"layers.{_layer(ckpt, 'moe')}.ffn_out"
    _example(str(ckpt / "validation"), str(tmp_path / "bad"), "--scale", f"{name}=1.01")
    rep, cases = _judge(ckpt, tmp_path / "bad")
    layered = [c for c in cases.values() if c.status != "not run" and not c.layer_checks]
    assert not rep.passed and len(layered) >= 3
    for c in layered:
        assert c.status == "fail" and (c.first_failure.tap, c.first_failure.mode) == (name, "emulation"), c.name
