"""Comparison metrics against hand-worked values and float64 recomputation."""

from __future__ import annotations

import math

import pytest
import torch

from k3bundle import metrics as m


def test_distance_metrics_hand_worked():
    ref = torch.tensor([3.0, 4.0])
    x = torch.tensor([3.0, 5.0])
    assert m.nmse(ref, x) == pytest.approx(1 / 25)
    assert m.rel_l2(ref, x) == pytest.approx(1 / 5)
    assert m.cosine(ref, x) == pytest.approx((9 + 20) / (5 * math.sqrt(34)))
    assert m.max_abs(ref, x) == 1.0
    assert m.nmse(ref, ref) == 0.0 and m.cosine(ref, ref) == pytest.approx(1.0)


def test_nan_and_inf_never_pass():
    ref = torch.ones(4)
    for bad in (float("nan"), float("inf")):
        x = torch.tensor([1.0, 1.0, bad, 1.0])
        assert m.nmse(ref, x) == math.inf
        assert m.cosine(ref, x) == -math.inf
        assert m.max_abs(ref, x) == math.inf


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"reference \[2\] vs candidate \[3\]"):
        m.nmse(torch.zeros(2), torch.zeros(3))


def test_kld_hand_worked_and_topk():
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    x = torch.log(torch.tensor([[0.25, 0.75], [0.9, 0.1]]))
    k = m.kld(ref, x)
    assert k[0].item() == pytest.approx(0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75))
    assert k[1].item() == pytest.approx(0.0, abs=1e-15)
    assert m.topk_agreement(ref, x, 1) == 0.5  # row 0 argmax flips (tie at 0 vs 1 -> index 0)
    assert m.topk_agreement(ref, x, 2) == 1.0
    assert m.quantile(torch.arange(101.0), 0.99) == pytest.approx(99.0)


def test_expert_set_agreement_with_near_tie_exemption():
    ref = torch.tensor([[1, 2], [3, 4], [5, 6]])
    cand = torch.tensor([[2, 1], [3, 7], [5, 8]])  # row 0 same set, rows 1 and 2 flip
    margin = torch.tensor([0.5, 1e-6, 0.2])
    assert m.expert_set_agreement(ref, cand) == (pytest.approx(1 / 3), 0)
    agree, exempt = m.expert_set_agreement(ref, cand, margin, eps=1e-4)
    assert agree == pytest.approx(2 / 3) and exempt == 1


def test_nonfinite_counts_and_locates_the_first_value():
    x = torch.zeros(4, 8)
    x[1, 5], x[2, 0], x[3, 7] = float("nan"), float("inf"), float("-inf")  # row-major first: (1, 5)
    nf = m.nonfinite(x)
    assert (nf.nan, nf.inf, nf.total, nf.first, nf.count) == (1, 2, 32, (1, 5), 3)
    assert m.nonfinite(torch.ones(3, 2, 2)).first is None
    s = torch.zeros(2, 3, 4)
    s[1, 2, 3] = float("nan")  # the last element: flat index 23 = ((1 * 3) + 2) * 4 + 3
    assert m.nonfinite(s).first == (1, 2, 3)
    assert m.nonfinite(torch.tensor([1, 2], dtype=torch.int64)).count == 0


def test_a_nonfinite_tap_reads_as_a_count_and_a_place_and_never_passes(tmp_path):
    from k3bundle.golden.tolerances import load_tolerances
    from k3bundle.validate.compare import compare_logits, compare_tensor

    p = tmp_path / "t.yaml"
    p.write_text("schema_version: 1\nformat: t\nadded: {default: {nmse: 1.0e+9}}\n"
                 "logits: {kld_mean: 1.0e+9}\n")
    tol = load_tolerances(p)
    ref = torch.ones(64, 64)
    x = ref.clone()
    x[:, 17:] = float("nan")  # 64 rows x 47 channels, the first at token 0, channel 17
    x[5, 3] = float("inf")
    r = compare_tensor("c", "layers.2.mixer_out", ref, x, tol, "added")
    assert not r.passed  # whatever the limits
    assert r.nonfinite["device"] == {"nan": 64 * 47, "inf": 1} and r.nonfinite["golden"] == {"nan": 0, "inf": 0}
    assert "layers.2.mixer_out: 3,008 of 4,096 values NaN, 1 Inf (first: token 0, channel 17)" in r.line()
    clean = compare_tensor("c", "layers.2.mixer_out", ref, ref, tol, "added")
    assert clean.passed and clean.nonfinite is None and ": " not in clean.line().split(" | ")[3]
    logits = torch.zeros(3, 10)
    bad = logits.clone()
    bad[2, 9] = float("nan")
    lr = compare_logits("c", "logits", logits, bad, tol)
    assert not lr.passed and "1 of 30 values NaN (first: token 2, vocab id 9)" in lr.line()
    assert math.isinf(lr.values["kld_p99"])  # a quantile over infinities is infinite, not NaN


def test_a_greedy_step_over_nonfinite_logits_never_passes(tmp_path):
    from k3bundle.golden.tolerances import load_tolerances
    from k3bundle.validate.compare import compare_greedy

    p = tmp_path / "t.yaml"
    p.write_text("schema_version: 1\nformat: t\ngreedy: {near_tie_margin: 0.5}\n")
    tol = load_tolerances(p)
    ref_logits = torch.eye(4) * 3
    own = ref_logits.clone()
    own[2] = float("nan")  # an engine that emits the same token ids over NaN logits
    g = compare_greedy([0, 1, 2, 3], [0, 1, 2, 3], ref_logits, tol, step_logits=own)
    assert not g.passed and g.nonfinite_step == 2 and g.first_divergence is None
    ok = compare_greedy([0, 1, 2, 3], [0, 1, 2, 3], ref_logits, tol, step_logits=ref_logits)
    assert ok.passed and ok.nonfinite_step is None
