"""Judging rules, on hand-made check results (no model): which failure is named first, when a
greedy divergence is a near tie, and how far each check is from its limit and from the
calibrated clean worst. Every expected number is worked out by hand below."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3bundle.golden.noise import near_tie_margin, noise_key
from k3bundle.golden.tolerances import ToleranceError, load_tolerances
from k3bundle.validate.compare import TapResult, compare_greedy
from k3bundle.validate.margin import margins
from k3bundle.validate.run import CaseReport, _finish
from k3bundle.validate.report import to_json, to_markdown
from k3bundle.validate.run import Report


def _r(tap, mode, value, limit, metric="nmse"):
    passed = value <= limit if metric != "cosine" else value >= limit
    return TapResult("c", tap, mode, {metric: value}, {metric: limit}, passed, {} if passed else {metric: value})


@pytest.fixture
def tol(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("schema_version: 1\nformat: t\nadded: {default: {nmse: 3.0e-4, cosine: 0.9995}}\n"
                 "state: {drift_nmse: 5.0e-2}\ngreedy: {near_tie_margin: 0.25}\nnoise: {factor: 4.0}\n"
                 "calibration:\n  run: hand-made\n  clean_worst: {added/mixer_out/nmse: 1.0e-4, "
                 "added/mixer_out/cosine: 0.9998, state/kda_state/drift_nmse: 1.0e-2}\n")
    return load_tolerances(p)


def test_a_teacher_forced_failure_is_named_before_an_earlier_inherited_one(tol):
    # an inherited failure at layer 0 carries error from nowhere we can see; the teacher-forced
    # failure at layer 2 is where a layer itself went wrong, so it is the one named
    rep = CaseReport("c", "greedy", "fail", results=[_r("layers.0.mixer_out", "inherited", 1.0, 0.02),
                                                     _r("layers.2.mixer_out", "added", 1e-2, 3e-4)])
    _finish(rep, tol)
    assert rep.status == "fail" and rep.first_failure.tap == "layers.2.mixer_out"
    assert rep.first_failure.mode == "added"


def test_state_drift_alone_names_its_layer(tol):
    rep = CaseReport("c", "greedy", "fail", results=[_r("layers.1.mixer_out", "inherited", 1e-3, 0.02)],
                     drift={"decode_states.layers.4.kda_state": [1e-3, 0.2, 0.1],
                            "decode_states.layers.6.kda_state": [0.3]},
                     drift_limit=0.05)
    _finish(rep, tol)
    ff = rep.first_failure
    assert rep.status == "fail" and ff.tap == "decode_states.layers.4.kda_state" and ff.layer == 4
    assert ff.mode == "state" and ff.values["drift_nmse"] == 0.2 and ff.values["step"] == 1.0


def test_greedy_near_tie_margin_widens_with_the_references_own_logit_shift():
    golden = {noise_key("logit_shift", "step_logits"): np.array([0.01, 0.5])}
    assert near_tie_margin(0.25, golden, 0, 4.0) == 0.25  # 4 × 2 × 0.01 = 0.08 < 0.25: the file's
    assert near_tie_margin(0.25, golden, 1, 4.0) == 4.0  # 4 × 2 × 0.5
    assert near_tie_margin(0.25, golden, 1, 0.0) == 0.25  # no noise rule
    assert near_tie_margin(0.25, {}, 1, 4.0) == 0.25  # goldens without noise
    logits = torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.0, 0.0]])  # step 1: gap 1.0
    g = compare_greedy([0, 0], [0, 1], logits, None, lambda step: near_tie_margin(0.25, golden, step, 4.0))
    assert g.first_divergence == 1 and g.gap == 1.0 and g.margin == 4.0 and g.passed
    g = compare_greedy([0, 0], [0, 1], logits, None, lambda step: 0.25)
    assert not g.passed and not g.near_tie


def test_margins_against_limit_and_calibrated_clean_worst(tol):
    rep = CaseReport("c", "greedy", "pass",
                     results=[TapResult("c", "layers.3.mixer_out", "added", {"nmse": 2e-4, "cosine": 0.9996},
                                        {"nmse": 3e-4, "cosine": 0.9995}, True,  # nmse: 2.5 x 1.2e-4 beat 2.5e-4
                                        basis={"nmse": {"fixed": 2.5e-4, "noise": 1.2e-4, "factor": 2.5}}),
                              _r("layers.4.ffn_out", "added", 1e-5, 3e-4)],
                     drift={"decode_states.layers.0.kda_state": [0.045]}, drift_limit=0.05)
    rows = {(m.tap, m.metric): m for m in margins(rep, tol)}
    # ffn_out at 1e-5 / 3e-4 = 3% of its limit is not listed (below NEAR = 50%)
    assert set(rows) == {("layers.3.mixer_out", "nmse"), ("layers.3.mixer_out", "cosine"),
                         ("decode_states.layers.0.kda_state", "drift_nmse")}
    m = rows["layers.3.mixer_out", "nmse"]
    assert m.use == pytest.approx(2e-4 / 3e-4) and m.beyond_clean == pytest.approx(2.0)  # 2e-4 / 1e-4
    c = rows["layers.3.mixer_out", "cosine"]
    assert c.use == pytest.approx(0.0004 / 0.0005) and c.beyond_clean == pytest.approx(0.0004 / 0.0002)
    d = rows["decode_states.layers.0.kda_state", "drift_nmse"]
    assert d.use == pytest.approx(0.9) and d.beyond_clean == pytest.approx(4.5)
    assert [x.use for x in margins(rep, tol)] == sorted([x.use for x in margins(rep, tol)], reverse=True)
    report = Report("b", "device", "cpu", tol, [rep], {})
    md = to_markdown(report)
    assert "limits calibrated: hand-made" in md and "| added nmse | `layers.3.mixer_out` | 0.0002 | 0.0003 | 2.5 × noise 1.20e-04 | 67% | 0.0001 | 2× |" in md
    assert "| added cosine | `layers.3.mixer_out` | 1 − 0.0004 | 1 − 0.0005 | fixed | 80% |" in md
    listed = to_json(report)["cases"][0]["margins"]
    assert listed[0]["tap"] == "decode_states.layers.0.kda_state" and listed[0]["relative_to_clean_worst"] == pytest.approx(4.5)


@pytest.mark.parametrize("body, what", [
    ("calibration: [1]", "calibration must be a mapping"),
    ("calibration: {run: x, clean_worst: {mixer_out: 1.0}}", "is not mode/tap kind/metric"),
    ("calibration: {run: x, clean_worst: {added/mixer_out/snr: 1.0}}", "is not mode/tap kind/metric"),
    ("calibration: {run: x, clean_worst: {added/mixer_out/nmse: .nan}}", "finite"),
    ("calibration: {run: x, limits: {}}", "calibration must be a mapping"),
])
def test_a_bad_calibration_section_is_refused(tmp_path, body, what):
    p = tmp_path / "t.yaml"
    p.write_text(f"schema_version: 1\n{body}\n")
    with pytest.raises(ToleranceError, match=what):
        load_tolerances(p)


def test_the_exact_check_runs_only_on_the_goldens_own_weights_with_its_devices_limits(tmp_path):
    import hashlib
    from k3bundle.golden.store import meta_array, write_npz
    from k3bundle.validate.devices import exact_applies
    bundle, val = tmp_path / "b", tmp_path / "b" / "validation"
    val.mkdir(parents=True)
    (bundle / "manifest.json").write_text('{"a": 1}')
    digest = hashlib.sha256(b'{"a": 1}').hexdigest()

    def goldens(**meta):
        write_npz(val / "golden_inputs.npz", {"__meta__": meta_array(meta)})
    goldens(weights_manifest_sha256=digest, device="cpu")
    assert exact_applies(bundle, val, "cpu") == ("ran", "exact")  # the same arithmetic: clean value 0
    status, section = exact_applies(bundle, val, "cuda")  # a GPU on one side: its measured floor
    assert section == "exact_gpu" and "float32 on cuda against goldens made on cpu" in status
    goldens(weights_manifest_sha256=digest, device="cuda:0")
    assert exact_applies(bundle, val, "cpu")[1] == "exact_gpu"
    assert exact_applies(bundle, val, "cuda")[1] == "exact_gpu"
    goldens(weights_manifest_sha256=digest, device="mps")
    assert exact_applies(bundle, val, "cpu") == ("not run: goldens made on mps, device cpu: no calibrated floor "
                                                 "for that pair", None)
    goldens(weights_manifest_sha256="0" * 64, device="cpu")
    status, section = exact_applies(bundle, val, "cpu")
    assert section is None and "made from other weights" in status
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    goldens(weights_manifest_sha256=None, device="cpu", source=str(ckpt.resolve()))
    assert exact_applies(ckpt, val, "cpu") == ("ran", "exact")
    assert "another checkpoint" in exact_applies(tmp_path, val, "cpu")[0]


def test_added_limits_widen_with_the_references_own_teacher_forced_noise(tmp_path):
    from k3bundle.golden.noise import ADDED
    from k3bundle.validate.judge import layer_checks

    p = tmp_path / "t.yaml"
    p.write_text("schema_version: 1\nformat: t\nadded: {default: {nmse: 5.0e-4}}\n"
                 "emulation: {default: {nmse: 5.0e-4}}\nnoise: {added_factor: 2.5}\n")
    tol = load_tolerances(p)
    ref = torch.ones(4, 8, dtype=torch.float64)
    # NMSE of ref + d against ref is d^2 (ref is all ones): 8e-4 on both taps, a fault (1e-2) on one
    noisy, quiet, fault = ("layers.3.mixer_out", "decode.layers.5.mixer_out", "layers.7.ffn_out")
    outputs = {noisy: ref + 8e-4 ** 0.5, quiet: ref + 8e-4 ** 0.5, fault: ref + 1e-1}
    golden = {noise_key("nmse", ADDED + noisy): np.asarray(4e-4),  # 2.5 x 4e-4 = 1e-3 > 8e-4
              noise_key("nmse", ADDED + quiet): np.asarray(1e-5),  # 2.5e-5 < 5e-4: the fixed limit
              noise_key("nmse", ADDED + fault): np.asarray(1e-4)}
    got = {r.tap: r for r in layer_checks(outputs, lambda n: ref, "c", tol, "added", golden.get, noise=golden)}
    assert got[noisy].passed and got[noisy].limits["nmse"] == pytest.approx(1e-3)
    assert not got[quiet].passed and got[quiet].limits["nmse"] == 5e-4  # never tighter
    assert not got[fault].passed and got[fault].limits["nmse"] == 5e-4  # a fault stays a fault
    old = {r.tap: r for r in layer_checks(outputs, lambda n: ref, "c", tol, "added", golden.get, noise={})}
    assert not old[noisy].passed and old[noisy].limits["nmse"] == 5e-4  # goldens without the noise: fixed
    emu = {r.tap: r for r in layer_checks(outputs, lambda n: ref, "c", tol, "emulation", golden.get, noise=golden)}
    assert not emu[noisy].passed  # a dump's emulation check is arithmetic noise only: never widened
