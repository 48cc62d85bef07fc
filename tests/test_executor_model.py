"""The executor's stateful API on the synth tiny model: prefill/decode agreement, snapshots,
taps, lazy expert reads, and the synth scaling check (hidden-state RMS)."""

from __future__ import annotations

import pytest
import torch

from k3bundle.executor import Executor, ExecutorError, SourceWeights, TapRecorder, tap_names


@pytest.fixture(scope="module")
def f64(tiny_ckpt):
    return SourceWeights(tiny_ckpt, dtype="float64", resident=True)


def _ids(n, seed=0, vocab=1000):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_prefill_then_decode_equals_longer_prefill(f64):
    """prefill(T) + N decode steps (KDA recurrence, absorbed MLA) == prefill(T + N) (chunked, naive)."""
    ids, T, N = _ids(74, seed=1), 70, 4
    ex = Executor(f64)
    full, full_cache = ex.prefill(ids)
    logits, cache = ex.prefill(ids[:T])
    assert _rel(logits, full[:T]) <= 1e-10
    for i in range(N):
        step = ex.decode(int(ids[T + i]), cache)
        assert _rel(step, full[T + i]) <= 1e-10, i
    assert cache.length == full_cache.length == T + N
    for a, b in zip(cache.layers, full_cache.layers):
        if hasattr(a, "recurrent_HKV"):
            assert _rel(a.recurrent_HKV, b.recurrent_HKV) <= 1e-10
            assert _rel(a.conv_3WP, b.conv_3WP) <= 1e-10
        else:
            assert _rel(a.latent_SC, b.latent_SC) <= 1e-10


def test_snapshot_at_chunk_boundary_restore_and_continue(f64):
    ids = _ids(150, seed=2)
    ex = Executor(f64)
    full, cache = ex.prefill(ids, snapshot_at=[64, 128])
    assert sorted(cache.snapshots) == [64, 128]
    snap = cache.snapshots[64]
    assert snap.length == 64 and snap.layers[3].length == 64  # MLA latents truncated
    resumed, rcache = ex.prefill(ids[64:], cache=snap.clone())
    assert _rel(resumed, full[64:]) <= 1e-10
    for a, b in zip(rcache.layers, cache.layers):
        if hasattr(a, "recurrent_HKV"):
            assert _rel(a.recurrent_HKV, b.recurrent_HKV) <= 1e-10
    # the snapshot is unchanged by the continuation (restore twice, decode from it)
    again = cache.snapshots[128].clone()
    for i in range(128, 131):
        assert _rel(ex.decode(int(ids[i]), again), full[i]) <= 1e-10
    assert cache.snapshots[128].length == 128


def test_snapshot_position_must_be_a_chunk_boundary(f64):
    with pytest.raises(ExecutorError, match="not a chunk boundary"):
        Executor(f64).prefill(_ids(100), snapshot_at=[50])


def test_bad_token_ids(f64):
    ex = Executor(f64)
    with pytest.raises(ExecutorError, match=r"token id 1024 at index 1 is out of range 0..1023"):
        ex.prefill([1, 1024, 2])
    with pytest.raises(ExecutorError, match="out of range"):
        ex.prefill([-1])
    with pytest.raises(ExecutorError, match="no token ids"):
        ex.prefill([])


def test_tap_names_are_the_documented_contract(f64):
    t = f64.config.text
    rec = TapRecorder()
    Executor(f64, rec).prefill(_ids(5))
    assert set(rec.names()) == set(tap_names(t))
    assert rec["layers.3.attn_res_out"].shape == (5, t.hidden_size)
    assert rec["layers.1.router_ids"].shape == (5, t.num_experts_per_token)
    assert rec["layers.0.kda_state"].shape == (16, 16, 16)
    assert rec["layers.3.mla_latent"].shape == (5, t.kv_lora_rank + t.qk_rope_head_dim)
    assert "layers.0.router_ids" not in rec  # dense layer 0


def test_taps_at_chosen_positions_across_prefill_and_decode(f64):
    rec = TapRecorder(names=["layers.*.mixer_out", "logits"], positions=[2, 6])
    ex = Executor(f64, rec)
    logits, cache = ex.prefill(_ids(5))
    ex.decode(7, cache)
    ex.decode(8, cache)  # position 6
    assert rec.positions_of("logits") == [2, 6]
    assert rec["layers.4.mixer_out"].shape == (2, f64.config.text.hidden_size)
    assert torch.equal(rec["logits"][0], logits[2])
    assert "layers.4.ffn_out" not in rec
    arrays = rec.numpy()
    assert arrays["positions"].tolist() == [2, 6] and arrays["logits"].shape == (2, 1024)


def test_experts_are_read_only_when_routed(tiny_ckpt):
    w = SourceWeights(tiny_ckpt, dtype="float32")
    rec = TapRecorder(names=["layers.*.router_ids"])
    Executor(w, rec).prefill(_ids(3, seed=4))
    routed = sum(len(torch.unique(rec[n])) for n in rec.names())
    assert w.expert_reads == routed < 8 * 16  # 8 MoE layers x 16 experts
    assert not w._experts or all(len(c) == 0 for c in w._experts.values())  # prefill fills no cache


def test_decode_keeps_a_small_per_layer_expert_cache(tiny_ckpt):
    w = SourceWeights(tiny_ckpt, dtype="float32", expert_cache=2)
    ex = Executor(w)
    _, cache = ex.prefill(_ids(4))
    for tok in (5, 6, 7):
        ex.decode(tok, cache)
    assert all(len(c) <= 2 for c in w._experts.values()) and any(w._experts.values())


def test_forced_routes_replay_the_reference_choice(f64, tiny_ckpt):
    ids = _ids(20, seed=5)
    rec = TapRecorder(names=["layers.*.router_ids", "logits"])
    Executor(f64, rec).prefill(ids)
    forced = {n: rec[n] for n in rec.names() if n.endswith("router_ids")}
    rec32 = TapRecorder(names=["layers.*.router_ids", "logits"])
    Executor(SourceWeights(tiny_ckpt, dtype="bfloat16"), rec32, forced_routes=forced).prefill(ids)
    for n in forced:
        assert torch.equal(rec32[n], forced[n])


def test_generate_is_greedy(f64):
    ex = Executor(f64)
    g = ex.generate(_ids(6, seed=6), steps=3)
    assert g.tokens[0] == int(g.prefill_logits[-1].argmax())
    assert [int(r.argmax()) for r in g.step_logits] == g.tokens and g.cache.length == 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synth_hidden_state_rms_stays_within_10x(tiny_ckpt, seed):
    """The synth scaling check: no layer grows or shrinks the hidden state by more than 10x."""
    rec = TapRecorder(names=["embed", "layers.*.attn_res_out", "layers.*.mixer_out",
                             "layers.*.ffn_res_out", "layers.*.ffn_out", "final_hidden"])
    Executor(SourceWeights(tiny_ckpt, dtype="float32"), rec).prefill(_ids(96, seed=seed))
    rms = {n: rec[n].pow(2).mean().sqrt().item() for n in rec.names()}
    assert max(rms.values()) / min(rms.values()) <= 10, rms
