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
from k3bundle.validate.sources import open_device


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
    assert _cause(out).endswith("RuntimeError: No backend type associated with device type cpu")
    assert _cause("") == "(no output)"


def test_open_device_rejects_what_it_cannot_run(tmp_path: Path):
    with pytest.raises(ValidateError, match="neither a bundle"):
        open_device(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValidateError, match="needs a bundle"):
        open_device(tmp_path, ranks="distributed")
    with pytest.raises(ValidateError, match="merged or distributed"):
        open_device(tmp_path, ranks="sideways")
