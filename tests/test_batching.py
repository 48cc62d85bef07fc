"""Batching on the built-in executor (docs/executor.md "Batching"): requests of different lengths in
one right-padded grid equal each request run alone on the single-request path (itself checked
against fla-core and float64 references in tests/test_executor_model.py and
tests/test_executor_blocks.py), decode at batch N equals decode at batch 1, and padding never
changes a result: not its values, not its presence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3bundle.executor import SourceWeights
from k3bundle.executor.batching import Leak, Request, alone, batched, conv_batched, key_mask
from k3bundle.executor.cache import KDAState
from k3bundle.executor.errors import ExecutorError

TOL = 1e-11  # float64: the same equations in other product shapes differ by rounding only


@pytest.fixture(scope="module")
def w64(tiny_ckpt):
    return SourceWeights(tiny_ckpt, dtype="float64", resident=True)


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab - 300, (n,), generator=g).tolist()  # ordinary tokens, no specials


@pytest.fixture(scope="module")
def reqs(w64):
    v = w64.config.text.vocab_size
    # 70 tokens crosses the chunk boundary (64); decode lengths differ, so requests leave the batch
    return [Request(_ids(v, 70, 1), _ids(v, 4, 2)), Request(_ids(v, 5, 3), _ids(v, 6, 4)),
            Request(_ids(v, 33, 5), _ids(v, 1, 6))]


@pytest.fixture(scope="module")
def runs(w64, reqs):
    return {"alone": [alone(w64, r) for r in reqs], "batch": batched(w64, reqs, pad_id=3)}


def _arrays(c) -> list[torch.Tensor]:
    out = []
    for s in c.layers:
        out += [s.recurrent_HKV, s.conv_3WP] if isinstance(s, KDAState) else [s.latent_SC]
    return out


def _max_diff(a, b) -> float:
    """Largest difference over logits, step logits, every tap and every cache array of two runs."""
    assert set(a.taps) == set(b.taps) and a.step_logits.shape == b.step_logits.shape
    d = [(a.logits - b.logits).abs().max(), (a.step_logits - b.step_logits).abs().max()]
    d += [(a.taps[k] - b.taps[k]).abs().max() for k in a.taps if a.taps[k].numel()]
    for ca, cb in ((a.prefilled, b.prefilled), (a.final, b.final)):
        assert ca.length == cb.length
        d += [(x - y).abs().max() for x, y in zip(_arrays(ca), _arrays(cb), strict=True)]
    return float(max(d))


def test_a_batch_equals_each_request_alone(runs, reqs):
    for j, (a, b) in enumerate(zip(runs["alone"], runs["batch"], strict=True)):
        assert b.logits.shape[0] == len(reqs[j].ids) and b.step_logits.shape[0] == len(reqs[j].tokens)
        assert _max_diff(a, b) <= TOL, j
    assert runs["batch"][1].grid == 70  # the short requests really were padded


def test_decode_at_batch_n_equals_decode_at_batch_one(w64, reqs, runs):
    # each request's decode steps beside the others' against the batched path with that request alone
    for j, r in enumerate(reqs):
        one = batched(w64, [r])[0]
        assert one.grid == len(r.ids)
        assert float((one.step_logits - runs["batch"][j].step_logits).abs().max()) <= TOL


def test_padding_values_never_change_a_result(w64, reqs, runs):
    other = batched(w64, reqs, pad_id=901)  # other tokens at every padded position
    for a, b in zip(runs["batch"], other):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.step_logits, b.step_logits)
        assert all(torch.equal(a.taps[k], b.taps[k]) for k in a.taps)
        assert all(torch.equal(x, y) for x, y in zip(_arrays(a.final), _arrays(b.final)))


def test_each_planted_leak_moves_only_its_request(w64, reqs, runs):
    # the faults validate --serving must locate are real faults, and only of the request they name
    for where, layer in (("kda_conv", 1), ("kda_state", 2), ("mla_keys", 3)):
        leaked = batched(w64, reqs, pad_id=3, leak=Leak(1, layer, where))
        assert _max_diff(runs["batch"][1], leaked[1]) > 1e-3, where
        for j in (0, 2):
            assert _max_diff(runs["batch"][j], leaked[j]) <= TOL, (where, j)


def test_conv_state_is_taken_at_each_requests_own_end():
    # hand-worked: one channel, kernel 4 (W = 3 state rows), request 0 of 2 tokens padded to 4
    w = torch.tensor([[[1.0, 10.0, 100.0, 1000.0]]], dtype=torch.float64)
    state = torch.tensor([[[1.0], [2.0], [3.0]], [[4.0], [5.0], [6.0]]], dtype=torch.float64)
    u = torch.tensor([[[7.0], [8.0], [-1e6], [1e6]], [[9.0], [10.0], [11.0], [12.0]]], dtype=torch.float64)
    out, new = conv_batched(u, w, state, [2, 4], torch.float64)
    assert new[0, :, 0].tolist() == [3.0, 7.0, 8.0]  # the last three inputs at its end: padding never enters
    assert new[1, :, 0].tolist() == [10.0, 11.0, 12.0]
    # (K1) c̃_t = SiLU(Σ_i w_i u_{t−3+i}): token 1 of request 0 reads 2, 3, 7, 8
    assert float(out[0, 1, 0]) == pytest.approx(float(F.silu(torch.tensor(2 + 30 + 700 + 8000.0))))
    assert float(out[0, 0, 0]) == pytest.approx(float(F.silu(torch.tensor(1 + 20 + 300 + 7000.0))))
    _, leaked = conv_batched(u, w, state, [2, 4], torch.float64, leak=0)
    assert leaked[0, :, 0].tolist() == [8.0, -1e6, 1e6]  # the planted fault: the padded row's end


def test_key_mask_is_causal_and_bounded_by_each_requests_length():
    # request 0: no cache, 2 tokens in a grid of 3; request 1: 2 cached tokens, 1 new (decode-like)
    m = key_mask([0, 2], [2, 1], T=3, S=4, device="cpu")[:, 0].int().tolist()
    assert m[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]  # the padded query sees only real keys
    assert m[1] == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]]


def test_bad_batches_are_refused(w64, reqs):
    with pytest.raises(ExecutorError, match="every request"):
        batched(w64, [reqs[0], Request(reqs[1].ids, reqs[1].tokens, {"layers.1.router_ids": torch.zeros(9, 2)})])
    with pytest.raises(ExecutorError, match="out of range"):
        batched(w64, [reqs[0], Request([w64.config.text.vocab_size], [1])])
    with pytest.raises(ExecutorError, match="leak"):
        Leak(0, 1, "everywhere")
