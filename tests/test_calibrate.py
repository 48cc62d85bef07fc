"""The calibration harness (k3bundle.calibrate), small: one trained-tiny bundle, CPU.

The full run is a benchmark (docs/validation.md "Calibration"); here one job checks that the
harness records a clean bundle's checks and that planted faults are detected and located at
the tap where they were planted, and that the separation/rate summaries read those records.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from k3bundle.calibrate import jobs, records as records_, tables
from k3bundle.calibrate.tolerance_for import TOLERANCE_FOR


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("cal")
    job = {"root": str(root), "preset": "tiny-trained", "seed": 1, "layout": "b300-tp8", "device": "cpu",
           "long_tokens": 96, "threads": 2, "clean": True, "worker": "t",
           "faults": ["dt_bias", "router_bias", "transposed_shard", "weight_1e-3", "kda_state_late",
                      "mla_row_dropped"]}
    return jobs.run_job(job)


def test_clean_bundle_passes_every_case(records):
    clean = [r for r in records if r["fault"] is None]
    assert {r["case"] for r in clean} >= {"greedy", "thinking", "tool_call", "multi_turn", "long_context"}
    assert all(r["status"] == "pass" for r in clean), [r["reason"] for r in clean]
    # every case has layer checks, the long one (sampled positions) on its recomputed reference
    assert all("added/mixer_out/nmse" in r["checks"] for r in clean)
    # on the CPU validate's teacher-forced pass is the goldens' own teacher-forced BF16 run (the
    # long case's fed a float32 replay of itself in both), so an added limit widened by
    # noise.added_factor sits that factor above the device's value
    ratios = [(r["case"], r["added_noise_ratio"]) for r in clean]
    assert "long_context" in dict(ratios) and all(v == 1.0 for _, v in ratios), ratios


def test_planted_faults_are_located(records):
    faulted = {r["fault"]: r for r in records if r["fault"] is not None}
    assert set(faulted) == {"dt_bias", "router_bias", "transposed_shard", "weight_1e-3", "kda_state_late",
                            "mla_row_dropped"}
    for name, r in faulted.items():
        assert r["status"] == "fail", name
        assert r["first_failure"]["tap"] == r["planted"]["tap"], (name, r["first_failure"])
    # below the BF16 floor only the exact check (float32 on the goldens' weights) sees it
    assert faulted["weight_1e-3"]["first_failure"]["mode"] == "exact"
    # a serving-path fault is seen by the teacher-forced decode step, at the layer whose cache it hit
    assert faulted["kda_state_late"]["first_failure"]["tap"].startswith("decode.layers.")
    assert faulted["mla_row_dropped"]["first_failure"]["mode"] in ("added", "exact")


def test_clean_bundle_reproduces_the_goldens_exactly(records):
    """float32 on the goldens' own weights, same machine: the exact check's clean value is 0."""
    exact = [v for r in records if r["fault"] is None for k, v in r["checks"].items() if k == "exact/mixer_out/nmse"]
    assert exact and max(exact) == 0.0


def test_summaries_read_the_records(records):
    sep = tables.separation(records)
    t = sep["added/mixer_out/nmse"]
    assert t["clean_n"] >= 4 and t["clean_worst"] < 3e-4  # the bf16 limit holds on the trained model
    assert t["fault_best"] is not None and t["fault_best"] > t["clean_worst"]
    rates = tables.rates(records)
    assert rates["clean_bundle_failures"] == 0 and rates["clean_bundles"] == 1
    assert all(v["located"] == v["runs"] == 1 for v in rates["faults"].values())


def test_a_rerun_runs_only_what_the_records_lack(tmp_path):
    """Records are written as they are made: a job stopped after its clean cases and one fault
    reruns with the other faults only; a job holding everything is not rerun; an error record
    holds nothing."""
    import json

    def rec(seed, fault, status="pass"):
        return {"preset": "tiny", "seed": seed, "layout": "b300-tp8", "device": "cpu", "fault": fault,
                "case": "greedy", "status": status}
    lines = [rec(1, None), rec(1, "dt_bias", "fail"), rec(2, None), rec(2, "dt_bias", "fail"),
             rec(2, "swap_experts", "fail"), rec(3, None, "error")]
    (tmp_path / jobs.RECORDS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = jobs.make_jobs(tmp_path, [("tiny", [1, 2, 3, 4])], ["b300-tp8"], "cpu", ["dt_bias", "swap_experts"])
    assert [(j["seed"], j["clean"], j["faults"]) for j in got] == [
        (1, False, ["swap_experts"]), (3, True, ["dt_bias", "swap_experts"]), (4, True, ["dt_bias", "swap_experts"])]


def test_a_job_hands_over_each_batch_of_records_as_it_is_made(tmp_path, monkeypatch):
    """run_job's emit sees the clean cases, then each fault, before the job ends: a job that dies
    at its second fault has the first one's record on disk."""
    calls = []
    monkeypatch.setattr(jobs, "judge", lambda *a, **k: ([], {}))

    def judge_fault(bundle, inter, name, *a):
        if name == "boom":
            raise RuntimeError("planted")
        return [{"fault": name, "case": "greedy", "status": "fail"}]
    monkeypatch.setattr(jobs, "judge_fault", judge_fault)
    import k3bundle.convert as C
    import k3bundle.golden.generate as G
    import k3bundle.synth as S
    monkeypatch.setattr(S, "write_synthetic", lambda path, **k: path.mkdir(parents=True))
    monkeypatch.setattr(C, "convert", lambda ckpt, layout, out, workers=1: out.mkdir(parents=True))
    monkeypatch.setattr(G, "generate_goldens", lambda *a, **k: None)
    job = {"root": str(tmp_path), "preset": "tiny", "seed": 5, "layout": "b300-tp8", "device": "cpu",
           "long_tokens": 96, "threads": 1, "clean": True, "worker": "w", "faults": ["dt_bias", "boom"]}
    with pytest.raises(RuntimeError, match="planted"):
        jobs.run_job(job, emit=lambda batch: calls.append([r["fault"] for r in batch]))
    assert calls == [[], ["dt_bias"]]


def test_clean_counts_group_by_preset_and_layout():
    """Hand-built records: a failing case fails its bundle once; faulted runs are not clean runs;
    a job that errored and was rerun counts once, as judged; one that only errored is counted apart."""
    def rec(preset, seed, layout, case, status, fault=None):
        return {"preset": preset, "seed": seed, "layout": layout, "device": "cpu", "case": case,
                "status": status, "fault": fault}
    rows = tables.clean_counts([
        rec("tiny", 1, "b300-tp8", "greedy", "pass"), rec("tiny", 1, "b300-tp8", "thinking", "fail"),
        rec("tiny", 1, "b300-tp8", "long_context", "fail"), rec("tiny", 2, "b300-tp8", "greedy", "pass"),
        rec("tiny", 2, "b300-tp8", "greedy", "fail", fault="dt_bias"),
        rec("tiny", 3, "b300-tp8", None, "error"), rec("tiny", 3, "b300-tp8", "greedy", "pass"),
        rec("tiny", 4, "b300-tp8", None, "error"),
        rec("small", 7, "mi355x-tp8", "greedy", "pass")])
    assert rows == [
        {"preset": "small", "layout": "mi355x-tp8", "device": "cpu", "seeds": [7], "bundles": 1,
         "failed_bundles": 0, "cases": 1, "failed_cases": 0, "errors": 0},
        {"preset": "tiny", "layout": "b300-tp8", "device": "cpu", "seeds": [1, 2, 3], "bundles": 3,
         "failed_bundles": 1, "cases": 5, "failed_cases": 2, "errors": 1}]


# ---------------------------------------------------------------- the shipped limits and their evidence
REPO = Path(__file__).resolve().parents[1]
CAL = REPO / "tolerances" / "calibration"


def _calibration_records():
    return records_.load_records([CAL / "records-2026-12-01-cpu-calibration.jsonl.gz",
                                   CAL / "records-2026-12-01-cpu-calibration-2.jsonl.gz",
                                   CAL / "records-2026-12-03-cuda-exact.jsonl.gz"], None)


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_shipped_limits_sit_between_clean_and_faulted(name):
    """Recomputed from the committed calibration records (seeds 0-4): the file's calibration
    section is what they give, and every teacher-forced limit passes the worst clean value and
    fails the least severe fault located there."""
    from k3bundle.golden.tolerances import load_tolerances, tolerance_path
    recs = [r for r in _calibration_records() if r["seed"] in range(5)]
    path = tolerance_path(name)
    layouts = [k for k, v in TOLERANCE_FOR.items() if v == name]
    table = tables.separation([r for r in recs if r["layout"] in layouts])
    tol = load_tolerances(path)
    expected = {k: t["clean_worst"] for k, t in table.items()
                if t["clean_worst"] is not None and k.rsplit("/", 1)[1] in tables.GATED}
    assert set(tol.calibrated_clean_worst) == set(expected)
    for k, v in expected.items():
        assert tol.calibrated_clean_worst[k] == pytest.approx(v, rel=1e-7, abs=1e-12), k
    rows = {r["key"]: r for r in tables.limit_rows(table, tol)}
    teacher_forced = [k for k in rows if k.split("/")[0] in ("added", "router")]
    assert len(teacher_forced) >= 10
    for k in teacher_forced:
        assert rows[k]["between"], rows[k]
    if name == "bf16":  # the stated safety: >= 2x the clean worst on CPU and the H200, <= 1/2 the least severe fault
        for k in teacher_forced:
            assert rows[k]["safety"] >= 2.0, rows[k]
            assert rows[k]["headroom"] is None or rows[k]["headroom"] >= 2.0, rows[k]


def test_the_exact_gpu_limit_sits_far_between_clean_and_faulted():
    """The exact check where a GPU is on a side: the limit is >= 100x the calibrated clean worst
    (the H200 against CPU goldens, seeds 0-2) and <= 1/100 of the least severe fault it located on
    held-out CUDA bundles (the only faulted CUDA runs with the check on), in every tolerance file."""
    from k3bundle.golden.tolerances import load_tolerances, tolerance_path
    clean = [r for r in _calibration_records() if r["device"] == "cuda" and r["seed"] in range(5)]
    assert len({(r["preset"], r["seed"], r["layout"]) for r in clean}) == 12
    faulted = records_.load_records([CAL / "records-2026-12-03-cuda-exact-faults.jsonl.gz"], None)
    table = tables.separation(clean + faulted)
    keys = [k for k in table if k.startswith("exact_gpu/") and k.endswith("/nmse")]
    assert len(keys) == 6
    located = [table[k]["fault_best"] for k in keys if table[k]["fault_best"] is not None]
    assert located  # the 1e-3 weight change and the NVFP4 scale byte are below BF16: only this check sees them
    for name in ("bf16", "fp8", "mxfp4"):
        tol = load_tolerances(tolerance_path(name))
        for k in keys:
            limit = tables.limit_of(tol, k)
            assert limit >= 100 * table[k]["clean_worst"], (name, k)
            assert table[k]["fault_best"] is None or table[k]["fault_best"] >= 100 * limit, (name, k)
