"""Golden requests replayed against an endpoint, each streamed under a watchdog.

A golden case with a conversation is sent as chat messages (its tools, and ``thinking`` /
``thinking_effort`` as the case renders them, in ``chat_template_kwargs``); a plain-prompt case
as a completion of its text. Long-context and image cases are left out: their prompts are built
from the tokenizer (long_context) or need a vision path the endpoint may not have.

``send`` streams one request, greedily, asking for token ids (``return_token_ids``) and usage.
The watchdog bounds the whole request, not only each read: the HTTP read timeout catches an
endpoint that goes silent, and the elapsed time checked at every chunk catches one that trickles;
either ends the request as a hang (``Sent.hang``) and closes its connection, so a stuck engine
never stalls the caller.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import openai

from k3bundle.endpoint.client import Endpoint
from k3bundle.golden.cases import Case

SKIPPED_KINDS = {"long_context": "its prompt is built to thousands of tokens from the tokenizer",
                 "image": "needs the endpoint's vision path"}


@dataclass(frozen=True)
class GoldenRequest:
    name: str
    messages: list | None = None  # chat
    tools: list | None = None
    template: dict | None = None  # chat_template_kwargs
    prompt: str | None = None  # completion

    def describe(self) -> str:
        return f"{self.name} ({'chat' if self.messages is not None else 'completion'})"


@dataclass
class Sent:
    """One request's outcome: tokens (or, without token ids, the output text), times, or what went wrong."""

    request: str
    started_s: float  # since the run began
    total_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None  # mean time between output chunks after the first
    token_ids: list[int] | None = None
    text: str = ""
    finish_reason: str | None = None
    hang: bool = False
    error: str | None = None
    status: int | None = None  # the HTTP status of a rejected request
    chunks: int = 0
    prompt_tokens: int | None = None  # from usage, where the endpoint reports it

    @property
    def ok(self) -> bool:
        return not self.hang and self.error is None

    @property
    def output(self) -> list:
        """What determinism compares: the token ids, else the output text's characters."""
        return list(self.token_ids) if self.token_ids is not None else list(self.text)


def golden_requests(cases: Sequence[Case]) -> tuple[list[GoldenRequest], dict[str, str]]:
    """The requests of the golden cases, and the cases left out with why."""
    out, skipped = [], {}
    for c in cases:
        if c.kind in SKIPPED_KINDS:
            skipped[c.name] = SKIPPED_KINDS[c.kind]
        elif c.messages is not None:
            kw = {k: c.render[k] for k in ("thinking", "thinking_effort") if k in c.render}
            out.append(GoldenRequest(c.name, messages=list(c.messages), tools=c.tools, template=kw or None))
        elif c.prompt is not None:
            out.append(GoldenRequest(c.name, prompt=c.prompt))
        else:
            skipped[c.name] = "no conversation and no prompt"
    return out, skipped


def _piece(choice) -> tuple[str, list[int]]:
    """The output text and token ids one streamed choice carries (chat or completion)."""
    extra = getattr(choice, "model_extra", None) or {}
    ids = list(extra.get("token_ids") or [])
    delta = getattr(choice, "delta", None)
    if delta is None:
        return choice.text or "", ids
    dx = getattr(delta, "model_extra", None) or {}
    text = (dx.get("reasoning_content") or dx.get("reasoning") or "") + (delta.content or "")
    for t in delta.tool_calls or []:
        if t.function is not None:
            text += (t.function.name or "") + (t.function.arguments or "")
    return text, ids


def _is_timeout(e: BaseException) -> bool:
    """A read or connect timeout, from openai or from its HTTP transport (which one varies by version)."""
    return isinstance(e, (openai.APITimeoutError, TimeoutError)) or any(
        "Timeout" in c.__name__ for c in type(e).__mro__)


def send(ep: Endpoint, req: GoldenRequest, max_tokens: int, timeout_s: float, t0: float) -> Sent:
    """Stream ``req`` greedily under a ``timeout_s`` watchdog; never raises for the endpoint's sake."""
    client = ep.client.with_options(timeout=timeout_s)
    body = {"return_token_ids": True}
    start = time.perf_counter()
    out = Sent(req.name, start - t0, 0.0)
    times: list[float] = []
    ids: list[int] = []
    text: list[str] = []
    stream = None
    try:
        common = dict(model=ep.model, max_tokens=max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        if req.messages is not None:
            if req.template:
                body["chat_template_kwargs"] = dict(req.template)
            extra = {"tools": req.tools} if req.tools else {}
            stream = client.chat.completions.create(messages=req.messages, extra_body=body, **extra, **common)
        else:
            stream = client.completions.create(prompt=req.prompt, extra_body=body, **common)
        for chunk in stream:
            now = time.perf_counter()
            out.chunks += 1
            if getattr(chunk, "usage", None) is not None:
                out.prompt_tokens = chunk.usage.prompt_tokens
            for c in chunk.choices:
                piece, got = _piece(c)
                if piece or got:
                    times.append(now)
                text.append(piece)
                ids += got
                out.finish_reason = c.finish_reason or out.finish_reason
            if now - start > timeout_s:
                out.hang = True
                out.error = f"still streaming after {timeout_s:g} s ({len(times)} output chunks): watchdog"
                break
        if not out.hang and not times:
            out.error = "the stream ended with no output"
    except openai.APIStatusError as e:
        err = e.body.get("error", e.body) if isinstance(e.body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        out.status, out.error = e.status_code, f"HTTP {e.status_code}: {msg or e.message}"
    except Exception as e:  # noqa: BLE001  (the stream's reads raise the transport's own errors, unwrapped)
        if _is_timeout(e):
            out.hang, out.error = True, f"no answer for {timeout_s:g} s ({len(times)} output chunks so far): watchdog"
        else:
            out.error = f"{type(e).__name__}: {e.__cause__ or e}"
    finally:
        if stream is not None:
            stream.close()  # a hung request's connection goes, so the engine can see its client leave
    out.total_s = time.perf_counter() - start
    if times:
        out.ttft_s = times[0] - start
        if len(times) > 1:
            out.tpot_s = (times[-1] - times[0]) / (len(times) - 1)
    out.token_ids, out.text = (ids or None), "".join(text)
    return out


def first_difference(a: Sequence, b: Sequence) -> int:
    """The first position where ``a`` and ``b`` differ (the shorter length where one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
