"""The fault catalogue's faults of a kernel, a weight and a router, each located on the tiny model.

Planted in a copy of a clean bundle (one NaN weight, a router bias with its sign flipped) or in
the device's run of it (SiLU in place of SiTU in one layer's experts, the KDA state carried
wrongly across a chunk boundary, a conv state not advanced, the L2 norm missing in decode),
validate's first failure names the layer and tap where the fault was planted. The places are
written out here from the tiny model's layer kinds (KDA 0, 1, 2, 4, 5, 6; MLA 3, 7, 8; MoE
1-8), not read back from the catalogue.
"""

from __future__ import annotations

import shutil

import pytest

from k3bundle.calibrate import device_faults, jobs
from k3bundle.calibrate.faults import CHUNKED_CASE
from k3bundle.config import load_config
from k3bundle.file_names import GOLDEN_INTERMEDIATES, VALIDATION_DIR
from k3bundle.validate.findings import TEACHER_FORCED
from tests.conftest import REPO

PLACES = {
    "silu_experts": (6, "layers.6.ffn_out"),
    "kda_chunk_carry": (6, "layers.6.mixer_out"),
    "conv_state_stuck": (5, "decode.layers.5.mixer_out"),
    "l2norm_missing_decode": (1, "decode.layers.1.mixer_out"),
    "nan_weight": (3, "layers.3.mixer_out"),
    "router_bias_sign": (5, "layers.5.router_ids"),
}


@pytest.fixture(scope="module")
def clean(tiny_ckpt, tmp_path_factory):
    """A b300-tp8 bundle of the tiny model with goldens of the greedy case (a 30-token prompt,
    one KDA chunk) and the thinking case (260 tokens, five chunks)."""
    from k3bundle.convert import convert
    from k3bundle.golden.generate import generate_goldens
    from k3bundle.golden.store import read_npz

    root = tmp_path_factory.mktemp("faults")
    cases = root / "cases"
    cases.mkdir()
    for name in ("greedy", CHUNKED_CASE):
        shutil.copy(REPO / "golden" / "cases" / f"{name}.yaml", cases)
    bundle = root / "bundle"
    convert(tiny_ckpt, "b300-tp8", bundle, workers=1)
    generate_goldens(bundle, cases_dir=cases)
    return bundle, read_npz(bundle / VALIDATION_DIR / GOLDEN_INTERMEDIATES)


def test_the_clean_bundle_passes_both_cases(clean):
    reps, _ = jobs.judge(clean[0], "cpu", None)
    assert {r.name: r.status for r in reps} == {"greedy": "pass", CHUNKED_CASE: "pass"}


@pytest.mark.parametrize("name", PLACES)
def test_each_fault_is_located_where_it_was_planted(clean, tmp_path, name):
    bundle, golden = clean
    [rec] = jobs.judge_fault(bundle, golden, name, "cpu", None, tmp_path / "copy", seed=0)
    assert (rec["planted"]["layer"], rec["planted"]["tap"]) == PLACES[name]
    assert rec["status"] == "fail", rec
    ff = rec["first_failure"]
    assert (ff["layer"], ff["tap"]) == PLACES[name], ff
    assert ff["mode"] in TEACHER_FORCED  # a layer judged on golden inputs: the error is its own
    assert not (tmp_path / "copy").exists()  # a bundle fault's copy is removed


def test_the_chunk_carry_fault_spares_a_prompt_within_one_chunk(clean):
    """Only a chunk boundary is wrong: the greedy case (30 tokens) passes on the faulted device."""
    side, _ = device_faults.kda_chunk_carry(load_config(clean[0]).text)
    reps, _ = jobs.judge(clean[0], "cpu", ["greedy"], side=side)
    assert reps[0].status == "pass", reps[0].first_failure
