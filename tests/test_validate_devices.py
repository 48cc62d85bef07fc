"""validate's one device interface and its judge, on hand-made arrays (no model run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from k3bundle.golden.tolerances import load_tolerances, tolerance_path
from k3bundle.validate.devices import CaseOutput
from k3bundle.validate.distributed import _cause
from k3bundle.validate.errors import ValidateError
from k3bundle.validate.run import Report, judge_case
from k3bundle.validate.device_options import open_device


@pytest.fixture(scope="module")
def tol():
    return load_tolerances(tolerance_path("bf16"))


def _golden():
    g = torch.Generator().manual_seed(0)
    return {"positions": np.arange(4), "greedy_tokens": np.zeros(0, np.int64),
            "logits": torch.randn(4, 32, generator=g, dtype=torch.float64).numpy(),
            "layers.0.mixer_out": torch.randn(4, 8, generator=g, dtype=torch.float64).numpy(),
            "layers.0.router_margin": np.ones(4)}


def _out(cand):
    return CaseOutput(cand, None, "added", lambda n: None, True)


def test_identical_candidate_passes(tol):
    golden = _golden()
    cand = {k: torch.from_numpy(v) for k, v in golden.items()}
    rep = judge_case("c", "greedy", golden, _out(cand), tol)
    assert rep.status == "pass"
    assert {r.tap for r in rep.results} == {"logits", "layers.0.mixer_out"}  # margins are evidence, not judged


def test_a_case_with_no_comparisons_is_not_run(tol):
    rep = judge_case("c", "greedy", _golden(), _out({}), tol)
    assert rep.status == "not run" and "no comparisons" in rep.reason
    report = Report("b", "device", "cpu", tol, [rep], {})
    assert not report.passed  # nothing passed: no sign-off


def test_a_perturbed_tap_fails_and_is_named(tol):
    golden = _golden()
    cand = {k: torch.from_numpy(v.copy()) for k, v in golden.items()}
    cand["layers.0.mixer_out"] = cand["layers.0.mixer_out"] * 1.2
    rep = judge_case("c", "greedy", golden, _out(cand), tol)
    assert rep.status == "fail" and rep.first_failure.tap == "layers.0.mixer_out"


def test_torchrun_failure_names_the_cause():
    out = """[rank1]: Traceback (most recent call last):
[rank1]:   File "worker.py", line 40, in _gather_heads
[rank1]: RuntimeError: No backend type associated with device type cpu
E1201 00:00:00 failed (exitcode: 1) local_rank: 1
============================================================
k3bundle.validate.worker FAILED
------------------------------------------------------------
============================================================"""
    assert _cause(out) == "rank 1: RuntimeError: No backend type associated with device type cpu"
    assert _cause("") == "(no output)"


def test_open_device_rejects_what_it_cannot_run(tmp_path: Path):
    with pytest.raises(ValidateError, match="neither a bundle"):
        open_device(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValidateError, match="needs a bundle"):
        open_device(tmp_path, ranks="distributed")
    with pytest.raises(ValidateError, match="merged or distributed"):
        open_device(tmp_path, ranks="sideways")


def test_router_flip_exempt_only_within_the_devices_margin_noise(tol):
    from k3bundle.validate.compare import compare_router

    ref = torch.tensor([[0, 1]] * 1000)
    flipped = ref.clone()
    flipped[:5, 1] = 2  # 5 tokens of 1000 chose another expert: 0.995 < 0.999
    margin = torch.full((1000,), 0.05)  # far above near_tie_eps (2e-3)
    assert not compare_router("c", "layers.1.router_ids", ref, flipped, margin, tol).passed
    small = torch.full((1000,), 1e-3)  # noise std: 4 sigma = 4e-3 < 0.05, still a fault
    assert not compare_router("c", "layers.1.router_ids", ref, flipped, margin, tol, small).passed
    big = torch.full((1000,), 0.02)  # 4 sigma = 0.08 > 0.05: the flips are arithmetic
    r = compare_router("c", "layers.1.router_ids", ref, flipped, margin, tol, big)
    assert r.passed and r.values["near_tie_exempt"] == 5


def test_margin_noise_follows_the_input_precision():
    """The estimate matches the spread that the device's router-input chain really causes: the
    golden float32 norm output vs the same norm in the BF16 device policy (input cast, the
    norm's output rounding, the gain)."""
    from k3bundle.executor.latent_moe import margin_noise
    from k3bundle.executor.norms import rms_norm

    g = torch.Generator().manual_seed(1)
    h = torch.randn(256, 512, generator=g)
    gain = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16)
    w = (torch.randn(64, 512, generator=g) / 22).to(torch.bfloat16).float()
    x = rms_norm(h, gain.float(), 1e-6)  # golden: float32
    xd = rms_norm(h.to(torch.bfloat16), gain, 1e-6)  # device: bf16 activations
    s, sd = torch.sigmoid(x @ w.T), torch.sigmoid(xd.float() @ w.T)
    top = torch.topk(s, 3, dim=-1).indices
    bf16 = margin_noise(xd.float(), w, sd, top, 2, torch.finfo(torch.bfloat16).eps / 2)
    f32 = margin_noise(x, w, s, top, 2, torch.finfo(torch.float32).eps / 2)
    assert bool((f32 == 0).all()) and bool((bf16 > 0).all())
    pair = top[:, 1:3]
    d = (sd - s).gather(-1, pair)
    moved = (d[:, 0] - d[:, 1]).pow(2).mean().sqrt()
    ratio = float(moved / bf16.pow(2).mean().sqrt())
    assert 0.5 < ratio < 1.0, ratio  # conservative (measured 0.72), never far off


# ---- resident weights: a teacher-forced run asks for each layer again at every decode step ----

def test_resident_bundle_weights_read_each_tensor_once_and_equal_fresh_reads(tiny_ckpt, tmp_path_factory,
                                                                              monkeypatch):
    from tests._bundles import bundle_for
    from k3bundle.bundle import weights as bw_mod

    bundle = bundle_for("h200-tp16-ep16", tiny_ckpt, tmp_path_factory)
    reads = []
    real_get = bw_mod._Files.get
    monkeypatch.setattr(bw_mod._Files, "get", lambda self, e, x=None: reads.append(e["key"]) or real_get(self, e, x))
    fresh = bw_mod.BundleWeights(bundle, dtype="float32")
    kept = bw_mod.BundleWeights(bundle, dtype="float32", resident_bytes=1 << 40)
    moe = next(i for i in range(kept.config.text.num_hidden_layers) if kept.config.text.is_moe(i))
    for w in (fresh, kept):
        for _ in range(2):
            reads.clear()
            W = w.layer(moe)
            for e in range(3):
                W.expert(e)
            w.reads = getattr(w, "reads", []) + [len(reads)]
    assert fresh.reads[0] > 0 and fresh.reads[1] == fresh.reads[0]  # no budget: every request reads again
    assert kept.reads[0] == fresh.reads[0] and kept.reads[1] == 0  # resident: the second request reads nothing
    assert kept.expert_reads == 3 and 0 < kept.kept_bytes
    a, b = fresh.layer(moe), kept.layer(moe)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a.expert(2)["moe.expert.w2"], b.expert(2)["moe.expert.w2"])


def test_resident_budget_is_never_exceeded(tiny_ckpt, tmp_path_factory):
    from tests._bundles import bundle_for
    from k3bundle.bundle.weights import BundleWeights

    bundle = bundle_for("h200-tp16-ep16", tiny_ckpt, tmp_path_factory)
    full = BundleWeights(bundle, dtype="float32", resident_bytes=1 << 40)
    for layer in range(full.config.text.num_hidden_layers):
        full.layer(layer)
    budget = full.kept_bytes // 3
    part = BundleWeights(bundle, dtype="float32", resident_bytes=budget)
    for layer in range(part.config.text.num_hidden_layers):
        part.layer(layer)
    assert 0 < part.kept_bytes <= budget < full.kept_bytes


def test_host_resident_budget_is_capped_whatever_the_ram():
    """On a CPU device the cache is bounded in bytes, not only as a share of the RAM: a command's peak
    RSS must not grow with the machine (docs/performance.md "Release scale")."""
    from k3bundle.executor.weights import HOST_RESIDENT_MAX, RESIDENT_SHARE, resident_budget

    available = int(next(line for line in open("/proc/meminfo") if line.startswith("MemAvailable:")).split()[1]) * 1024
    for dtype, share in RESIDENT_SHARE.items():
        assert resident_budget("cpu", dtype) == min(int(available * share), HOST_RESIDENT_MAX) or \
            abs(resident_budget("cpu", dtype) - available * share) < 64 << 20  # MemAvailable moves between reads
        assert resident_budget("cpu", dtype) <= HOST_RESIDENT_MAX
        assert resident_budget("cpu", dtype, processes=4) <= HOST_RESIDENT_MAX // 4


@pytest.mark.parametrize("name", ["b300-tp8", "h200-tp16-ep16", "gb300-dep16"])
def test_stacked_experts_decoded_as_one_stack_equal_the_one_by_one_reads(tiny_ckpt, tmp_path_factory, name):
    """The grouped MoE form asks a bundle for a group of experts at once (ops.expert_weight.values):
    each rank's slices are decoded as one stack. The oracle is the one-expert read (_tensor), merged
    and per rank, bit for bit; a group's values come back in the order asked."""
    from tests._bundles import bundle_for
    from k3bundle.bundle.weights import BundleWeights
    from k3bundle.ops.expert_weight import values

    bundle = bundle_for(name, tiny_ckpt, tmp_path_factory)
    for rank in (None, 1):
        bw = BundleWeights(bundle, dtype="float32", rank=rank)
        moe = next(i for i in range(bw.config.text.num_hidden_layers) if bw.config.text.is_moe(i))
        W = bw.layer(moe)
        ids = [e for e in (5, 0, 3, 7, 2) if W.stored_expert(e) is not None]
        experts = [W.stored_expert(e) for e in ids]
        for role in ("moe.expert.w1", "moe.expert.w2", "moe.expert.w3"):
            got = values([E[role] for E in experts])
            for e, E, v in zip(ids, experts, got):
                assert E[role].shape == tuple(v.shape)
                assert torch.equal(v, bw._tensor(role, moe, e)), (name, rank, role, e)
