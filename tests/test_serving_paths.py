"""Serving paths on the built-in device (docs/validation.md "Serving paths"): prefix-cache resume
at a chunk and at a turn boundary and a prefill/decode handoff to a spawned process equal the
uninterrupted run; validate --serving reports them in their own section; each planted fault is
located to the array and layer it broke."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3bundle.bundle.open_weights import open_weights
from k3bundle.executor.cache import KDAState
from k3bundle.executor.cache_handoff import from_bytes, to_bytes
from k3bundle.executor.case import golden_routes
from k3bundle.executor.serving import CacheIO, uninterrupted
from k3bundle.validate.devices import DEVICE_POLICY
from k3bundle.validate.serving import Handoff, judge_serving, run_paths
from tests.conftest import run_cli


# ---- planted faults: module-level, so the decoding process loads them by name ----
def save_kda_transposed(cache):
    """A KDA state saved transposed ([dv, dk] where the format says [dk, dv])."""
    c = cache.clone()
    for s in c.layers:
        if isinstance(s, KDAState):
            s.recurrent_HKV = s.recurrent_HKV.transpose(-1, -2).contiguous()
    return to_bytes(c)


def load_dropping_conv(data):
    """A conv state dropped on restore (zeros, as a fresh request's)."""
    c = from_bytes(data)
    for s in c.layers:
        if isinstance(s, KDAState):
            s.conv_3WP = torch.zeros_like(s.conv_3WP)
    return c


def load_one_token_off(data):
    """A state restored one token off: the engine resumes at length − 1 (its last latent row gone)."""
    c = from_bytes(data)
    c.length -= 1
    c.layers = [s if isinstance(s, KDAState) else s.truncated(c.length) for s in c.layers]
    return c


@pytest.fixture(scope="module")
def served(multi_turn_goldens):
    """The multi-turn case's goldens (conftest) and the uninterrupted run the fault tests share."""
    src, golden, ids = multi_turn_goldens["src"], multi_turn_goldens["golden"], multi_turn_goldens["ids"]
    weights = open_weights(src, DEVICE_POLICY, "cpu")
    tokens = [int(t) for t in golden["greedy_tokens"]]
    ref = uninterrupted(weights, ids, tokens, golden_routes(golden))  # shared by the fault tests
    return {"src": src, "golden": golden, "ids": ids, "weights": weights, "ref": ref}


def _paths(served, io=CacheIO(), load="k3bundle.executor.cache_handoff:from_bytes"):
    handoff = Handoff(str(served["src"]), DEVICE_POLICY, "cpu", load=load)
    run = run_paths(served["weights"], served["golden"], served["ids"], handoff, io, ref=served["ref"], batching=False)
    from k3bundle.golden.tolerances import load_tolerances

    tol = load_tolerances(served["src"] / "validation" / "tolerances.yaml")
    return {p.path: p for p in judge_serving("multi_turn", run, tol)}, run


def test_validate_serving_passes_and_reports_every_path(served):
    r = run_cli("validate", str(served["src"]), "--serving", "--json")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(r.stdout)
    paths = {p["path"]: p for p in data["cases"][0]["serving"]}
    assert {k: p["status"] for k, p in paths.items()} == {"resume_chunk": "pass", "resume_turn": "pass",
                                                         "handoff": "pass", "batching": "pass"}
    ids = served["ids"]
    assert paths["resume_chunk"]["at"] % 64 == 0 and paths["resume_turn"]["at"] % 64 != 0
    assert 0 < paths["resume_chunk"]["at"] < len(ids) and 0 < paths["resume_turn"]["at"] < len(ids)
    # the turn boundary follows an <|end_of_msg|> (the vocabulary's end − 254)
    eom = served["weights"].config.text.vocab_size - 254
    assert ids[paths["resume_turn"]["at"] - 1] == eom
    # the handoff's bytes: every layer's state at the prompt's length, and the header
    w = served["weights"].config.text
    la = w.linear_attn_config
    kda = len(w.kda_layers) * (la.num_heads * la.head_dim ** 2 * 4 + 3 * (la.short_conv_kernel_size - 1)
                               * la.num_heads * la.head_dim * 2)
    mla = len(w.mla_layers) * len(ids) * (w.kv_lora_rank + w.qk_rope_head_dim) * 2
    assert kda + mla < paths["handoff"]["bytes"] < kda + mla + 8192
    md = Path(next(f for f in data["reports"] if f.endswith("signoff.md"))).read_text()
    section = md[md.index("## Serving paths"):]
    assert "| multi_turn | handoff |" in section and f"{paths['handoff']['bytes']:,}" in section


def _kda0(served) -> int:
    return served["weights"].config.text.kda_layers[0]


def test_kda_state_saved_transposed_is_located(served):
    res, _ = _paths(served, io=CacheIO(save=save_kda_transposed))
    for p in res.values():
        assert p.status == "fail", p.path
        assert p.first_failure.tap == f"restore.layers.{_kda0(served)}.kda_state", (p.path, p.first_failure.line())


def test_conv_state_dropped_on_restore_is_located(served):
    res, _ = _paths(served, io=CacheIO(load=load_dropping_conv), load=f"{__name__}:load_dropping_conv")
    for p in res.values():
        assert p.status == "fail", p.path
        assert p.first_failure.tap == f"restore.layers.{_kda0(served)}.kda_conv", (p.path, p.first_failure.line())
    # and it is a fault of the continuation too, not only of the bytes: the next steps move
    assert any(not r.passed for r in res["handoff"].results if r.tap == "step_logits" or r.tap.startswith("final."))


def test_state_restored_one_token_off_is_located(served):
    res, _ = _paths(served, io=CacheIO(load=load_one_token_off), load=f"{__name__}:load_one_token_off")
    for p in res.values():
        assert p.status == "fail", p.path
        assert p.first_failure.tap == "restore.length", (p.path, p.first_failure.line())
        assert p.first_failure.values["tokens"] == p.first_failure.min_required["tokens"] - 1


def test_a_decoding_process_that_fails_is_one_line_and_fails_the_path(served):
    from k3bundle.validate.serving import HandoffError, PathPair, judge_path

    ref = served["ref"]
    handoff = Handoff(str(served["src"]), DEVICE_POLICY, "cpu", load="k3bundle.executor.cache_handoff:no_such_load")
    with pytest.raises(HandoffError) as e:
        handoff.decode(to_bytes(ref.saved), ref.logits[-1], [1, 2], {})
    assert "\n" not in str(e.value) and "no_such_load" in str(e.value), str(e.value)
    res = judge_path("multi_turn", PathPair("handoff", error=str(e.value)), ref, None)
    assert res.status == "fail" and "no_such_load" in res.reason


def test_serving_needs_the_built_in_device_in_this_process(tmp_path):
    from k3bundle.validate.device_options import open_device
    from k3bundle.validate.errors import ValidateError

    for kw in ({"ranks": "distributed"}, {"dumps": tmp_path}):
        with pytest.raises(ValidateError, match="--serving"):
            open_device(tmp_path, serving=True, **kw)


# ---- the batching path: the prompt beside shorter requests, each against itself alone ----
def _batch(served, leak=None):
    from k3bundle.golden.tolerances import load_tolerances
    from k3bundle.validate.serving import judge_batch
    from k3bundle.validate.serving_batch import run_batch

    pair = run_batch(served["weights"], served["golden"], served["ids"], leak=leak, case="multi_turn")
    return judge_batch("multi_turn", pair, load_tolerances(served["src"] / "validation" / "tolerances.yaml")), pair


@pytest.fixture(scope="module")
def batch_clean(served):
    return _batch(served)


def test_batching_path_passes_with_requests_of_other_lengths(served, batch_clean):
    res, pair = batch_clean
    n = len(served["ids"])
    # the case, then prefixes of 2/3 and 1/3 of its length (the only case here), each decoding what follows
    assert [len(r.ids) for r in pair.requests] == [n, round(n * 2 / 3), round(n / 3)]
    assert pair.requests[1].tokens == served["ids"][len(pair.requests[1].ids):][:len(pair.requests[0].tokens)]
    assert res.status == "pass", res.first_failure.line() if res.first_failure else res.reason
    assert {r.tap.split(".", 2)[1] for r in res.results} == {"0", "1", "2"}
    taps = {r.tap for r in res.results}
    assert {"request.2.layers.0.mixer_out", "request.1.prefill.layers.1.kda_conv", "request.0.step_logits",
            "request.2.decode.layers.3.mixer_out", "request.1.final.layers.3.mla_latent"} <= taps
    assert all(cand.grid == n for cand in pair.cands)  # the short requests ran padded to the case's length


@pytest.mark.parametrize("where, tap", [("kda_conv", "prefill.layers.{l}.kda_conv"),
                                        ("kda_state", "prefill.layers.{l}.kda_state"),
                                        ("mla_keys", "layers.{l}.mixer_out")])
def test_padding_leaking_into_a_request_is_located(served, batch_clean, where, tap):
    from k3bundle.executor.batching import Leak

    text = served["weights"].config.text
    layer = text.mla_layers[0] if where == "mla_keys" else text.kda_layers[-1]
    _, clean = batch_clean  # the same requests alone; only the batch runs again, with the fault
    from k3bundle.executor.batching import batched
    from k3bundle.golden.tolerances import load_tolerances
    from k3bundle.validate.serving import judge_batch
    from k3bundle.validate.serving_batch import BatchPair

    leaked = batched(served["weights"], clean.requests, leak=Leak(2, layer, where))  # request 2, the shortest
    res = judge_batch("multi_turn", BatchPair(clean.labels, clean.requests, clean.refs, leaked),
                      load_tolerances(served["src"] / "validation" / "tolerances.yaml"))
    assert res.status == "fail"
    assert res.first_failure.tap == "request.2." + tap.format(l=layer), res.first_failure.line()
    assert res.first_failure.layer == layer
