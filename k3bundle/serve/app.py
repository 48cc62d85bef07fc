"""The OpenAI-compatible routes of ``k3bundle serve``: chat completions, completions, models.

Requests follow the OpenAI API (and vLLM's extensions where a client needs them:
``chat_template_kwargs`` to turn thinking off, ``return_token_ids`` for the prompt and completion
token ids, ``skip_special_tokens``). Decoding is greedy: ``temperature`` may be omitted or 0, and
anything else is refused rather than silently ignored. Chat output is split by k3bundle's XTML
parser (docs/chat.md §4.3) into ``reasoning_content``, ``content`` and ``tool_calls``, streamed
as server-sent events when ``stream`` is true. Errors are OpenAI-style JSON
(``{"error": {"message", "type", "param", "code"}}``) with the HTTP status in ``code``; the
server keeps serving after any of them. docs/endpoint.md describes the fields.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import iterate_in_threadpool
from pydantic import BaseModel, ConfigDict

from k3bundle.chat import Delta, ParsedMessage, ToolCall
from k3bundle.errors import K3Error
from k3bundle.serve.engine import Engine, TokenStream
from k3bundle.serve.errors import ServeError

#: completion tokens when a chat request gives no max_tokens (the context would be far too many
#: for a CPU executor); a completions request defaults to 16 as OpenAI's does
CHAT_MAX_TOKENS = 256
COMPLETION_MAX_TOKENS = 16
DISCONNECT_POLL_S = 0.5


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_token_ids: bool = False


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: Any = None
    max_completion_tokens: int | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    skip_special_tokens: bool = True
    echo: bool = False


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tool_call(call: ToolCall, index: int) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json()}}


def _finish(reason: str | None, msg: ParsedMessage) -> str | None:
    return "tool_calls" if reason == "stop" and msg.tool_calls else reason


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI app over ``engine`` (``k3bundle serve`` runs it with uvicorn)."""
    app = FastAPI(title="k3bundle serve", docs_url=None, redoc_url=None)

    @app.exception_handler(ServeError)
    def _serve_error(_: Request, e: ServeError):
        return _error(e.status, str(e), e.kind, e.param)

    @app.exception_handler(K3Error)
    def _k3_error(_: Request, e: K3Error):
        return _error(400, str(e), "invalid_request_error")

    @app.exception_handler(RequestValidationError)
    def _invalid(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}", "invalid_request_error", where)

    @app.exception_handler(Exception)
    def _internal(_: Request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")

    def _check(req: _Request, max_tokens: int | None) -> None:
        if req.model not in (None, engine.name):
            raise ServeError(f"The model `{req.model}` does not exist (this server serves `{engine.name}`).",
                             404, "not_found_error", "model")
        if req.temperature not in (None, 0):
            raise ServeError(f"temperature {req.temperature}: this server decodes greedily; give 0 or omit it",
                             param="temperature")
        if req.n != 1:
            raise ServeError(f"n {req.n}: this server returns one choice per request", param="n")
        if max_tokens is not None and max_tokens < 1:
            raise ServeError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(_metrics(engine), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                            "owned_by": "k3bundle", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest, request: Request):
        max_tokens = req.max_completion_tokens or req.max_tokens
        _check(req, max_tokens)
        kw = dict(req.chat_template_kwargs or {})
        thinking = bool(kw.pop("thinking", True))
        effort = kw.pop("thinking_effort", req.reasoning_effort or "max")
        if kw:
            raise ServeError(f"chat_template_kwargs: unknown key {sorted(kw)[0]!r} (known: thinking, thinking_effort)",
                             param="chat_template_kwargs")
        prompt = engine.render(req.messages, tools=req.tools, thinking=thinking, thinking_effort=effort,
                               tool_choice=req.tool_choice, response_format=req.response_format)
        max_tokens = max_tokens or min(CHAT_MAX_TOKENS, (engine.max_model_len or 1 << 62) - len(prompt))
        engine.check(prompt, max_tokens)  # a 400 now, before any stream starts
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.name}
        tokens = engine.generate(prompt, max_tokens)
        if req.stream:
            return _streaming(_chat_stream(engine, req, head, prompt, tokens, thinking), tokens, request)
        parser, ids, reason = engine.parser(thinking), [], None
        for token, reason in tokens:
            ids.append(token)
            parser.feed([token])
        msg = parser.finish()
        calls = [_tool_call(c, i) for i, c in enumerate(msg.tool_calls)]
        for c in calls:
            del c["index"]  # a message's tool calls have no index; a stream's deltas do
        message = {"role": "assistant", "content": msg.content,
                   "reasoning_content": msg.reasoning if thinking else None, "tool_calls": calls or None}
        choice = {"index": 0, "message": message, "finish_reason": _finish(reason, msg), "logprobs": None}
        out = {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(len(prompt), len(ids))}
        if req.return_token_ids:
            choice["token_ids"], out["prompt_token_ids"] = ids, prompt
        return out

    @app.post("/v1/completions")
    def completions(req: CompletionRequest, request: Request):
        max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        _check(req, max_tokens)
        if req.echo:
            raise ServeError("echo is not supported", param="echo")
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ServeError(f"{len(p)} prompts: this server takes one prompt per request", param="prompt")
            p = p[0]
        prompt = engine.encode(p) if isinstance(p, str) else list(p)
        engine.check(prompt, max_tokens)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.name}
        tokens = engine.generate(prompt, max_tokens)
        if req.stream:
            return _streaming(_completion_stream(engine, req, head, prompt, tokens), tokens, request)
        ids, reason = [], None
        for token, reason in tokens:
            ids.append(token)
        choice = {"index": 0, "text": engine.decode(ids, req.skip_special_tokens), "logprobs": None,
                  "finish_reason": reason}
        if req.return_token_ids:
            choice["token_ids"], choice["prompt_token_ids"] = ids, prompt
        return {**head, "object": "text_completion", "choices": [choice], "usage": _usage(len(prompt), len(ids))}

    return app


def _metrics(engine: Engine) -> str:
    """Prometheus text: the process's resident memory (named as prometheus_client's process
    collector names it, which vLLM and SGLang export too), requests decoded, one running or not."""
    lines = ["# TYPE k3bundle_serve_requests_total counter", f"k3bundle_serve_requests_total {engine.served}",
             "# TYPE k3bundle_serve_requests_running gauge",
             f"k3bundle_serve_requests_running {int(engine.lock.locked())}"]
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:  # not Linux: no resident memory to report
        status = ""
    rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), None)
    if rss is not None:
        lines += ["# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {rss}"]
    return "\n".join(lines) + "\n"


def _streaming(events: Iterator[str], tokens: TokenStream, request: Request) -> StreamingResponse:
    """Server-sent events; a client that disconnects stops the decode. A failed write shows a
    disconnect only when there is something to write, so a watcher also asks the connection every
    ``DISCONNECT_POLL_S``: a decode stalled between tokens is stopped too, not left holding the engine."""

    async def watch():
        while not tokens.cancelled.is_set():
            if await request.is_disconnected():
                tokens.close()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def guarded():
        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            async for event in iterate_in_threadpool(events):
                yield event
        finally:
            tokens.close()
            watcher.cancel()

    return StreamingResponse(guarded(), media_type="text/event-stream")


def _include_usage(req: _Request) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


def _chat_delta(deltas: list[Delta], calls: list[int]) -> dict:
    """One chunk's delta from the parser's events (reasoning and content text, closed calls)."""
    delta: dict[str, Any] = {}
    for d in deltas:
        if d.kind == "tool_call":
            calls.append(1)
            delta.setdefault("tool_calls", []).append(_tool_call(d.tool_call, len(calls) - 1))
        else:
            key = "reasoning_content" if d.kind == "reasoning" else "content"
            delta[key] = delta.get(key, "") + d.text
    return delta


def _chat_stream(engine: Engine, req: ChatRequest, head: dict, prompt: list[int], tokens: TokenStream,
                 thinking: bool) -> Iterator[str]:
    chunk = {**head, "object": "chat.completion.chunk"}
    first = {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    if req.return_token_ids:
        first["prompt_token_ids"] = prompt
    yield _sse(first)
    parser, calls, n, reason = engine.parser(thinking), [], 0, None
    for token, reason in tokens:
        n += 1
        delta = _chat_delta(parser.feed([token]), calls)
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        if req.return_token_ids:
            choice["token_ids"] = [token]
        if delta or req.return_token_ids:
            yield _sse({**chunk, "choices": [choice]})
    delta = _chat_delta(parser.flush(), calls)
    msg = parser.finish()
    yield _sse({**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": _finish(reason, msg)}]})
    if _include_usage(req):
        yield _sse({**chunk, "choices": [], "usage": _usage(len(prompt), n)})
    yield "data: [DONE]\n\n"


def _completion_stream(engine: Engine, req: CompletionRequest, head: dict, prompt: list[int],
                       tokens: TokenStream) -> Iterator[str]:
    chunk, seen = {**head, "object": "text_completion"}, ""
    ids: list[int] = []
    for token, reason in tokens:
        ids.append(token)
        text = engine.decode(ids, req.skip_special_tokens)
        # an incomplete UTF-8 sequence decodes to U+FFFD: hold it back until the next token
        piece, seen = (text[len(seen):], text) if not text.endswith("\ufffd") or reason else ("", seen)
        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": reason}
        if req.return_token_ids:
            choice["token_ids"] = [token]
            if len(ids) == 1:
                choice["prompt_token_ids"] = prompt
        yield _sse({**chunk, "choices": [choice]})
    if _include_usage(req):
        yield _sse({**chunk, "choices": [], "usage": _usage(len(prompt), len(ids))})
    yield "data: [DONE]\n\n"
