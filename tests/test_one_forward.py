"""One forward: the teacher-forced layer step, the case runner and the tap grammar are the
executor's own layer loop, so the ground truth (golden) and its judge (validate) cannot split.

Oracles: a run fed its own outputs must reproduce itself exactly (teacher forcing changes
nothing when the feed is the truth); a teacher-forced decode on a greedy run's own tokens and
routes must reproduce that run exactly; the grammar's order must be the order the executor
actually records taps in.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from k3bundle.executor import Executor, SourceWeights, TapRecorder
from k3bundle.executor.case import run_case
from k3bundle.executor.taps import JUDGED_KINDS, TAPS, dump_required, forward_key, tap_names
from k3bundle.golden.tolerances import METRICS
from k3bundle.validate.compare import judge


@pytest.fixture(scope="module")
def f64(tiny_ckpt):
    return SourceWeights(tiny_ckpt, dtype="float64", resident=True)


def _ids(n, seed=0):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_teacher_forced_on_its_own_taps_reproduces_the_free_run(f64):
    ids = _ids(70, seed=3)
    rec = TapRecorder()
    logits, _ = Executor(f64, rec).prefill(ids)
    outs = Executor(f64).teacher_forced(lambda n: rec[n] if n in rec else None)
    t = f64.config.text
    expected = [n for n in tap_names(t) if not TAPS[[s.kind for s in TAPS].index(n.rsplit(".", 1)[-1])].state
                and not n.endswith(("router_ids", "router_weights", "router_margin", "embed"))
                and n != "layers.0.attn_res_out"]
    assert sorted(k for k in outs if not k.startswith(("own.", "noise."))) == sorted(expected)
    for name in expected:
        assert torch.equal(outs[name], rec[name]), name
    assert torch.equal(outs["logits"], logits)
    for l in t.moe_layers:  # fed the run's own routes, the router's own choice is the same
        assert torch.equal(outs[f"own.layers.{l}.router_ids"], rec[f"layers.{l}.router_ids"])


def test_teacher_forced_decode_on_its_own_taps_reproduces_the_decode_steps(f64):
    """Teacher-forced decode fed a run's own decode taps gives that run's decode outputs: the
    decode path (KDA recurrence, absorbed MLA) is judged layer by layer on the cache the fed
    prefill built, which here is the run's own."""
    ids = _ids(20, seed=6)
    run = run_case(f64, ids, list(range(20)), steps=5).arrays
    feed = {k: v for k, v in run.items()}
    outs = Executor(f64).teacher_forced(feed.get, decode=True)
    decoded = sorted(k for k in outs if k.startswith("decode."))
    assert decoded and all(k in run for k in decoded)
    assert outs["decode.logits"].shape[0] == 4  # steps - 1 decode calls
    for name in decoded:
        torch.testing.assert_close(outs[name], run[name], rtol=1e-12, atol=1e-12, msg=name)
    t = f64.config.text
    for l in t.moe_layers:
        assert torch.equal(outs[f"own.decode.layers.{l}.router_ids"], run[f"decode.layers.{l}.router_ids"])
    assert not any(k.startswith("decode.") for k in Executor(f64).teacher_forced(feed.get))  # opt-in


def test_teacher_forced_decode_sees_a_cache_fault(f64):
    """A cache handled wrongly between decode steps (one MLA latent row lost after step 1)
    changes that MLA layer's own decode output, not the layers before it."""
    ids = _ids(20, seed=7)
    run = run_case(f64, ids, list(range(20)), steps=5).arrays
    mla = f64.config.text.mla_layers[0]

    def drop_row(step, cache):
        if step == 1:
            s = cache.layers[mla]
            s.buffer_SC[5: s.length - 1] = s.latent_SC[6:].clone()
            s.length -= 1
    outs = Executor(f64).teacher_forced(run.get, decode=True, after_step=drop_row)
    key = f"decode.layers.{mla}.mixer_out"
    torch.testing.assert_close(outs[key][:2], run[key][:2], rtol=1e-12, atol=1e-12)  # before the loss
    assert not torch.allclose(outs[key][2:], run[key][2:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(outs[f"decode.layers.{mla - 1}.ffn_out"], run[f"decode.layers.{mla - 1}.ffn_out"],
                               rtol=1e-12, atol=1e-12)


def test_teacher_forcing_isolates_one_layer(f64):
    """A fault fed into one layer's output moves that layer's stream only: the next layer's
    output computed on the faulty feed differs, but every earlier layer's output is untouched."""
    ids = _ids(40, seed=4)
    rec = TapRecorder()
    Executor(f64, rec).prefill(ids)
    clean = Executor(f64).teacher_forced(lambda n: rec[n] if n in rec else None)
    bad = {n: rec[n] for n in rec.names()}
    bad["layers.2.mixer_out"] = bad["layers.2.mixer_out"] * 1.5
    faulty = Executor(f64).teacher_forced(bad.get)
    assert torch.equal(faulty["layers.2.mixer_out"], clean["layers.2.mixer_out"])  # own output: same input
    assert torch.equal(faulty["layers.1.ffn_out"], clean["layers.1.ffn_out"])
    assert not torch.equal(faulty["layers.2.ffn_res_out"], clean["layers.2.ffn_res_out"])  # reads the fed stream


def test_replaying_a_greedy_run_reproduces_it(f64):
    """The device's run (golden tokens fed, golden routes replayed) on the golden's own weights
    gives the golden's arrays bit for bit: one case runner, two modes."""
    ids, positions = _ids(75, seed=5), [0, 7, 63, 64, 74]
    greedy = run_case(f64, ids, positions, steps=4, snapshot_at=[64], record_routes=True).arrays
    routes = {k[len("routes."):]: v for k, v in greedy.items() if k.startswith("routes.")}
    replay = run_case(f64, ids, positions, tokens=greedy["greedy_tokens"].tolist(), forced_routes=routes).arrays
    shared = set(replay) - {"chunk_positions"}
    assert shared <= set(greedy)
    assert {k for k in greedy if k.startswith("decode.")} == {k for k in replay if k.startswith("decode.")}
    for k in sorted(shared):
        assert torch.equal(replay[k], greedy[k]), k
    assert greedy["step_logits"].shape == (4, f64.config.text.vocab_size)
    assert greedy["decode_states.layers.0.kda_state"].shape[0] == 3  # steps - 1 decodes


def test_generate_is_the_same_greedy_loop(f64):
    ids = _ids(12, seed=6)
    g = Executor(f64, all_logits=False).generate(ids, steps=3)  # run_case's head: the rows it reads
    arrays = run_case(f64, ids, [], steps=3).arrays
    assert g.tokens == arrays["greedy_tokens"].tolist()
    assert torch.equal(g.step_logits, arrays["step_logits"])


def test_grammar_order_is_the_recording_order(f64):
    rec = TapRecorder()
    Executor(f64, rec).prefill(_ids(5))
    t = f64.config.text
    per_position = [n for n in rec.names() if n in rec._rows]
    assert per_position == [n for n in tap_names(t) if n in rec._rows]
    assert sorted(rec.names(), key=forward_key) == tap_names(t)


def test_dump_and_tolerance_vocabularies_come_from_the_grammar():
    assert dump_required(2) == ["layers.0.mixer_out", "layers.0.ffn_out", "layers.1.mixer_out",
                                "layers.1.ffn_out", "final_hidden", "logits"]
    assert "router_ids" not in JUDGED_KINDS and "router_margin" not in JUDGED_KINDS
    assert {"mixer_out", "logits", "kda_state", "mla_latent"} <= set(JUDGED_KINDS)


@pytest.mark.parametrize("metric", sorted(METRICS))
def test_one_direction_rule_per_metric(metric):
    """Every metric's limit is judged by the same rule, in the direction the table says."""
    limit = 0.5
    above, below = judge({metric: 0.9}, {metric: limit})[0], judge({metric: 0.1}, {metric: limit})[0]
    assert (above, below) == ((False, True) if METRICS[metric] == "max" else (True, False))
    assert judge({metric: float("nan")}, {metric: limit})[0] is False


def test_case_arrays_are_numpy_convertible(f64):
    arrays = run_case(f64, _ids(8), [0, 7], steps=0).arrays
    assert arrays["step_logits"].shape == (0, f64.config.text.vocab_size)
    assert np.asarray(arrays["greedy_tokens"]).shape == (0,)
