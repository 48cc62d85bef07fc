"""The long-context case judged per layer: its goldens tap a sample of positions, so validate
recomputes the reference's every position in float32 on the goldens' own weights, in lockstep
with the device's teacher-forced pass (validate/recompute.py, executor.case.teacher_forced_on_replay).

One trained-tiny bundle (TP 2) with goldens of the greedy case and a 300-token long case (48 of
its positions tapped), made from the bundle itself; each test judges it in this process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from k3bundle.calibrate.bundle_edits import read_tensor, write_tensor  # one way to corrupt a bundle in place
from k3bundle.golden.generate import generate_goldens
from k3bundle.golden.store import read_npz
from k3bundle.validate.device_options import weights_for, with_backend
from k3bundle.validate.devices import InProcess
from k3bundle.validate.run import validate
from tests._bundles import bundle_with_goldens, one_torch_thread
from tests.conftest import REPO


LAYOUT = REPO / "tests" / "layouts" / "tiny-tp2.yaml"
LONG = 300  # the long case's filler tokens (its prompt: 319, past 4 KDA chunks of 64; 48 positions tapped)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def signed(tmp_path_factory, tiny_trained_ckpt):
    root = tmp_path_factory.mktemp("longctx")
    bundle, cases = bundle_with_goldens(tiny_trained_ckpt, LAYOUT, root, cases=("greedy", "long_context"),
                                        long_tokens=LONG)
    return {"bundle": bundle, "cases": cases, "root": root, "src": tiny_trained_ckpt}


def _run(bundle: Path, backend=None):
    factory = weights_for(bundle)
    if backend is not None:
        factory = with_backend(factory, backend)
    dut = InProcess(factory, "cpu", source=bundle)
    dut.kernels = backend
    rep = validate(bundle, dut)
    return rep, {c.name: c for c in rep.cases}


def _copy(signed, tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    shutil.copytree(signed["bundle"], out)
    return out


def test_a_clean_long_case_passes_with_layer_checks_at_every_layer(signed):
    rep, cases = _run(signed["bundle"])
    assert rep.passed and rep.exact == "ran"
    long = cases["long_context"]
    gold = read_npz(signed["bundle"] / "validation" / "golden_intermediates.npz")
    positions = gold["long_context/positions"]
    assert 0 < positions.size < LONG  # sampled positions: the case this is about
    assert long.status == "pass" and long.layer_checks == ""
    by_mode: dict[str, set[str]] = {}
    for r in long.results:
        by_mode.setdefault(r.mode, set()).add(r.tap)
    layers = 9  # the trained tiny's depth
    for l in range(layers):  # every layer's mixer and FFN output, at the prompt and at each decode step
        for tap in (f"layers.{l}.mixer_out", f"layers.{l}.ffn_out", f"decode.layers.{l}.mixer_out"):
            assert tap in by_mode["added"] and tap in by_mode["exact"], tap
    # the recomputation reproduces the goldens to the float32 floor (CPU, same arithmetic: 0)
    assert max(r.values["nmse"] for r in long.results if r.mode == "exact") == 0.0
    # the device's teacher-forced outputs are judged where the goldens tapped them, their limits
    # widened with the goldens' own teacher-forced BF16 noise of this case, read from the file here
    mixer = next(r for r in long.results if r.mode == "added" and r.tap == "layers.3.mixer_out")
    assert 0 < mixer.values["nmse"] < mixer.limits["nmse"]
    noise = float(gold["long_context/bf16_noise.nmse.added.layers.3.mixer_out"].reshape(-1)[0])
    assert mixer.basis["nmse"]["noise"] == noise > 0
    assert all(r.basis for r in long.results if r.mode == "added")


def test_every_rank_recomputes_its_shard_and_the_long_case_gets_layer_checks_distributed(signed):
    """``--ranks distributed`` (gloo, TP 2): each rank runs the float32 recomputation on its own
    shard of the goldens' weights beside its BF16 teacher-forced pass; the partial sums cross
    ranks in another order than the merged goldens', so *exact* is judged to the float32 floor,
    not to 0."""
    import os

    from k3bundle.validate.distributed import Distributed

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rep = validate(signed["bundle"], Distributed(signed["bundle"]))
    long = next(c for c in rep.cases if c.name == "long_context")
    assert rep.passed and long.status == "pass" and long.layer_checks == ""
    assert "on every rank, for cases of sampled positions only" in rep.exact
    exact = [r for r in long.results if r.mode == "exact"]
    added = {r.tap for r in long.results if r.mode == "added"}
    assert len(exact) > 50 and max(r.values["nmse"] for r in exact) < 1e-10
    assert {"layers.0.mixer_out", "layers.8.ffn_out", "decode.layers.8.ffn_out"} <= added


def test_the_lockstep_feed_equals_feeding_goldens_that_tap_every_position(signed, tmp_path):
    """Independent oracle: goldens of the same long prompt that tap every position, fed to the
    teacher-forced pass as any short case is; its outputs at the sampled positions equal what the
    recomputed feed gives, and the recomputation equals those goldens there."""
    import numpy as np

    from k3bundle.executor import Executor
    from k3bundle.golden.store import as_tensor
    from k3bundle.validate.devices import DEVICE_POLICY, EXACT_POLICY
    from k3bundle.validate.recompute import recomputed_layer_checks

    cases = tmp_path / "cases"
    cases.mkdir()
    text = (REPO / "golden" / "cases" / "long_context.yaml").read_text()
    (cases / "long_context.yaml").write_text(text.replace("taps: {sample_positions: 32, last_positions: 16}",
                                                          "taps: all"))
    b = signed["bundle"]
    generate_goldens(b, out=tmp_path / "all", cases_dir=cases, long_tokens=LONG, noise=False)
    full = {k.split("/", 1)[1]: v for k, v in read_npz(tmp_path / "all" / "golden_intermediates.npz").items()
            if k.startswith("long_context/")}
    sampled = {k.split("/", 1)[1]: v for k, v in read_npz(b / "validation" / "golden_intermediates.npz").items()
               if k.startswith("long_context/")}
    ids = read_npz(b / "validation" / "golden_inputs.npz")["long_context/ids"]
    assert full["positions"].size == ids.size > sampled["positions"].size
    rows = torch.as_tensor(sampled["positions"])
    w = weights_for(b)
    bf16, f32 = w(DEVICE_POLICY), w(EXACT_POLICY)
    want = Executor(bf16).teacher_forced(lambda n: as_tensor(full.get(n)), decode=True)
    got = recomputed_layer_checks(bf16, f32, sampled, ids)
    compared = 0
    for name, v in want.items():
        w_rows = v if name.startswith(("decode.", "own.decode.", "noise.decode.")) else v[rows]
        if name == "logits":  # computed for the kept rows alone: the GEMM may round another way
            assert torch.nn.functional.mse_loss(got[name].double(), w_rows.double()) <= 1e-6 * w_rows.double().pow(2).mean()
        else:
            assert torch.equal(got[name], w_rows), name
        compared += 1
    assert compared == len(want) and compared > 50
    for name in ("layers.4.mixer_out", "layers.8.ffn_out", "decode.layers.2.ffn_out", "final_hidden"):
        assert np.array_equal(got["exact." + name].numpy(), full[name][rows.numpy()] if not name.startswith("decode.")
                              else full[name]), name


def test_a_weight_changed_in_one_layer_is_located_there_in_the_long_case(signed, tmp_path):
    """A 1e-3 relative change of layer 5's shared-expert weights (one TP shard), far below BF16's
    resolution: the float32
    recomputation departs from the goldens at that layer and tap first (*exact*)."""
    import json

    b = _copy(signed, tmp_path)
    index = json.loads((b / "weights.index.json").read_text())
    entry = next(e for e in index["tensors"]
                 if e["rank"] == 0 and e["key"].endswith("layers.5.block_sparse_moe.shared_experts.down_proj.weight"))
    t = read_tensor(b, entry)
    g = torch.Generator().manual_seed(0)
    write_tensor(b, entry, (t.float() * (1 + 1e-3 * torch.randn(t.shape, generator=g))).to(t.dtype))
    rep, cases = _run(b)
    long = cases["long_context"]
    assert long.status == "fail" and long.layer_checks == ""
    ff = long.first_failure
    assert (ff.layer, ff.tap, ff.mode) == (5, "layers.5.ffn_out", "exact"), ff.line()


def _kda_state_lost_after(n_tokens: int):
    """A KDA prefill kernel that restarts from a zero state after ``n_tokens`` of one call: right
    on every short prompt, wrong past ``n_tokens`` of a long one (a chunk-count limit)."""
    from k3bundle.executor.kda import kda_chunked_prefill
    from k3bundle.ops.contract import Backend

    def prefill(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, **kw):
        T = q.shape[0]
        if T <= n_tokens:
            return kda_chunked_prefill(q, k, v, g, beta, A_log, dt_bias, state, cu_seqlens, **kw)
        cut = lambda s, e: torch.tensor([0, e - s], dtype=cu_seqlens.dtype)  # noqa: E731
        a = slice(0, n_tokens)
        o1, _ = kda_chunked_prefill(q[a], k[a], v[a], g[a], beta[a], A_log, dt_bias, state, cut(0, n_tokens), **kw)
        b = slice(n_tokens, T)
        o2, s2 = kda_chunked_prefill(q[b], k[b], v[b], g[b], beta[b], A_log, dt_bias, torch.zeros_like(state),
                                     cut(n_tokens, T), **kw)  # BUG: the state of the first part is dropped
        return torch.cat([o1, o2]), s2

    return Backend("kda-state-lost", {"kda_chunked_prefill": prefill})


def test_a_kernel_fault_past_256_tokens_is_located_by_the_long_cases_layer_checks(signed):
    """A BF16 kernel that is right on short prompts and wrong past 256 tokens: the greedy case
    passes; the long case fails first at the first KDA layer's mixer output, teacher-forced
    (*added*: the float32 recomputation keeps the reference's kernels and still equals the
    goldens). Without layer checks the long case located nothing."""
    from k3bundle.config import load_config

    rep, cases = _run(signed["bundle"], _kda_state_lost_after(256))
    assert cases["greedy"].status == "pass"
    long = cases["long_context"]
    assert long.status == "fail"
    text = load_config(signed["bundle"] / "config.json").text
    first_kda = next(l for l in range(text.num_hidden_layers) if not text.is_mla(l))
    ff = long.first_failure
    assert (ff.layer, ff.tap, ff.mode) == (first_kda, f"layers.{first_kda}.mixer_out", "added"), ff.line()
    assert long.kernel_ops == ["kda_chunked_prefill"]  # the report names the op that ran there
    assert all(r.passed for r in long.results if r.mode == "exact")


def test_goldens_of_other_weights_skip_the_long_cases_layer_checks_and_say_why(signed, tmp_path):
    """Goldens made from the source checkpoint, judged on a bundle: not the weights the goldens
    were made from, so the reference's positions cannot be recomputed; the report says so, and the
    greedy case (every position tapped) keeps its layer checks."""
    b = _copy(signed, tmp_path)
    shutil.rmtree(b / "validation")
    generate_goldens(signed["src"], out=b / "validation", cases_dir=signed["cases"], long_tokens=LONG, noise=False)
    rep, cases = _run(b)
    assert rep.passed and rep.exact.startswith("not run")
    long = cases["long_context"]
    assert long.layer_checks == ("sampled positions: every position's layer inputs are recomputed only on the "
                                 "weights the goldens were made from, and the goldens were made from other "
                                 "weights (manifest differs)")
    assert not [r for r in long.results if r.mode in ("added", "exact")]
    assert cases["greedy"].layer_checks == "" and any(r.mode == "added" for r in cases["greedy"].results)


def test_the_layer_window_holds_one_layer_and_refuses_any_other():
    from k3bundle.executor.case import LayerWindow
    from k3bundle.executor.errors import ExecutorError

    w, x = LayerWindow(), torch.ones(3, 2)
    w.record("embed", x, 0)
    assert w("embed") is not None
    w.record("layers.0.mixer_out", x, 0)
    w.record("layers.0.ffn_out", x, 0)
    w.record("layers.0.mixer_out", x, 3)  # a decode step: not the prefill's
    w.record("logits", x, 0)  # the fed run makes its own logits
    assert torch.equal(w("layers.0.ffn_out"), x)
    with pytest.raises(ExecutorError, match="'embed' is not the reference's newest layer"):
        w("embed")
    w.record("layers.1.mixer_out", 2 * x, 0)
    w.record("final_hidden", 3 * x, 0)
    assert torch.equal(w("layers.1.mixer_out"), 2 * x) and torch.equal(w("final_hidden"), 3 * x)
    for gone in ("layers.0.mixer_out", "logits"):
        with pytest.raises(ExecutorError):
            w(gone)
