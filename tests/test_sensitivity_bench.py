"""bench/sensitivity.py's parts: the perturbation is the size it claims and touches one tensor,
an in-place perturbation always gives the checkpoint its bytes back, and a run is classified
(located / end to end only / elsewhere) as docs/validation.md "Sensitivity" reads it."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sensitivity.py"
spec = importlib.util.spec_from_file_location("sensitivity", BENCH)
sensitivity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sensitivity)


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _digest(ckpt: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(ckpt.glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()


@pytest.fixture()
def ckpt(tiny_trained_ckpt, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_trained_ckpt, dst)
    return dst


def _q_proj(ckpt: Path) -> str:
    from k3bundle.config import load_config
    from k3bundle.schema import Schema
    schema = Schema(load_config(ckpt), vision=False)
    return sensitivity.tensor_name(schema, "kda.q_proj", sensitivity.candidates(schema, "kda.q_proj")[0])


def test_a_copy_changes_one_tensor_by_the_relative_size_it_reports(ckpt, tmp_path):
    name, before = _q_proj(ckpt), _digest(ckpt)
    achieved = sensitivity.perturbed_copy(ckpt, tmp_path / "copy", name, 0.1, torch.Generator().manual_seed(0))
    old, new = _tensors(ckpt), _tensors(tmp_path / "copy")
    assert _digest(ckpt) == before  # the clean checkpoint is untouched (its files are linked, not edited)
    assert [k for k in old if not torch.equal(old[k], new[k])] == [name]
    w, w2 = old[name].double(), new[name].double()
    rel = float((w2 - w).norm() / w.norm())  # recomputed here, in float64, from the two files
    assert rel == pytest.approx(achieved, rel=1e-12)
    assert 0.08 < rel < 0.12  # ε = 0.1 of rms(W) per element, Frobenius-relative ≈ ε
    assert new[name].dtype == old[name].dtype
    assert json.loads((tmp_path / "copy" / sensitivity.INDEX).read_text()) == json.loads((ckpt / sensitivity.INDEX).read_text())


def test_an_in_place_perturbation_is_undone_even_when_the_run_fails(ckpt):
    name, before = _q_proj(ckpt), _digest(ckpt)
    with pytest.raises(RuntimeError):
        with sensitivity.perturbed_in_place(ckpt, name, 0.1, torch.Generator().manual_seed(0)) as achieved:
            assert _digest(ckpt) != before and achieved > 0.05
            raise RuntimeError("the judge failed")
    assert _digest(ckpt) == before
    assert not list(ckpt.parent.glob("*.clean")) and not list(ckpt.parent.glob("*.perturbed"))


def _rec(layer, *firsts):
    return {"layer": layer, "cases": [{"case": f"c{i}", "status": "fail" if f else "pass", "first": f}
                                      for i, f in enumerate(firsts)]}


def test_a_run_is_classified_by_its_first_failures():
    here = {"mode": "added", "tap": "layers.5.mixer_out", "layer": 5}
    there = {"mode": "added", "tap": "layers.6.mixer_out", "layer": 6}
    logits = {"mode": "distribution", "tap": "step_logits", "layer": None}
    free = {"mode": "inherited", "tap": "layers.5.mixer_out", "layer": 5}  # free-running: locates nothing
    assert sensitivity.located(_rec(5, here)) and not sensitivity.mislocated(_rec(5, here))
    assert sensitivity.located(_rec(5, logits, here))  # one case locating it is enough
    assert sensitivity.mislocated(_rec(5, there)) and not sensitivity.end_to_end_only(_rec(5, there))
    assert sensitivity.end_to_end_only(_rec(5, logits)) and sensitivity.end_to_end_only(_rec(5, free))
    assert not any(f(_rec(5, None)) for f in (sensitivity.detected, sensitivity.located, sensitivity.mislocated,
                                              sensitivity.end_to_end_only))
