"""``perf``, ``soak`` and ``faults`` given BUNDLE: each serves it here, runs, stops it, reports in BUNDLE/reports.

Oracles: the executor's own greedy loop (``Executor.generate``) on the prompt the test renders
for the soak's recorded first answers; the workload's token counts worked out here for perf; the
checkpoint's own config.json for the context length the over-context fault must name; a TCP
connect the test makes itself for the server being gone after the block.
"""

from __future__ import annotations

import json
import shutil
import socket
from urllib.parse import urlparse

import pytest

from tests._bundles import single_threaded_torch  # noqa: F401  (autouse: one torch thread)
from tests.conftest import REPO, run_cli

ENV = {"K3BUNDLE_THREADS": "1"}


@pytest.fixture
def ckpt(tiny_trained_ckpt, tmp_path):
    """A private copy: the commands write its reports/."""
    return shutil.copytree(tiny_trained_ckpt, tmp_path / "tiny-trained")


def _refused(url: str) -> bool:
    u = urlparse(url)
    with socket.socket() as s:
        return s.connect_ex((u.hostname, u.port)) != 0


def test_the_local_server_answers_in_the_block_and_is_gone_after_it_also_on_error(tiny_trained_ckpt):
    from k3bundle.endpoint import Endpoint
    from k3bundle.serve.local import serving

    with serving(tiny_trained_ckpt) as url:
        assert Endpoint(url).models() == ["tiny-trained"]
    assert _refused(url)
    with pytest.raises(KeyboardInterrupt), serving(tiny_trained_ckpt) as url:
        assert not _refused(url)
        raise KeyboardInterrupt  # Ctrl-C in the command's body
    assert _refused(url)


def test_soak_bundle_serves_it_and_records_the_executors_greedy_answer(ckpt):
    from k3bundle.bundle.open_weights import open_weights
    from k3bundle.executor import Executor
    from k3bundle.golden.cases import load_cases
    from k3bundle.tokenizer import load_tiktoken

    steps = 4
    r = run_cli("soak", str(ckpt), "--minutes", "0.05", "--max-tokens", str(steps), "--case", "greedy", env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((ckpt / "reports" / "soak.json").read_text())
    assert doc["verdict"] == "PASS" and doc["complete"] is True and doc["requests"] >= 1
    assert doc["endpoint"].startswith("http://127.0.0.1:") and doc["host_memory"]["source"] == "pid"
    prompt = load_tiktoken(ckpt).encode(next(c for c in load_cases(REPO / "golden" / "cases") if c.name == "greedy").prompt)
    want = Executor(open_weights(ckpt, "float32", "cpu")).generate(prompt, steps).tokens
    assert doc["reference_outputs"]["greedy"]["token_ids"] == want
    assert _refused(doc["endpoint"])  # stopped with the command


def test_perf_bundle_sweeps_the_served_bundle_into_its_reports(ckpt):
    from k3bundle.endpoint.workloads import load_workload

    r = run_cli("perf", str(ckpt), "--workload", "1k-1k", "--scale", "0.002", "--concurrency", "1", env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((ckpt / "reports" / "performance.json").read_text())
    w = load_workload("1k-1k").scaled(0.002)  # 2 input and 2 output tokens a request
    lv = doc["levels"][0]
    assert [x["batch"] for x in doc["runs"]] == [1] and lv["requests"] == 4
    assert lv["output_tokens"] == lv["requests"] * w.output_tokens
    assert doc["endpoint"].startswith("http://127.0.0.1:") and doc["model"] == "tiny-trained"
    assert (ckpt / "reports" / "performance.html").is_file()


def test_faults_bundle_runs_the_endpoint_faults_and_locates_a_corrupted_cache_page(ckpt):
    from k3bundle.checklist.stages import fault_paths_stage
    from k3bundle.config import load_config

    text = json.loads((ckpt / "config.json").read_text())["text_config"]
    context = text["max_position_embeddings"]
    r = run_cli("faults", str(ckpt), "--max-tokens", "4", "--timeout", "60", env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {f["fault"]: f for f in json.loads((ckpt / "reports" / "faults.json").read_text())["faults"]}
    over = got["over_context"]
    assert over["outcome"] == "clean_error" and over["revalidated"] is True
    assert f"maximum context length is {context} tokens" in over["error"]
    assert got["client_disconnect"]["outcome"] == "survived" and got["malformed_request"]["revalidated"] is True
    # planted on the bundle's own serving path: each located at the first KDA layer, on the array it breaks
    kda0 = load_config(ckpt / "config.json").text.kda_layers[0]
    for key, array in (("kda_snapshot_transposed", "kda_state"), ("conv_page_dropped", "kda_conv")):
        f = got[key]
        assert f["outcome"] == "detected" and f["revalidated"] is True, f
        assert f"restore.layers.{kda0}.{array}" in f["error"] and f"layer {kda0}," in f["detail"], f
    assert got["bad_page"]["outcome"] == "not_run"  # the hardware fault itself is still the target's to inject
    notes = fault_paths_stage(ckpt).notes
    assert any(n.startswith("kda_snapshot_transposed: detected") for n in notes), notes


@pytest.mark.parametrize("command, extra", [("perf", ["--workload", "1k-1k"]), ("soak", ["--minutes", "1"]),
                                            ("faults", [])])
def test_both_or_neither_of_endpoint_and_bundle_is_one_line(tiny_trained_ckpt, tmp_path, command, extra):
    both = run_cli(command, str(tmp_path), "--endpoint", "http://127.0.0.1:9/v1", *extra)
    neither = run_cli(command, *extra, cwd=tmp_path)
    for r, says in ((both, "not both"), (neither, "give --endpoint URL, or BUNDLE")):
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and says in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_planted_fault_that_corrupts_nothing_is_recorded_unseen_never_detected(tiny_trained_ckpt, monkeypatch):
    """The control: a 'fault' whose save and load are the clean ones must not come out detected."""
    from k3bundle.bundle.open_weights import open_weights
    from k3bundle.executor.serving import CacheIO
    from k3bundle.golden.cases import load_cases
    from k3bundle.tokenizer import load_tiktoken
    from k3bundle.validate import serving_faults as SF

    monkeypatch.setitem(SF.PLANTED, "nothing", ("nothing planted", CacheIO(), "kda_state"))
    case = next(c for c in load_cases(REPO / "golden" / "cases") if c.name == SF.CASE)
    ids = case.build_ids(load_tiktoken(tiny_trained_ckpt))
    (x,) = SF.run_planted(open_weights(tiny_trained_ckpt, "bfloat16", "cpu"), ids, names=("nothing",))
    assert (x.detected, x.tap, x.layer, x.clean_passed) == (False, "", None, True)
    assert x.moved == 0.0  # the same bytes back: the continuation is the uninterrupted run's, bit for bit


def test_ctrl_c_during_soak_bundle_writes_the_incomplete_report_and_stops_the_server(ckpt):
    import os
    import signal
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-m", "k3bundle", "soak", str(ckpt), "--minutes", "10", "--max-tokens", "2",
                          "--case", "greedy"], env={**os.environ, **ENV, "PYTHONPATH": str(REPO)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not p.stderr.readline().startswith("soak: 1 requests per pass"):  # served, and the clock has started
        assert p.poll() is None and time.monotonic() < deadline
    time.sleep(3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, out + err
    doc = json.loads((ckpt / "reports" / "soak.json").read_text())
    assert doc["complete"] is False and doc["verdict"] == "INCOMPLETE" and doc["requests"] >= 1
    assert _refused(doc["endpoint"])
