"""The BF16-noise rule (golden/noise.py): free-running limits widen with the reference's own
BF16 noise, never tighten. Hand-worked values; the end-to-end effect on a chaotic model is in
``tests/test_calibrate.py`` and docs/validation.md "Calibration"."""

from __future__ import annotations

import numpy as np
import pytest

from k3bundle.golden.noise import ADDED, noise_key, widen


def test_an_upper_bound_widens_to_factor_times_the_noise():
    golden = {noise_key("nmse", "layers.3.mixer_out"): np.asarray(0.01)}
    assert widen({"nmse": 0.02}, golden, "layers.3.mixer_out", 4.0) == {"nmse": pytest.approx(0.04)}


def test_a_quiet_model_keeps_the_fixed_limit():
    golden = {noise_key("nmse", "t"): np.asarray(1e-3)}  # 4 x 1e-3 < 2e-2: never tighter
    assert widen({"nmse": 0.02}, golden, "t", 4.0) == {"nmse": 0.02}


def test_a_lower_bound_widens_its_deficit():
    golden = {noise_key("cosine", "t"): np.asarray(0.99), noise_key("top1", "t"): np.asarray(0.75)}
    out = widen({"cosine": 0.995, "top1": 0.6}, golden, "t", 4.0)
    assert out["cosine"] == pytest.approx(0.96)  # 1 - 4 x 0.01
    assert out["top1"] == pytest.approx(0.0)  # 1 - 4 x 0.25 = 0 < 0.6
    assert widen({"cosine": 0.9}, golden, "t", 4.0) == {"cosine": 0.9}  # already looser


def test_factor_zero_or_no_noise_leaves_limits_alone():
    golden = {noise_key("nmse", "t"): np.asarray(1.0)}
    assert widen({"nmse": 0.02}, golden, "t", 0.0) == {"nmse": 0.02}
    assert widen({"nmse": 0.02}, {}, "t", 4.0) == {"nmse": 0.02}
    assert widen({"max_abs": 1.0}, golden, "t", 4.0) == {"max_abs": 1.0}  # no noise recorded for it


def test_goldens_carry_the_noise_of_every_free_running_check(tiny_trained_ckpt, tmp_path):
    import shutil

    from k3bundle.golden.generate import generate_goldens
    from k3bundle.golden.store import read_npz

    cases = tmp_path / "cases"
    cases.mkdir()
    shutil.copy(__import__("tests.conftest", fromlist=["REPO"]).REPO / "golden" / "cases" / "greedy.yaml", cases)
    generate_goldens(tiny_trained_ckpt, out=tmp_path / "g", cases_dir=cases)
    inter = read_npz(tmp_path / "g" / "golden_intermediates.npz")
    noise = {k.split("/", 1)[1]: float(np.asarray(v).reshape(-1)[0]) for k, v in inter.items() if "/bf16_noise." in k}
    assert noise[noise_key("nmse", "layers.8.mixer_out")] > 0  # BF16 differs from float32 ...
    assert noise[noise_key("nmse", "layers.8.mixer_out")] < 2e-2  # ... and a trained model stays quiet
    assert 0 < noise[noise_key("kld_mean", "logits")] < 5e-3
    assert noise[noise_key("nmse", "embed")] == 0.0  # an embedding row is exact in BF16
    assert any(k.startswith("bf16_noise.drift_nmse.decode_states.layers.") for k in noise)
    # the teacher-forced noise (greedy taps every position): prompt and decode steps, every layer;
    # a trained model's layers add far less than the fixed added limit (5e-4), so it stays in force
    for tap in ("layers.8.mixer_out", "decode.layers.8.mixer_out", "layers.0.ffn_out", "logits"):
        assert 0 < noise[noise_key("nmse", ADDED + tap)] < 1e-4, tap
        assert 1 - 1e-4 < noise[noise_key("cosine", ADDED + tap)] < 1, tap
    assert generate_goldens(tiny_trained_ckpt, out=tmp_path / "h", cases_dir=cases, noise=False) and \
        not any("/bf16_noise." in k for k in read_npz(tmp_path / "h" / "golden_intermediates.npz"))


def test_each_widened_limit_says_what_it_came_from():
    from k3bundle.golden.noise import basis_text, widen_with_basis

    golden = {noise_key("nmse", ADDED + "t"): np.asarray(7.3e-4), noise_key("cosine", ADDED + "t"): np.asarray(0.9999)}
    limits, basis = widen_with_basis({"nmse": 5e-4, "cosine": 0.99975, "max_abs": 1.0}, golden, ADDED + "t", 2.5)
    assert limits == {"nmse": pytest.approx(1.825e-3), "cosine": 0.99975, "max_abs": 1.0}  # 2.5 x 7.3e-4; 2.5e-4 deficit
    assert basis == {"nmse": {"fixed": 5e-4, "noise": pytest.approx(7.3e-4), "factor": 2.5},
                     "cosine": {"fixed": 0.99975, "noise": pytest.approx(0.9999), "factor": 2.5}}
    assert basis_text("nmse", basis) == "2.5 × noise 7.30e-04"
    assert basis_text("cosine", basis) == "fixed (2.5 × noise deficit 1.00e-04 is tighter)"
    assert basis_text("max_abs", basis) == "fixed"  # no noise recorded for it
    assert widen_with_basis({"nmse": 5e-4}, golden, ADDED + "t", 0.0) == ({"nmse": 5e-4}, {})
