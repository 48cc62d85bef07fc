"""``k3bundle parsers`` against a live ``k3bundle serve`` on localhost: clean, and each planted fault.

Oracles: a clean server must pass every check; each planted fault (the parser bypassed, the stop
token rendered with the next id, noise on the logits) must fail the check made for it, with a
message naming what is wrong, and leave the checks it does not touch passing. The rendering and
parse the checks compare against are computed here too, from the chat module, on the ids the
server reports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests._bundles import single_threaded_torch  # noqa: F401  (autouse: one torch thread)
from tests._serving import serving
from tests.conftest import REPO, run_cli

MAX_TOKENS = 150  # the trained tiny model closes its tool call (tool_call@1) after 132 tokens


@pytest.fixture(scope="module")
def encoding(tiny_trained_ckpt):
    from k3bundle.tokenizer import load_tiktoken

    return load_tiktoken(tiny_trained_ckpt)


@pytest.fixture(scope="module")
def cases():
    from k3bundle.golden.cases import load_cases

    return load_cases(REPO / "golden" / "cases")


def _parsers(url, encoding, cases, names, endpoint_cls=None):
    from k3bundle.endpoint import Endpoint
    from k3bundle.endpoint.parsers_report import run_parsers

    ep = (endpoint_cls or Endpoint)(url)
    return run_parsers(ep, encoding, cases, MAX_TOKENS, names)


def _checks(report) -> dict[tuple[str, str], object]:
    return {(r.probe.name, c.name): c for r in report.results for c in r.checks}


def test_the_clean_server_passes_every_check(tiny_trained_ckpt, encoding, tmp_path):
    from k3bundle.chat import parse
    from k3bundle.serve import Engine

    with serving(Engine(tiny_trained_ckpt)) as url:
        r = run_cli("parsers", str(tiny_trained_ckpt), "--endpoint", url, "--out", str(tmp_path),
                    "--max-tokens", str(MAX_TOKENS), env={"K3BUNDLE_THREADS": "1"})
        assert r.returncode == 0, r.stdout + r.stderr
        assert "parsers: PASS (4 probes)" in r.stdout
        report = json.loads((tmp_path / "parsers.json").read_text())
        assert "# Parsers: PASS" in (tmp_path / "parsers.md").read_text()
        probes = {p["name"]: p for p in report["probes"]}
        assert sorted(probes) == ["multi_turn", "thinking", "tool_call", "tool_call@1"]
        for p in probes.values():
            status = {c["name"]: c["status"] for c in p["checks"]}
            for name in ("prompt_ids", "determinism", "split", "stream_split", "no_markup"):
                assert status[name] == "pass", (p["name"], name)
            assert status["no_tools"] == ("pass" if not p["tools"] else "not checked")
        # the tool-calling turn made a call whose arguments were judged
        assert {c["name"]: c["status"] for c in probes["tool_call@1"]["checks"]}["tool_arguments"] == "pass"
        assert probes["tool_call@1"]["finish_reasons"] == ["tool_calls", "tool_calls"]

        # independently: the call the server returns is the parse of its own token ids, with typed arguments
        import openai
        import yaml

        case = yaml.safe_load((REPO / "golden" / "cases" / "tool_call.yaml").read_text())
        c = openai.OpenAI(base_url=url, api_key="none").chat.completions.create(
            model=tiny_trained_ckpt.name, messages=case["messages"][:1], tools=case["tools"], max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"return_token_ids": True, "chat_template_kwargs": {"thinking_effort": "high"}})
        calls = c.choices[0].message.tool_calls
        want = parse(c.choices[0].model_extra["token_ids"], thinking=True, encoding=encoding).tool_calls
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == \
               [(w.name, w.arguments) for w in want]
        args = json.loads(calls[0].function.arguments)
        assert calls[0].function.name == "get_gpu_memory" and type(args["device"]) is int


def test_markup_in_content_is_caught(tiny_trained_ckpt, encoding, cases):
    from k3bundle.serve import Engine

    with serving(Engine(tiny_trained_ckpt, fault="markup-in-content")) as url:
        report = _parsers(url, encoding, cases, ["tool_call@1"])
    checks = _checks(report)
    assert not report.passed
    markup = checks["tool_call@1", "no_markup"]
    assert markup.status == "fail" and "XTML markup in content" in markup.detail
    split = checks["tool_call@1", "split"]
    assert split.status == "fail" and "tool_calls [] where the parser has [('get_gpu_memory'" in split.detail
    assert checks["tool_call@1", "stream_split"].status == "fail"
    assert checks["tool_call@1", "prompt_ids"].status == "pass"
    assert checks["tool_call@1", "determinism"].status == "pass"


def test_nondeterministic_decode_is_caught(tiny_trained_ckpt, encoding, cases):
    from k3bundle.serve import Engine

    with serving(Engine(tiny_trained_ckpt, fault="nondeterministic")) as url:
        report = _parsers(url, encoding, cases, ["thinking", "multi_turn"])
    checks = _checks(report)
    det = [checks[p, "determinism"] for p in ("thinking", "multi_turn")]
    assert any(c.status == "fail" for c in det)
    assert all("nondeterministic: the same request at temperature 0 gave different completions" in c.detail
               for c in det if c.status == "fail")
    assert all(checks[p, "prompt_ids"].status == "pass" for p in ("thinking", "multi_turn"))
    assert all(checks[p, "split"].status == "pass" for p in ("thinking", "multi_turn"))


def test_wrong_special_id_is_caught_through_the_serve_command(tiny_trained_ckpt, encoding, tmp_path):
    """The fault planted by the environment hook of ``k3bundle serve``, judged by the command."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "K3BUNDLE_THREADS": "1", "PYTHONPATH": str(REPO), "K3BUNDLE_SERVE_FAULT": "wrong-special-id"}
    server = subprocess.Popen([sys.executable, "-m", "k3bundle", "serve", str(tiny_trained_ckpt), "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.5)
        r = run_cli("parsers", str(tiny_trained_ckpt), "--endpoint", f"http://127.0.0.1:{port}", "--out",
                    str(tmp_path), "--case", "thinking", "--max-tokens", "24", "--json", env={"K3BUNDLE_THREADS": "1"})
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "FAIL"
    eom = encoding.encode_single_token("<|end_of_msg|>")
    assert len(out["failures"]) == 1
    assert out["failures"][0].startswith("thinking: prompt_ids: prompt token ids differ from k3bundle's rendering")
    assert f"endpoint {eom + 1} " in out["failures"][0] and f"k3bundle {eom} '<|end_of_msg|>'" in out["failures"][0]
    assert json.loads((tmp_path / "parsers.json").read_text())["verdict"] == "FAIL"


def test_an_endpoint_without_token_ids_is_judged_on_raw_completions(tiny_trained_ckpt, encoding, cases):
    """vLLM before return_token_ids: no ids in the chat answer; the raw text comes from /v1/completions."""
    from k3bundle.endpoint import Endpoint
    from k3bundle.serve import Engine

    class NoIds(Endpoint):
        def chat(self, *a, **kw):
            r = super().chat(*a, **kw)
            r.prompt_token_ids = r.token_ids = None
            return r

    with serving(Engine(tiny_trained_ckpt)) as url:
        clean = _parsers(url, encoding, cases, ["thinking"], NoIds)
    with serving(Engine(tiny_trained_ckpt, fault="markup-in-content")) as url:
        faulty = _parsers(url, encoding, cases, ["thinking"], NoIds)
    c, f = _checks(clean), _checks(faulty)
    assert c["thinking", "prompt_ids"].status == "not checked"
    assert c["thinking", "split"].status == "pass" and clean.passed
    assert clean.results[0].raw_source.startswith("/v1/completions")
    assert f["thinking", "split"].status == "fail" and "content '" in f["thinking", "split"].detail


def test_bad_input_and_an_unreachable_endpoint_exit_2(tiny_trained_ckpt, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    r = run_cli("parsers", str(tiny_trained_ckpt), "--endpoint", f"http://127.0.0.1:{port}/v1", "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "unreachable" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_cli("parsers", str(tiny_trained_ckpt), "--endpoint", f"http://127.0.0.1:{port}/v1")
    assert r.returncode == 2 and "not a bundle" in r.stderr and "--out" in r.stderr
    assert not list(tmp_path.iterdir())  # no report from a run that never ran


def test_a_served_bundle_gets_its_report_in_reports(tiny_trained_ckpt, tmp_path):
    """serve reads a bundle (weights, tokenizer/); parsers renders with the bundle's tokenizer and
    writes BUNDLE/reports/parsers.{json,md} when no --out is given."""
    from k3bundle.convert import convert
    from k3bundle.serve import Engine

    bundle = tmp_path / "bundle"
    convert(tiny_trained_ckpt, "b300-tp8", bundle, workers=1)
    with serving(Engine(bundle)) as url:
        r = run_cli("parsers", str(bundle), "--endpoint", url, "--case", "thinking", "--max-tokens", "24",
                    env={"K3BUNDLE_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((bundle / "reports" / "parsers.json").read_text())
    assert report["verdict"] == "PASS" and report["model"] == "bundle"
    assert [p["name"] for p in report["probes"]] == ["thinking"]
    assert (bundle / "reports" / "parsers.md").read_text().startswith("# Parsers: PASS")
