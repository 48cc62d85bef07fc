"""One client for any OpenAI-compatible endpoint (k3bundle serve, vLLM, SGLang, TensorRT-LLM, ...).

Built on the official ``openai`` package. Every request is greedy (``temperature=0``) and returns a
plain result with its timing, so the commands that measure an endpoint share one way of asking::

    ep = Endpoint("http://127.0.0.1:8000/v1", model=None)      # model: the endpoint's first, if None
    r = ep.chat(messages, tools=tools, max_tokens=256, stream=True, thinking=True, return_token_ids=True)
    r.reasoning, r.content, r.tool_calls, r.finish_reason, r.prompt_token_ids, r.token_ids
    r.timing.ttft_s, r.timing.intervals_s, r.timing.total_s, r.timing.completion_tokens
    c = ep.complete([1, 2, 3], max_tokens=16, return_token_ids=True, skip_special_tokens=False)

Engine extensions are asked for by name, as vLLM and SGLang take them: ``chat_template_kwargs``
(``thinking``, ``thinking_effort``), ``return_token_ids`` (the response then carries
``prompt_token_ids`` and each choice's ``token_ids``), ``skip_special_tokens``. An engine that
ignores one simply leaves the field out, and the result holds None there.

Timing (``Timing``): ``total_s`` from sending the request to the last byte; when streaming,
``ttft_s`` to the first chunk that carries output (reasoning, content, a tool call or token ids)
and ``intervals_s`` between successive output chunks (one per token where the engine streams one
token per chunk); ``completion_tokens`` from ``usage`` (asked for with ``include_usage``), else
the streamed token ids, else the output chunks. A non-streamed request has no ``ttft_s``.

Errors: ``EndpointUnreachable`` (no connection, a timeout) and ``EndpointRejected`` (an HTTP
error status, with ``status`` and the endpoint's message) are ``EndpointError``, a ``K3Error``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import openai

from k3bundle.endpoint.errors import EndpointError, EndpointRejected, EndpointUnreachable


@dataclass
class Timing:
    total_s: float
    ttft_s: float | None = None
    intervals_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class ToolCallOut:
    """A tool call as the endpoint returned it: ``arguments`` is its JSON string, unparsed."""

    name: str
    arguments: str
    id: str | None = None


@dataclass
class ChatResult:
    content: str
    reasoning: str | None
    tool_calls: list[ToolCallOut]
    finish_reason: str | None
    timing: Timing
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


@dataclass
class CompletionResult:
    text: str
    finish_reason: str | None
    timing: Timing
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


def _extra(obj: Any, name: str) -> Any:
    """A field outside the OpenAI schema (an engine extension), or None."""
    return getattr(obj, name, None) if obj is not None else None


def _reasoning(obj: Any) -> str | None:
    # vLLM and SGLang name it reasoning_content; newer vLLM also reasoning
    r = _extra(obj, "reasoning_content")
    return r if r is not None else _extra(obj, "reasoning")


class Endpoint:
    """An OpenAI-compatible endpoint at ``base_url`` (with or without the trailing ``/v1``)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0):
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key or "EMPTY", timeout=timeout,
                                    max_retries=0)
        self._model = model

    # ---- plumbing
    def _call(self, fn, **kwargs):
        try:
            return fn(**kwargs)
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}  # the SDK hands over the "error" object
            err = body.get("error", body)
            msg = err.get("message") if isinstance(err, dict) else None
            raise EndpointRejected(e.status_code, f"{self.base_url}: HTTP {e.status_code}: {msg or e.message}") from None
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise EndpointUnreachable(f"{self.base_url}: unreachable: {e.__cause__ or e}") from None

    @property
    def model(self) -> str:
        if self._model is None:
            names = self.models()
            if not names:
                raise EndpointError(f"{self.base_url}/models lists no model; pass --model")
            self._model = names[0]
        return self._model

    def models(self) -> list[str]:
        """The ids ``/v1/models`` lists."""
        return [m.id for m in self._call(self.client.models.list).data]

    # ---- requests
    def chat(self, messages: Sequence[dict], *, tools: list[dict] | None = None, max_tokens: int = 256,
             stream: bool = False, thinking: bool | None = None, thinking_effort: str | None = None,
             tool_choice: Any = None, return_token_ids: bool = False, extra_body: dict | None = None) -> ChatResult:
        """``/v1/chat/completions``, greedy. ``thinking``/``thinking_effort`` go in
        ``chat_template_kwargs`` where given (None: the endpoint's default)."""
        kwargs = {"thinking": thinking, "thinking_effort": thinking_effort}
        body = dict(extra_body or {})
        if any(v is not None for v in kwargs.values()):
            body["chat_template_kwargs"] = {k: v for k, v in kwargs.items() if v is not None}
        if return_token_ids:
            body["return_token_ids"] = True
        req = dict(model=self.model, messages=list(messages), max_tokens=max_tokens, temperature=0,
                   extra_body=body or None)
        if tools:
            req["tools"] = tools
        if tool_choice is not None:
            req["tool_choice"] = tool_choice
        start = time.perf_counter()
        if not stream:
            r = self._call(self.client.chat.completions.create, **req)
            c, m = r.choices[0], r.choices[0].message
            calls = [ToolCallOut(t.function.name, t.function.arguments, t.id) for t in m.tool_calls or []]
            return ChatResult(m.content or "", _reasoning(m), calls, c.finish_reason,
                              self._timing(start, r.usage), _extra(r, "prompt_token_ids"), _extra(c, "token_ids"))
        out = _ChatStream()
        chunks = self._call(self.client.chat.completions.create, stream=True,
                            stream_options={"include_usage": True}, **req)
        try:
            for chunk in chunks:
                out.add(chunk, time.perf_counter())
        except openai.APIError as e:
            raise EndpointUnreachable(f"{self.base_url}: the stream broke off: {e}") from None
        return out.result(start)

    def complete(self, prompt: str | Sequence[int], *, max_tokens: int = 16, stream: bool = False,
                 return_token_ids: bool = False, skip_special_tokens: bool | None = None,
                 extra_body: dict | None = None) -> CompletionResult:
        """``/v1/completions``, greedy; ``prompt`` is text or token ids."""
        body = dict(extra_body or {})
        if return_token_ids:
            body["return_token_ids"] = True
        if skip_special_tokens is not None:
            body["skip_special_tokens"] = skip_special_tokens
        req = dict(model=self.model, prompt=prompt if isinstance(prompt, str) else list(prompt),
                   max_tokens=max_tokens, temperature=0, extra_body=body or None)
        start = time.perf_counter()
        if not stream:
            r = self._call(self.client.completions.create, **req)
            c = r.choices[0]
            return CompletionResult(c.text, c.finish_reason, self._timing(start, r.usage),
                                    _extra(c, "prompt_token_ids"), _extra(c, "token_ids"))
        text, ids, prompt_ids, reason, times, usage = [], [], None, None, [], None
        chunks = self._call(self.client.completions.create, stream=True, stream_options={"include_usage": True}, **req)
        try:
            for chunk in chunks:
                usage = chunk.usage or usage
                for c in chunk.choices:
                    got = _extra(c, "token_ids")
                    prompt_ids = _extra(c, "prompt_token_ids") or prompt_ids
                    if c.text or got:
                        times.append(time.perf_counter())
                    text.append(c.text or "")
                    ids += got or []
                    reason = c.finish_reason or reason
        except openai.APIError as e:
            raise EndpointUnreachable(f"{self.base_url}: the stream broke off: {e}") from None
        timing = _stream_timing(start, times, usage, ids)
        return CompletionResult("".join(text), reason, timing, prompt_ids, ids or None)

    @staticmethod
    def _timing(start: float, usage: Any) -> Timing:
        return Timing(time.perf_counter() - start, prompt_tokens=_extra(usage, "prompt_tokens"),
                      completion_tokens=_extra(usage, "completion_tokens"))


def _stream_timing(start: float, times: list[float], usage: Any, ids: list[int]) -> Timing:
    tokens = _extra(usage, "completion_tokens")
    return Timing(time.perf_counter() - start, times[0] - start if times else None,
                  [b - a for a, b in zip(times, times[1:])], _extra(usage, "prompt_tokens"),
                  tokens if tokens is not None else len(ids) if ids else len(times))


class _ChatStream:
    """Assembles a streamed chat completion: text by field, tool calls by index, token ids."""

    def __init__(self):
        self.content, self.reasoning, self.calls, self.ids = [], [], {}, []
        self.prompt_ids, self.reason, self.usage, self.times = None, None, None, []

    def add(self, chunk: Any, now: float) -> None:
        self.usage = chunk.usage or self.usage
        self.prompt_ids = _extra(chunk, "prompt_token_ids") or self.prompt_ids
        for c in chunk.choices:
            d, got = c.delta, _extra(c, "token_ids")
            reasoning = _reasoning(d)
            if d.content or reasoning or d.tool_calls or got:
                self.times.append(now)
            self.content.append(d.content or "")
            if reasoning is not None:
                self.reasoning.append(reasoning)
            for t in d.tool_calls or []:  # OpenAI streams a call's arguments in pieces
                call = self.calls.setdefault(t.index, ToolCallOut("", "", None))
                call.id = t.id or call.id
                if t.function is not None:
                    call.name += t.function.name or ""
                    call.arguments += t.function.arguments or ""
            self.ids += got or []
            self.reason = c.finish_reason or self.reason

    def result(self, start: float) -> ChatResult:
        return ChatResult("".join(self.content), "".join(self.reasoning) if self.reasoning else None,
                          [self.calls[i] for i in sorted(self.calls)], self.reason,
                          _stream_timing(start, self.times, self.usage, self.ids), self.prompt_ids,
                          self.ids or None)
