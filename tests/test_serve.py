"""``k3bundle serve`` over the trained tiny model, driven with the official openai client.

Oracles: the executor's own greedy loop (``Executor.generate``, the loop ``k3bundle run`` prints)
run here on the same checkpoint; the chat renderer and XTML parser called here on the same
conversation and on the token ids the server reports; the error statuses and messages the
OpenAI API documents.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests._bundles import single_threaded_torch  # noqa: F401  (autouse: one torch thread)
from tests._serving import serving

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 512  # --max-model-len: a request past it costs nothing to build


@pytest.fixture(scope="module")
def engine(tiny_trained_ckpt):
    from k3bundle.serve import Engine

    return Engine(tiny_trained_ckpt, max_model_len=CONTEXT)


@pytest.fixture(scope="module")
def url(engine):
    with serving(engine) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def encoding(tiny_trained_ckpt):
    from k3bundle.tokenizer import load_tiktoken

    return load_tiktoken(tiny_trained_ckpt)


@pytest.fixture(scope="module")
def thinking_case():
    from k3bundle.golden.cases import load_case

    return load_case(REPO / "golden" / "cases" / "thinking.yaml")


def test_models_lists_the_served_model(client, tiny_trained_ckpt):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_trained_ckpt.name]
    assert models[0].model_extra["max_model_len"] == CONTEXT


def test_completion_token_ids_are_the_executors_greedy_tokens(client, encoding, tiny_trained_ckpt):
    from k3bundle.bundle.open_weights import open_weights
    from k3bundle.executor import Executor

    prompt = encoding.encode("A checkpoint is a set of files. Most of the bytes live in", disallowed_special=())
    steps = 6
    want = Executor(open_weights(tiny_trained_ckpt, "float32", "cpu")).generate(prompt, steps).tokens

    r = client.completions.create(model=tiny_trained_ckpt.name, prompt=prompt, max_tokens=steps, temperature=0,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want
    assert c.model_extra["prompt_token_ids"] == prompt
    assert c.text == encoding.decode(want)
    assert c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), steps)

    # the same prompt as text, streamed: the same tokens, one per chunk, and usage at the end
    text = encoding.decode(prompt)
    chunks = list(client.completions.create(model=tiny_trained_ckpt.name, prompt=text, max_tokens=steps,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    ids = [i for ch in chunks for c in ch.choices for i in c.model_extra["token_ids"]]
    assert ids == want
    assert "".join(c.text for ch in chunks for c in ch.choices) == encoding.decode(want)
    assert chunks[-1].usage.completion_tokens == steps


def test_chat_streamed_and_not_give_the_same_split(client, encoding, thinking_case, tiny_trained_ckpt):
    from k3bundle.chat import parse, render_ids

    req = dict(model=tiny_trained_ckpt.name, messages=thinking_case.messages, max_tokens=24, temperature=0,
               extra_body={"return_token_ids": True, "chat_template_kwargs": {"thinking_effort": "max"}})
    r = client.chat.completions.create(**req)
    m, ids = r.choices[0].message, r.choices[0].model_extra["token_ids"]
    assert r.model_extra["prompt_token_ids"] == render_ids(thinking_case.messages, encoding, thinking=True,
                                                           thinking_effort="max")
    want = parse(ids, thinking=True, encoding=encoding)
    assert (m.model_extra["reasoning_content"], m.content) == (want.reasoning, want.content)
    assert want.reasoning  # the trained model thinks first: the split is not vacuous
    assert r.usage.completion_tokens == len(ids)

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **req))
    deltas = [c.delta for ch in chunks for c in ch.choices]
    assert "".join(d.content or "" for d in deltas) == m.content
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == want.reasoning
    assert [i for ch in chunks for c in ch.choices for i in c.model_extra.get("token_ids") or []] == ids
    assert chunks[-1].usage.completion_tokens == len(ids)
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == [r.choices[0].finish_reason]


def test_thinking_off_renders_the_response_channel(client, encoding, thinking_case, tiny_trained_ckpt):
    from k3bundle.chat import parse, render_ids

    r = client.chat.completions.create(model=tiny_trained_ckpt.name, messages=thinking_case.messages, max_tokens=8,
                                       temperature=0, extra_body={"return_token_ids": True,
                                                                  "chat_template_kwargs": {"thinking": False}})
    assert r.model_extra["prompt_token_ids"] == render_ids(thinking_case.messages, encoding, thinking=False)
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] is None
    assert m.content == parse(r.choices[0].model_extra["token_ids"], thinking=False, encoding=encoding).content


def test_a_request_past_the_context_is_a_400_and_the_server_keeps_serving(client, tiny_trained_ckpt):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=tiny_trained_ckpt.name, prompt=[65] * (CONTEXT - 4), max_tokens=5,
                                  temperature=0)
    assert e.value.status_code == 400
    assert f"maximum context length is {CONTEXT} tokens" in e.value.body["message"]
    assert f"requested {CONTEXT + 1} tokens ({CONTEXT - 4} in the prompt, 5 in the completion)" in e.value.body["message"]
    r = client.completions.create(model=tiny_trained_ckpt.name, prompt=[65] * (CONTEXT - 5), max_tokens=5, temperature=0)
    assert r.usage.total_tokens <= CONTEXT


@pytest.mark.parametrize("change, status, words", [
    ({"model": "no-such-model"}, 404, "does not exist"),
    ({"temperature": 0.7}, 400, "greedily"),
    ({"n": 2}, 400, "one choice"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role 'robot'"),
    ({"messages": "hi"}, 400, "messages"),
    ({"max_tokens": 0}, 400, "at least 1"),
])
def test_bad_requests_are_openai_style_errors(url, tiny_trained_ckpt, change, status, words):
    import json

    body = {"model": tiny_trained_ckpt.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **change}
    req = urllib.request.Request(url + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == status
    err = json.loads(e.value.read())["error"]
    assert err["code"] == status and words in err["message"] and err["type"]


def test_out_of_vocabulary_ids_are_a_400(client, encoding, tiny_trained_ckpt):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=tiny_trained_ckpt.name, prompt=[1, encoding.n_vocab], max_tokens=1,
                                  temperature=0)
    assert f"token id {encoding.n_vocab} is out of range" in e.value.body["message"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command_serves_until_interrupted(tiny_trained_ckpt):
    port = _free_port()
    env = {**os.environ, "K3BUNDLE_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-m", "k3bundle", "serve", str(tiny_trained_ckpt), "--port", str(port),
                          "--served-model-name", "tt", "--max-model-len", "256"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    body = r.read().decode()
                break
            except OSError:
                assert p.poll() is None, p.stderr.read()
                assert time.monotonic() < deadline, "serve did not answer in 120 s"
                time.sleep(0.5)
        assert '"id":"tt"' in body and '"max_model_len":256' in body
    finally:
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    assert "serving tt at http://127.0.0.1:" in err


def test_a_client_that_leaves_mid_stream_frees_the_engine(tiny_trained_ckpt):
    """Left running, the abandoned request would hold the engine for 2,000 tokens (minutes); the next
    request is answered within the client's 60 s only if the disconnect stopped its decode."""
    from k3bundle.serve import Engine

    with serving(Engine(tiny_trained_ckpt)) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        stream = client.completions.create(model=tiny_trained_ckpt.name, prompt=[65, 66, 67], max_tokens=2000,
                                           temperature=0, stream=True)
        chunks = iter(stream)
        for _ in range(3):
            assert next(chunks).choices[0].text is not None
        stream.close()
        r = client.completions.create(model=tiny_trained_ckpt.name, prompt=[65, 66, 67], max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("args, package", [
    (["serve", "{ckpt}", "--port", "9"], "fastapi"),
    (["parsers", "{ckpt}", "--endpoint", "http://127.0.0.1:9/v1", "--out", "{out}"], "openai"),
    (["soak", "--endpoint", "http://127.0.0.1:9/v1", "--minutes", "1", "--out", "{out}"], "openai"),
    (["faults", "--endpoint", "http://127.0.0.1:9/v1", "--out", "{out}"], "openai"),
    (["perf", "--endpoint", "http://127.0.0.1:9/v1", "--workload", "1k-1k", "--out", "{out}"], "openai"),
])
def test_without_the_serve_extra_the_commands_say_what_to_install(tiny_trained_ckpt, tmp_path, args, package):
    """fastapi, uvicorn and openai are the serve extra: the rest of the command line runs without them
    (--help lists every command), and each command of the extra says what to install, writing nothing."""
    block = ("import sys\nfor m in ('openai', 'fastapi', 'uvicorn'): sys.modules[m] = None\n"
             "sys.argv = ['k3bundle'] + sys.argv[1:]\nfrom k3bundle.cli.app import main\nmain()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("K3BUNDLE_DEBUG", None)
    argv = [a.format(ckpt=tiny_trained_ckpt, out=tmp_path / "out") for a in args]
    helped = subprocess.run([sys.executable, "-c", block, "--help"], env=env, capture_output=True, text=True)
    assert helped.returncode == 0 and all(c in helped.stdout for c in ("serve", "parsers", "soak", "faults", "perf"))
    r = subprocess.run([sys.executable, "-c", block, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert r.stderr == f"error: k3bundle {args[0]} needs the {package} package: pip install 'k3bundle[serve]'\n"
    assert not (tmp_path / "out").exists()


def test_the_endpoint_client_times_and_assembles_what_the_server_sends(url, encoding, thinking_case, tiny_trained_ckpt):
    """``Endpoint``: streamed and not, the same split as the raw response; one interval per token chunk."""
    import json

    from k3bundle.endpoint import Endpoint, EndpointRejected, EndpointUnreachable

    ep = Endpoint(url.removesuffix("/v1"))  # the /v1 suffix is added when missing
    assert ep.base_url == url and ep.model == tiny_trained_ckpt.name
    a = ep.chat(thinking_case.messages, max_tokens=12, return_token_ids=True)
    b = ep.chat(thinking_case.messages, max_tokens=12, return_token_ids=True, stream=True)
    body = {"model": ep.model, "messages": thinking_case.messages, "max_tokens": 12, "return_token_ids": True}
    req = urllib.request.Request(url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = json.loads(r.read())
    message = raw["choices"][0]["message"]
    for got in (a, b):
        assert (got.reasoning, got.content, got.finish_reason) == \
               (message["reasoning_content"], message["content"], raw["choices"][0]["finish_reason"])
        assert got.token_ids == raw["choices"][0]["token_ids"] and got.prompt_token_ids == raw["prompt_token_ids"]
        assert got.timing.completion_tokens == raw["usage"]["completion_tokens"] == len(got.token_ids)
        assert got.timing.prompt_tokens == raw["usage"]["prompt_tokens"]
    assert a.timing.ttft_s is None and a.timing.intervals_s == []
    assert 0 < b.timing.ttft_s < b.timing.total_s
    # a chunk per token (token ids on), and the final chunk when it carries text the parser held back
    assert len(b.timing.intervals_s) in (len(b.token_ids) - 1, len(b.token_ids))
    assert b.timing.ttft_s + sum(b.timing.intervals_s) <= b.timing.total_s

    c = ep.complete(encoding.decode(a.prompt_token_ids), max_tokens=4, stream=True, skip_special_tokens=False)
    assert c.text == encoding.decode(a.token_ids[:4]) and c.timing.completion_tokens == 4
    assert len(c.timing.intervals_s) == 3  # completions: one chunk per token, the last with its finish reason
    with pytest.raises(EndpointRejected) as e:
        ep.complete([1] * CONTEXT, max_tokens=1)
    assert e.value.status == 400 and "maximum context length" in str(e.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(EndpointUnreachable, match="unreachable"):
        Endpoint(f"http://127.0.0.1:{closed}/v1", model="m").models()
