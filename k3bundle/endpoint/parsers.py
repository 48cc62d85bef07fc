"""``k3bundle parsers``: an endpoint's reasoning / content / tool-call split held against k3bundle's parser.

Every golden conversation with thinking and tools (the ``thinking``, ``tool_call`` and
``multi_turn`` cases, golden/cases/) is a probe, and so is each turn of one that made a tool call
(the conversation up to that assistant message: ``tool_call@1``), the request that asks the model
to call. Each probe is sent twice, greedily: not streamed, then streamed, asking for token ids
(``return_token_ids``). The checks (``CHECKS``):

- ``prompt_ids``: the prompt token ids the endpoint reports equal k3bundle's rendering of the
  same request (docs/chat.md §4.2);
- ``determinism``: both answers are the same completion (temperature 0, batch 1);
- ``split`` / ``stream_split``: ``reasoning_content``, ``content`` and ``tool_calls`` are exactly
  what k3bundle's XTML parser (§4.3) makes of the same raw completion: the token ids the endpoint
  reports, or where it reports none, the raw text of ``/v1/completions`` on k3bundle's rendering
  with ``skip_special_tokens`` off (the same greedy decode of the same prompt);
- ``no_markup``: no XTML marker in ``content``;
- ``tool_arguments``: each call names a declared tool, its arguments are a JSON object whose
  keys are declared parameters with values of the declared types (and enums), with every required
  parameter in a call that was not cut off;
- ``no_tools``: with no tools declared, no tool call.

A check that cannot be made (no token ids and no raw text, no call to judge) is "not checked",
with the reason; it does not fail the run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3bundle.chat import ParsedMessage, parse, render_ids
from k3bundle.chat import markup as mk
from k3bundle.endpoint.client import ChatResult, Endpoint
from k3bundle.endpoint.errors import EndpointRejected
from k3bundle.golden.cases import Case

KINDS = ("thinking", "tool_call", "multi_turn")
CHECKS = ("prompt_ids", "determinism", "split", "stream_split", "no_markup", "tool_arguments", "no_tools")
PASS, FAIL, NOT_CHECKED = "pass", "fail", "not checked"
_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class Probe:
    """One request: a golden conversation (or its prefix up to a tool-calling turn)."""

    name: str
    case: str
    messages: list
    tools: list | None
    render: dict  # thinking, thinking_effort, tool_choice, response_format as the case renders

    @property
    def thinking(self) -> bool:
        return bool(self.render.get("thinking", True))


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


@dataclass
class ProbeResult:
    probe: Probe
    checks: list[Check] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: list[int | None] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    raw_source: str = ""  # where the raw completion came from

    @property
    def passed(self) -> bool:
        return all(c.status != FAIL for c in self.checks)


def probes(cases: Sequence[Case]) -> list[Probe]:
    """The probes of the cases of ``KINDS``: each conversation, and each tool-calling turn of it."""
    out = []
    for c in cases:
        if c.kind not in KINDS or c.messages is None:
            continue
        out.append(Probe(c.name, c.name, list(c.messages), c.tools, dict(c.render)))
        for i, m in enumerate(c.messages):
            if m.get("role") == "assistant" and m.get("tool_calls") and c.tools:
                out.append(Probe(f"{c.name}@{i}", c.name, list(c.messages[:i]), c.tools, dict(c.render)))
    return out


def _snip(s: str, at: int = 0, n: int = 60) -> str:
    return repr(s[max(0, at - 10): at + n])


def _first_diff(a: Sequence, b: Sequence) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _token(encoding, i: int) -> str:
    return repr(encoding.decode_single_token_bytes(i).decode("utf-8", "replace"))


def check_prompt_ids(got: list[int] | None, want: list[int], encoding) -> Check:
    if got is None:
        return Check("prompt_ids", NOT_CHECKED, "the endpoint reports no prompt token ids (vLLM: return_token_ids)")
    if list(got) == want:
        return Check("prompt_ids", PASS, f"{len(want)} ids equal k3bundle's rendering")
    i = _first_diff(got, want)
    g = f"{got[i]} {_token(encoding, got[i])}" if i < len(got) else "(end)"
    w = f"{want[i]} {_token(encoding, want[i])}" if i < len(want) else "(end)"
    return Check("prompt_ids", FAIL, f"prompt token ids differ from k3bundle's rendering at position {i} "
                                     f"({len(got)} ids against {len(want)}): endpoint {g}, k3bundle {w}")


def _calls(r: ChatResult) -> list[tuple[str, Any]]:
    out = []
    for c in r.tool_calls:
        try:
            out.append((c.name, json.loads(c.arguments)))
        except json.JSONDecodeError:
            out.append((c.name, c.arguments))
    return out


def check_determinism(a: ChatResult, b: ChatResult) -> Check:
    if a.token_ids is not None and b.token_ids is not None:
        if a.token_ids == b.token_ids:
            return Check("determinism", PASS, f"the same {len(a.token_ids)} completion tokens, streamed and not")
        i = _first_diff(a.token_ids, b.token_ids)
        return Check("determinism", FAIL, "nondeterministic: the same request at temperature 0 gave different "
                                          f"completions (not streamed / streamed), first at completion token {i}")
    fields = lambda r: (r.reasoning or "", r.content, _calls(r))  # noqa: E731
    if fields(a) == fields(b):
        return Check("determinism", PASS, "the same reasoning, content and tool calls, streamed and not")
    return Check("determinism", FAIL, "nondeterministic: the same request at temperature 0 gave different "
                                      "reasoning, content or tool calls (not streamed / streamed)")


def check_split(name: str, got: ChatResult, want: ParsedMessage | None, thinking: bool, why_not: str) -> Check:
    if want is None:
        return Check(name, NOT_CHECKED, why_not)
    problems = []
    reasoning = got.reasoning or ""
    if reasoning != (want.reasoning if thinking else ""):
        i = _first_diff(reasoning, want.reasoning)
        problems.append(f"reasoning_content {_snip(reasoning, i)} where the parser has {_snip(want.reasoning, i)}")
    if got.content != want.content:
        i = _first_diff(got.content, want.content)
        problems.append(f"content {_snip(got.content, i)} where the parser has {_snip(want.content, i)}")
    want_calls = [(c.name, c.arguments) for c in want.tool_calls]
    if _calls(got) != want_calls:
        problems.append(f"tool_calls {_calls(got)!r:.120} where the parser has {want_calls!r:.120}")
    if problems:
        return Check(name, FAIL, "the split differs from k3bundle's parse of the raw completion: " + "; ".join(problems))
    return Check(name, PASS, f"reasoning {len(want.reasoning)} chars, content {len(want.content)} chars, "
                             f"{len(want_calls)} tool calls, as k3bundle's parser splits them")


def check_no_markup(results: Sequence[ChatResult]) -> Check:
    for r in results:
        hit = next((m for m in mk.MARKERS if m in r.content), None)
        if hit is not None:
            return Check("no_markup", FAIL, f"XTML markup in content: {hit} in {_snip(r.content, r.content.index(hit))}")
    return Check("no_markup", PASS, "no XTML marker in content")


def _argument_problem(tools: list, name: str, arguments: str, complete: bool) -> str | None:
    declared = {t.get("function", t).get("name"): t.get("function", t) for t in tools}
    if name not in declared:
        return f"call of {name!r}, which is not a declared tool ({', '.join(map(str, declared))})"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"{name}: arguments are not JSON ({e.msg}): {arguments!r:.80}"
    if not isinstance(args, dict):
        return f"{name}: arguments are JSON but not an object: {arguments!r:.80}"
    params = declared[name].get("parameters") or {}
    props = params.get("properties") or {}
    for key, value in args.items():
        if key not in props:
            return f"{name}: argument {key!r} is not a declared parameter ({', '.join(props)})"
        want = props[key].get("type")
        types = want if isinstance(want, list) else [want] if want else []
        if types and not any(_TYPES.get(t, lambda v: True)(value) for t in types):
            return f"{name}: argument {key!r} = {value!r:.40} is not of the declared type {want}"
        if "enum" in props[key] and value not in props[key]["enum"]:
            return f"{name}: argument {key!r} = {value!r:.40} is not one of {props[key]['enum']}"
    missing = [k for k in params.get("required") or [] if k not in args]
    if complete and missing:
        return f"{name}: required argument {missing[0]!r} is missing"
    return None


def check_tool_arguments(results: Sequence[tuple[ChatResult, ParsedMessage | None]], tools: list | None) -> Check:
    if not tools:
        return Check("tool_arguments", NOT_CHECKED, "no tools declared")
    n = 0
    for r, parsed in results:
        for i, c in enumerate(r.tool_calls):
            # cut off: the parser says so, or (no raw completion) the answer ran out of tokens on its last call
            cut = (parsed is not None and i < len(parsed.tool_calls) and not parsed.tool_calls[i].complete) or \
                  (parsed is None and r.finish_reason == "length" and i == len(r.tool_calls) - 1)
            problem = _argument_problem(tools, c.name, c.arguments, not cut)
            if problem:
                return Check("tool_arguments", FAIL, problem)
            n += 1
    if not n:
        return Check("tool_arguments", NOT_CHECKED, "the model made no tool call")
    return Check("tool_arguments", PASS, f"{n} calls: declared tools, JSON objects of the declared types")


def check_no_tools(results: Sequence[ChatResult], tools: list | None) -> Check:
    if tools:
        return Check("no_tools", NOT_CHECKED, "tools are declared")
    made = [c.name for r in results for c in r.tool_calls]
    if made:
        return Check("no_tools", FAIL, f"tool call ({made[0]}) with no tools declared")
    return Check("no_tools", PASS, "no tools declared, no tool call")


def run_probe(ep: Endpoint, probe: Probe, encoding, max_tokens: int) -> ProbeResult:
    """Send ``probe`` (not streamed, then streamed) and make every check."""
    r = probe.render
    want_prompt = render_ids(probe.messages, encoding, tools=probe.tools, **r)
    ask = dict(tools=probe.tools, max_tokens=max_tokens, thinking=probe.thinking,
               thinking_effort=r.get("thinking_effort") if probe.thinking else None,
               tool_choice=r.get("tool_choice"), return_token_ids=True,
               extra_body={"response_format": r["response_format"]} if r.get("response_format") else None)
    a = ep.chat(probe.messages, stream=False, **ask)
    b = ep.chat(probe.messages, stream=True, **ask)
    out = ProbeResult(probe, prompt_tokens=a.timing.prompt_tokens,
                      completion_tokens=[a.timing.completion_tokens, b.timing.completion_tokens],
                      finish_reasons=[a.finish_reason, b.finish_reason])
    raws, why_not = _raw(ep, [a, b], want_prompt, max_tokens, probe.thinking, encoding, out)
    out.checks = [
        check_prompt_ids(a.prompt_token_ids if a.prompt_token_ids is not None else b.prompt_token_ids,
                         want_prompt, encoding),
        check_determinism(a, b),
        check_split("split", a, raws[0], probe.thinking, why_not),
        check_split("stream_split", b, raws[1], probe.thinking, why_not),
        check_no_markup([a, b]),
        check_tool_arguments(list(zip([a, b], raws)), probe.tools),
        check_no_tools([a, b], probe.tools),
    ]
    return out


def _raw(ep: Endpoint, results: list[ChatResult], prompt: list[int], max_tokens: int, thinking: bool, encoding,
         out: ProbeResult) -> tuple[list[ParsedMessage | None], str]:
    """k3bundle's parse of each answer's raw completion: its token ids, else the raw text of
    ``/v1/completions`` on k3bundle's rendering (asked once, for both answers)."""
    if all(r.token_ids is not None for r in results):
        out.raw_source = "the completion token ids the endpoint reports"
        return [parse(r.token_ids, thinking=thinking, encoding=encoding) for r in results], ""
    try:
        c = ep.complete(prompt, max_tokens=max_tokens, skip_special_tokens=False, return_token_ids=True)
    except EndpointRejected as e:
        why = f"the endpoint reports no completion token ids and /v1/completions gave no raw text ({e})"
        out.raw_source = "none"
        return [None] * len(results), why
    raw = parse(c.token_ids, thinking=thinking, encoding=encoding) if c.token_ids is not None else \
        parse(c.text, thinking=thinking)
    out.raw_source = "/v1/completions on k3bundle's rendering (raw text, special tokens kept)"
    return [raw] * len(results), ""
