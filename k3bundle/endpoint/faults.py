"""``k3bundle faults``: the fault paths an endpoint can be driven into from outside, each recorded.

Each fault is provoked, then re-validated: the golden request sent before the fault is sent
again and must give the same output (token ids, else text) within the watchdog, which shows the
server kept serving. The faults:

- ``over_context``: a request whose completion alone exceeds the context (``max_model_len + 1``
  tokens where ``/v1/models`` reports the length, else 2^24): a clear error is a 4xx with a
  message; a stream that starts is a failure;
- ``client_disconnect``: a long stream left after its first chunks; nothing to report, so the
  outcome is ``survived`` when the server answers the next request;
- ``malformed_request``: a body that is not JSON, and one whose ``messages`` is a string: each
  must be a 4xx with a message (not a 5xx, not a hang).

The hardware faults of the sign-off (out of memory, collective timeout, bad page, device reset)
need the target's own injection; they are recorded ``not_run`` with how to run them, never as a
pass. Outcomes: ``clean_error``, ``survived``, ``failed``, ``not_run``; ``detected`` for the corrupted
cache page / KDA snapshot that ``faults BUNDLE`` plants on the bundle's serving path
(``validate.serving_faults``) and locates.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from k3bundle.endpoint.client import Endpoint
from k3bundle.endpoint.errors import EndpointError
from k3bundle.endpoint.replay import GoldenRequest, Sent, send

CLEAN, SURVIVED, FAILED, NOT_RUN = "clean_error", "survived", "failed", "not_run"
DETECTED = "detected"  # a fault planted in the bundle's own cache path, located (``faults BUNDLE``)
UNKNOWN_CONTEXT = 1 << 24
DISCONNECT_AFTER = 3  # chunks read before the client leaves
DISCONNECT_TOKENS = 2048


@dataclass
class FaultResult:
    fault: str
    outcome: str
    error: str = ""  # the endpoint's message for the fault
    revalidated: bool | None = None  # the reference request answered the same after it
    detail: str = ""
    run: str = ""  # how to run a fault recorded not_run

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v != "" and v is not None} | {"revalidated": self.revalidated}


def revalidate(ep: Endpoint, req: GoldenRequest, ref: Sent, max_tokens: int, timeout_s: float) -> tuple[bool, str]:
    again = send(ep, req, max_tokens, timeout_s, time.perf_counter())
    if not again.ok:
        return False, f"the next request failed: {again.error}"
    if again.output != ref.output:
        return False, f"the next request answered differently from before the fault ({req.name})"
    return True, f"the next request ({req.name}) answered in {again.total_s:.2f} s, the same as before the fault"


def _judged(result: FaultResult, ep, req, ref, max_tokens, timeout_s) -> FaultResult:
    ok, why = revalidate(ep, req, ref, max_tokens, timeout_s)
    result.revalidated, result.detail = ok, "; ".join(p for p in (result.detail, why) if p)
    if not ok and result.outcome in (CLEAN, SURVIVED):
        result.outcome = FAILED
    return result


def context_length(ep: Endpoint) -> int | None:
    """``max_model_len`` of the served model as ``/v1/models`` reports it (vLLM, SGLang, k3bundle serve)."""
    for m in ep.client.models.list().data:
        if m.id == ep.model:
            n = (m.model_extra or {}).get("max_model_len")
            return int(n) if n else None
    return None


def over_context(ep: Endpoint, req: GoldenRequest, ref: Sent, max_tokens: int, timeout_s: float) -> FaultResult:
    length = context_length(ep)
    ask = length + 1 if length else UNKNOWN_CONTEXT
    s = send(ep, req, ask, timeout_s, time.perf_counter())
    where = f"max_tokens {ask:,} ({'context ' + format(length, ',') if length else 'context not reported'})"
    if s.status is not None and 400 <= s.status < 500 and s.error:
        r = FaultResult("over_context", CLEAN, s.error, detail=where)
    elif s.ok:
        r = FaultResult("over_context", FAILED, detail=f"{where}: accepted, {s.chunks} chunks streamed")
    else:
        r = FaultResult("over_context", FAILED, s.error or "", detail=f"{where}: {'hang' if s.hang else 'not a 4xx'}")
    return _judged(r, ep, req, ref, max_tokens, timeout_s)


def client_disconnect(ep: Endpoint, req: GoldenRequest, ref: Sent, max_tokens: int, timeout_s: float) -> FaultResult:
    client = ep.client.with_options(timeout=timeout_s)
    length, tokens = context_length(ep), DISCONNECT_TOKENS
    if length and ref.prompt_tokens:
        tokens = min(tokens, length - ref.prompt_tokens)
    common = dict(model=ep.model, max_tokens=tokens, temperature=0, stream=True)
    try:
        stream = (client.chat.completions.create(messages=req.messages, **common) if req.messages is not None
                  else client.completions.create(prompt=req.prompt, **common))
        got = 0
        for _ in stream:
            got += 1
            if got >= DISCONNECT_AFTER:
                break
        stream.close()
    except Exception as e:  # noqa: BLE001  (whatever the stream did, the point is what happens next)
        return _judged(FaultResult("client_disconnect", FAILED, f"{type(e).__name__}: {e}",
                                   detail="the long stream failed before the client left"), ep, req, ref, max_tokens, timeout_s)
    r = FaultResult("client_disconnect", SURVIVED, detail=f"left a {tokens}-token stream after {got} chunks")
    return _judged(r, ep, req, ref, max_tokens, timeout_s)


def _post(url: str, body: bytes, timeout_s: float) -> tuple[int | None, str]:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read(2000).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        text = e.read(4000).decode("utf-8", "replace")
        try:
            err = json.loads(text)
            err = err.get("error", err) if isinstance(err, dict) else err
            msg = err.get("message") or err.get("detail") if isinstance(err, dict) else None
            text = msg if isinstance(msg, str) else json.dumps(msg) if msg else text
        except ValueError:
            pass
        return e.code, text.strip()
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"


def malformed_request(ep: Endpoint, req: GoldenRequest, ref: Sent, max_tokens: int, timeout_s: float) -> FaultResult:
    url = ep.base_url + "/chat/completions"
    bodies = {"not JSON": b'{"model": ', "messages a string": json.dumps(
        {"model": ep.model, "messages": "hello", "max_tokens": 1}).encode()}
    errors, bad = [], []
    for what, body in bodies.items():
        status, msg = _post(url, body, timeout_s)
        if status is not None and 400 <= status < 500 and msg:
            errors.append(f"{what}: HTTP {status}: {msg}")
        else:
            bad.append(f"{what}: {'HTTP ' + str(status) if status else 'no answer'} {msg[:200]}")
    r = (FaultResult("malformed_request", CLEAN, " | ".join(errors)) if not bad
         else FaultResult("malformed_request", FAILED, " | ".join(bad), detail="needs a 4xx with a message"))
    return _judged(r, ep, req, ref, max_tokens, timeout_s)


ENDPOINT_FAULTS = {"over_context": over_context, "client_disconnect": client_disconnect,
                   "malformed_request": malformed_request}


def run(ep: Endpoint, req: GoldenRequest, *, max_tokens: int, timeout_s: float,
        not_run: Sequence[tuple[str, str]] = (), say=lambda s: None) -> list[FaultResult]:
    """Every endpoint fault after a reference answer to ``req``; ``not_run`` (fault, how to run it)
    are recorded as not run."""
    ref = send(ep, req, max_tokens, timeout_s, time.perf_counter())
    if not ref.ok:
        raise EndpointError(f"{ep.base_url}: the reference request {req.name} failed before any fault: {ref.error}")
    out = []
    for name, fn in ENDPOINT_FAULTS.items():
        say(f"faults: {name}")
        out.append(fn(ep, req, ref, max_tokens, timeout_s))
        say(f"faults: {name}: {out[-1].outcome}")
    out += [FaultResult(key, NOT_RUN, detail="needs the target's own fault injection", run=how) for key, how in not_run]
    return out
