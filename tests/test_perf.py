"""``k3bundle perf``: workloads, the arithmetic, and a short sweep against a live ``k3bundle serve``.

Oracles: percentiles worked by hand and numpy's; the speculative-decoding normalisation worked by
hand from its definition; the agentic workload's median and prefix reuse recomputed with
``statistics``; throughput and TTFT recomputed from the timings this test records itself around
every request; the checklist's own performance stage reading the report the sweep wrote.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import pytest

from k3bundle.endpoint import Endpoint
from tests._bundles import single_threaded_torch  # noqa: F401  (autouse: one torch thread)
from tests._serving import serving
from tests.conftest import REPO, run_cli

TARGET = "b300-tp8"
SCALE = 0.0005  # agentic at this scale: prompts of 7 and 135 tokens, 2 turns, 2 output tokens


# ---- pure arithmetic --------------------------------------------------------------------------


def test_percentiles_match_a_hand_worked_example_and_numpy():
    from k3bundle.endpoint.perf import percentile

    xs = [4.0, 1.0, 10.0, 3.0, 2.0]  # sorted 1 2 3 4 10
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 99) == pytest.approx(4 + 0.96 * (10 - 4))  # position 4 × 0.99 = 3.96
    assert percentile(xs, 25) == 2.0 and percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        v = rng.exponential(size=n).tolist()
        for q in (50, 90, 99):
            assert percentile(v, q) == pytest.approx(float(np.percentile(v, q)), rel=1e-12)


def test_request_tpot_is_first_to_last_chunk_over_the_tokens_after_the_first():
    from k3bundle.endpoint.perf import request_tpot

    assert request_tpot([0.1, 0.2, 0.3], 4) == pytest.approx(0.6 / 3)
    assert request_tpot([0.3], 4) == pytest.approx(0.1)  # 3 tokens after the first, in one chunk
    assert request_tpot([], 1) is None


def test_speculative_normalisation_worked_by_hand():
    from k3bundle.endpoint.perf import spec_normalise

    # 10 verification steps drafting 3 tokens each (30), 20 accepted: each step emits 2 accepted + 1 = 3
    s = spec_normalise(0.010, drafts=10, draft_tokens=30, accepted=20)
    assert s["tokens_per_step"] == pytest.approx(3.0)
    assert s["acceptance_rate"] == pytest.approx(2 / 3)
    assert s["tpot_per_step_s"] == pytest.approx(0.030)  # one step yields 3 tokens of 10 ms each
    assert s["tpot_per_drafted_token_s"] == pytest.approx(0.030 / 4)  # a step verifies 1 + 3 tokens
    assert s["tpot_per_accepted_token_s"] == pytest.approx(0.010)


def test_a_levels_spec_figures_come_from_the_counters_growth_or_the_streamed_chunks():
    from k3bundle.endpoint.perf import NOT_REPORTED, RequestRecord, spec_figures

    stats = {"tpot_p50_s": 0.010}
    # /metrics: 10 steps, 30 drafted, 20 accepted over the level (counters were already at 5/15/9)
    before = {"drafts": 5.0, "draft_tokens": 15.0, "accepted": 9.0}
    after = {"drafts": 15.0, "draft_tokens": 45.0, "accepted": 29.0}
    s = spec_figures(stats, [], before, after, None)
    assert (s["drafts"], s["draft_tokens"], s["accepted"]) == (10.0, 30.0, 20.0)
    assert s["tokens_per_step"] == pytest.approx(3.0) and "/metrics" in s["source"]
    # streamed chunks with --draft-tokens 2: 9 tokens after the first in 3 chunks = 3 steps, 6 accepted
    rec = RequestRecord(0, 0, 0, 10, 10, 4, 0.0, 0.1, 0.5, 0.01)
    s = spec_figures(stats, [rec], None, None, 2)
    assert (s["drafts"], s["draft_tokens"], s["accepted"]) == (3, 6, 6)
    assert s["acceptance_rate"] == pytest.approx(1.0) and s["tokens_per_step"] == pytest.approx(3.0)
    assert spec_figures(stats, [rec], None, None, None) == NOT_REPORTED
    assert spec_figures(stats, [rec], before, before, None) == NOT_REPORTED  # counters that did not move


def test_vllm_spec_decode_counters_are_read_from_prometheus_text():
    from k3bundle.endpoint.perf import parse_metrics

    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="k3"} 100.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="k3"} 50.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="k3"} 450.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="k3"} 300.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 99.0',
        'vllm:generation_tokens_total{engine="0"} 7.0'])
    assert parse_metrics(text) == {"drafts": 150.0, "draft_tokens": 450.0, "accepted": 300.0}
    assert parse_metrics("vllm:generation_tokens_total 7.0\n") == {}


# ---- workloads --------------------------------------------------------------------------------


def test_the_agentic_workload_states_the_published_shape_and_reuses_its_prefix():
    from k3bundle.endpoint.workloads import load_workload

    w = load_workload("agentic")
    assert (w.input_tokens, w.output_tokens, w.turns, w.scale) == (142_000, 444, 65, 1.0)
    lengths = w.turn_lengths()
    assert len(lengths) == 65 and statistics.median(lengths) == 142_000
    small = w.scaled(SCALE)
    turns = small.session(0)
    assert [len(t) for t in turns] == small.turn_lengths() == [7, 135]
    assert turns[1][:7] == turns[0]  # the second turn's prompt extends the first
    assert small.session(0) == turns and small.session(1) != turns  # seeded per session
    lo, hi = small.token_id_range
    assert all(lo <= i < hi for t in turns for i in t)
    for name, (n_in, n_out) in {"8k-1k": (8192, 1024), "1k-1k": (1024, 1024)}.items():
        one = load_workload(name)
        assert (one.input_tokens, one.output_tokens, one.turns) == (n_in, n_out, 1)


@pytest.mark.parametrize("edit, key", [
    ({"turns": "many"}, "turns"),
    ({"prompt": "audio"}, "prompt"),
    ({"colour": "blue"}, "colour"),
    ({"token_id_range": [768, 32]}, "token_id_range"),
    ({"first_turn_input_tokens": 200_000}, "first_turn_input_tokens"),
])
def test_a_bad_workload_field_is_one_line_naming_file_and_key(tmp_path, edit, key):
    import yaml

    from k3bundle.endpoint.workloads import WorkloadError, load_workload

    doc = yaml.safe_load((REPO / "golden" / "workloads" / "agentic.yaml").read_text()) | edit
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    with pytest.raises(WorkloadError) as e:
        load_workload(str(bad))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{bad}: ") and key in msg


@pytest.mark.parametrize("tail, key", [("seed: 1\n", "seed"), ("colour: blue\n", "colour")])
def test_the_command_refuses_a_bad_workload_file_before_sending_anything(tmp_path, tail, key):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "golden" / "workloads" / "1k-1k.yaml").read_text() + tail)  # seed twice; a stray key
    out = tmp_path / "out"
    r = run_cli("perf", "--endpoint", "http://127.0.0.1:9/v1", "--workload", str(bad), "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and key in lines[0], r.stderr
    assert not out.exists()


# ---- a live sweep -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tiny_trained_ckpt):
    from k3bundle.serve import Engine

    with serving(Engine(tiny_trained_ckpt, max_model_len=1024)) as u:
        yield u


class _TimedEndpoint(Endpoint):
    """The client, with this test's own clock around every request: (start, end, tokens, TTFT)."""

    def __init__(self, url):
        super().__init__(url)
        self.seen: list[tuple[float, float, int, float]] = []

    def complete(self, prompt, **kw):
        start = time.perf_counter()
        r = super().complete(prompt, **kw)
        self.seen.append((start, time.perf_counter(), r.timing.completion_tokens, r.timing.ttft_s))
        return r


def test_a_sweep_at_concurrency_1_and_2_writes_a_report_the_checklist_ticks(url, tiny_trained_ckpt, tmp_path):
    from k3bundle.checklist.build import performance_bounds
    from k3bundle.checklist.stages import evaluate_stages
    from k3bundle.endpoint.perf import sweep
    from k3bundle.endpoint.perf_report import to_json, write_report
    from k3bundle.endpoint.workloads import load_workload

    w = load_workload("agentic").scaled(SCALE)
    bounds = performance_bounds(TARGET, config=tiny_trained_ckpt / "config.json")
    ep = _TimedEndpoint(url)
    levels = []
    for c in (1, 2):
        ep.seen.clear()
        levels += sweep(ep, w, [c], bounds)
        lv, seen = levels[-1], list(ep.seen)
        assert lv.stats["requests"] == len(seen) == c * w.turns
        # throughput from this test's own clock: the level's wall time spans every request it timed
        span = max(e for _, e, _, _ in seen) - min(s for s, _, _, _ in seen)
        tokens = sum(n for _, _, n, _ in seen)
        assert lv.stats["output_tokens"] == tokens and all(n == w.output_tokens for _, _, n, _ in seen)
        assert lv.stats["output_throughput_tokens_per_s"] == pytest.approx(tokens / span, rel=0.05)
        assert lv.stats["request_throughput_per_s"] == pytest.approx(len(seen) / span, rel=0.05)
        ttft = [t for _, _, _, t in seen]
        assert lv.stats["ttft_p50_s"] == pytest.approx(float(np.percentile(ttft, 50)))
        assert lv.stats["ttft_p99_s"] == pytest.approx(float(np.percentile(ttft, 99)))
        assert all(t <= e - s for s, e, _, t in seen)
        # each figure over the checklist's own bound for this concurrency
        b = lv.bounds
        assert b["tpot_bound_s"] == bounds(c, b["context"])[0] and b["ttft_bound_s"] == bounds(1, b["context"])[1]
        assert b["tpot_p50_ratio"] == pytest.approx(lv.stats["tpot_p50_s"] / b["tpot_bound_s"])
        assert lv.spec == "not reported by the endpoint"

    doc = to_json(ep.base_url, ep.model, w, TARGET, levels)
    j, h = write_report(doc, levels, tmp_path / "reports")
    assert json.loads(j.read_text())["runs"] == doc["runs"] and "<svg" in h.read_text()

    def stage(runs=None):
        if runs is not None:
            j.write_text(json.dumps(doc | {"runs": runs}))
        stages = evaluate_stages(TARGET, True, "", tmp_path, bounds, verify_fn=None)
        return next(s for s in stages if s.key == "performance")

    s = stage()
    assert s.done, s.missing
    assert len(s.notes) == 2 and all("agentic" in n for n in s.notes)
    # the reader takes TTFT's bound at ttft_batch: between the batch-1 and batch-2 bounds passes only with it
    run = dict(doc["runs"][1])
    n = run["context"]
    assert bounds(2, n)[1] > bounds(1, n)[1]
    run["ttft_s"] = (bounds(1, n)[1] + bounds(2, n)[1]) / 2
    assert stage([run]).done
    assert "faster than the roofline" in stage([{k: v for k, v in run.items() if k != "ttft_batch"}]).missing
    assert "faster than the roofline" in stage([run | {"tpot_s": bounds(2, n)[0] / 2}]).missing


def test_the_command_writes_the_json_and_page(url, tmp_path):
    out = tmp_path / "perf"
    r = run_cli("perf", "--endpoint", url, "--workload", "1k-1k", "--scale", "0.002", "--concurrency", "1",
                "--target", TARGET, "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    doc = json.loads((out / "performance.json").read_text())
    assert doc["kind"] == "k3bundle.performance" and doc["runs"] == summary["runs"]
    assert [x["batch"] for x in doc["runs"]] == [1] and doc["levels"][0]["requests"] == 4
    assert "Performance: 1k-1k" in (out / "performance.html").read_text()
    assert not (tmp_path / "out").exists()
