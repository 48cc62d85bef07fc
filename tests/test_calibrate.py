"""The calibration harness (bench/calibrate.py), small: one trained-tiny bundle, CPU.

The full run is a benchmark (docs/validation.md "Calibration"); here one job checks that the
harness records a clean bundle's checks and that planted faults are detected and located at
the tap where they were planted, and that the separation/rate summaries read those records.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
calibrate = pytest.importorskip("calibrate")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("cal")
    job = {"root": str(root), "preset": "tiny-trained", "seed": 1, "layout": "b300-tp8", "device": "cpu",
           "long_tokens": 96, "threads": 2, "clean": True, "worker": "t",
           "faults": ["dt_bias", "router_bias", "transposed_shard", "weight_1e-1"]}
    return calibrate.run_job(job)


def test_clean_bundle_passes_every_case(records):
    clean = [r for r in records if r["fault"] is None]
    assert {r["case"] for r in clean} >= {"greedy", "thinking", "tool_call", "multi_turn", "long_context"}
    assert all(r["status"] == "pass" for r in clean), [r["reason"] for r in clean]
    assert all("added/mixer_out/nmse" in r["checks"] for r in clean if r["case"] != "long_context")


def test_planted_faults_are_located(records):
    faulted = {r["fault"]: r for r in records if r["fault"] is not None}
    assert set(faulted) == {"dt_bias", "router_bias", "transposed_shard", "weight_1e-1"}
    for name, r in faulted.items():
        assert r["status"] == "fail", name
        assert r["first_failure"]["tap"] == r["planted"]["tap"], (name, r["first_failure"])


def test_summaries_read_the_records(records):
    sep = calibrate.separation(records)
    t = sep["added/mixer_out/nmse"]
    assert t["clean_n"] >= 4 and t["clean_worst"] < 3e-4  # the bf16 limit holds on the trained model
    assert t["fault_best"] is not None and t["fault_best"] > t["clean_worst"]
    rates = calibrate.rates(records, None)
    assert rates["clean_bundle_failures"] == 0 and rates["clean_bundles"] == 1
    assert all(v["located"] == v["runs"] == 1 for v in rates["faults"].values())
