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
