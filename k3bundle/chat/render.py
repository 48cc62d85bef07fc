"""Render a conversation as K3 XTML segments, text or token ids.

Format: docs/chat.md, rendering; exact message texts and edge rules follow the
release's ``encoding_k3.build_chat_segments`` (NVIDIA-NeMo/Automodel
``nemo_automodel/components/models/kimi_k3/encoding.py``); see ``docs/chat.md``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from k3bundle.chat import markup as mk
from k3bundle.chat.errors import ChatError
from k3bundle.chat.types import Segment

#: Accepted ``thinking_effort`` values (the release encoder's; some ports
#: accept only low/high/max).
THINKING_EFFORTS: tuple[str, ...] = ("low", "medium", "high", "max")

# §4.2 item 2: the thinking-effort system message.
_THINKING_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel "
    "(not including the response channel), supported values include `low`, `medium`, "
    "`high`, and `max`.\nNow the system is invoked with `thinking_effort={effort}`."
)
# §4.2 item 1 and item 3 (system message carrying ``tools``): tool declarations.
_TOOLS_BODY = (
    "# Tools\n"
    "Here are the available tools, described in JSONSchema.\n\n"
    "```json\n{json}\n```"
)
_NEW_TOOLS_BODY = (
    "## New Tools Available\n"
    "The system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\n"
    "Here are the specs for the extended tools.\n\n"
    "```json\n{json}\n```"
)
# §4.2 item 4: tool_choice and response_format messages.
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\n"
    "You MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\n"
    "You MUST NOT call any tools in the next message.",
}
_RAW_JSON = (
    "Your response must be raw JSON data without markdown code blocks (```json) "
    "or any additional formatting."
)
_JSON_OBJECT_BODY = f"The system is invoked with `response_format=json_object`.\n{_RAW_JSON}"
_JSON_SCHEMA_BODY = (
    f"The system is invoked with `response_format=json_schema`.\n{_RAW_JSON}\n"
    "The JSON data must match the following schema:\n```json\n{json}\n```"
)

# The release tokenizer's limits per tiktoken call (``_encode_text_piece``); splitting
# here reproduces its ids exactly.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_RUN = re.compile(r"\s+|\S+")


# ---------------------------------------------------------------- JSON helpers


def deep_sort(obj: Any) -> Any:
    """Sort every dict's keys, recursively (§4.2: tools and schemas are deep-sorted)."""
    if isinstance(obj, dict):
        return {k: deep_sort(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [deep_sort(v) for v in obj]
    return obj


def compact_json(obj: Any) -> str:
    """§4.2: separators ``,`` and ``:``, ``ensure_ascii=False``."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def argument_type(value: Any) -> str:
    """The ``type`` attribute of a tool-call argument (§4.2)."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise ChatError(f"tool-call argument of type {type(value).__name__} is not JSON")


def argument_text(value: Any) -> str:
    """§4.2: strings raw, anything else ``json.dumps`` with the DEFAULT separators
    (``", "``, ``": "``), ``ensure_ascii=False``, keys in the caller's order."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def normalize_arguments(arguments: Any) -> tuple[dict[str, Any], str | None]:
    """A call's arguments as ``(mapping, json_block)``.

    None or a blank string is ``{}``; a JSON-object string is decoded; a string that is
    not JSON is kept verbatim as the ``json_block`` fallback (§4.2); JSON that is not
    an object is an error, as in the release encoder.
    """
    if arguments is None:
        return {}, None
    if isinstance(arguments, dict):
        return arguments, None
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}, None
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            return {}, arguments
        if not isinstance(decoded, dict):
            raise ChatError(f"tool-call arguments must be a JSON object, got {arguments[:60]!r}")
        return decoded, None
    raise ChatError(
        f"tool-call arguments must be a dict or a string, got {type(arguments).__name__}"
    )


# ---------------------------------------------------------------- tool results


def _function(call: dict) -> dict:
    fn = call.get("function", call)
    if not isinstance(fn, dict):
        raise ChatError(f"tool call {call!r:.80} has no function object")
    return fn


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def reorder_tool_results(messages: Sequence[Any]) -> list[Any]:
    """§4.2: sort each run of consecutive tool messages into the order of the latest
    assistant's ``tool_calls``, matching ``tool_call_id`` (or ``id``) to
    ``tool_calls[].id``; a matched message's ``tool`` (and ``name``, if present) is
    overwritten with the call's function name. A run with any unmatched message is
    left as it is. Returns a new list; the input messages are not modified.
    """
    out: list[Any] = []
    positions: dict[str, tuple[int, Any]] = {}  # call id -> (1-based position, name)
    i = 0
    while i < len(messages):
        m = messages[i]
        role = _role(m)
        if role != "tool":
            if role == "assistant":
                positions = {}
                for pos, call in enumerate(m.get("tool_calls") or [], start=1):
                    if isinstance(call, dict) and call.get("id") is not None:
                        fn = call.get("function")
                        name = fn.get("name") if isinstance(fn, dict) else call.get("name")
                        positions.setdefault(str(call["id"]), (pos, name))  # first id wins
            out.append(m)
            i += 1
            continue
        run = []
        while i < len(messages) and _role(messages[i]) == "tool":
            t = messages[i]
            call_id = t.get("tool_call_id", t.get("id"))
            run.append((positions.get(str(call_id)) if call_id is not None else None, t))
            i += 1
        if any(match is None for match, _ in run):
            out.extend(t for _, t in run)
            continue
        for (_, name), t in sorted(run, key=lambda r: r[0][0]):  # stable: ties keep order
            if name is not None:
                t = dict(t, tool=name)
                if "name" in t:
                    t["name"] = name
            out.append(t)
    return out


# ---------------------------------------------------------------- images


class _Images:
    """Hands out image prompts in order; replaces ``<|kimi_image_placeholder|>``."""

    def __init__(self, images: Sequence[Any] | None):
        self.prompts = None if images is None else [_image_prompt(x) for x in images]
        self.used = 0

    def next(self) -> list[Segment]:
        if self.prompts is None:
            return mk.segment(mk.IMAGE_PLACEHOLDER, structural=True)
        if self.used >= len(self.prompts):
            raise ChatError(f"more images in the conversation than the {len(self.prompts)} given")
        self.used += 1
        return mk.segment(self.prompts[self.used - 1], structural=True)

    def text(self, value: Any) -> list[Segment]:
        """Content text; with image prompts given, each placeholder in it is an image."""
        s = str(value)
        if self.prompts is None or mk.IMAGE_PLACEHOLDER not in s:
            return mk.text(s)
        parts = s.split(mk.IMAGE_PLACEHOLDER)
        out = mk.text(parts[0])
        for part in parts[1:]:
            out += self.next() + mk.text(part)
        return out

    def check_consumed(self) -> None:
        if self.prompts is not None and self.used != len(self.prompts):
            raise ChatError(
                f"{len(self.prompts)} images given but the conversation has {self.used}"
            )


def _image_prompt(x: Any) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, (tuple, list)) and len(x) in (2, 3):
        return mk.media_block(*x)
    raise ChatError(f"an image is a prompt string or (width, height[, pads]), got {x!r:.60}")


def _content(content: Any, images: _Images) -> list[Segment]:
    """§4.2: text parts concatenated in order; image parts become media blocks."""
    if content is None:
        return []
    if isinstance(content, str):
        return images.text(content)
    if not isinstance(content, list):
        raise ChatError(
            f"message content must be a string or a list of parts, got {type(content).__name__}"
        )
    out: list[Segment] = []
    for part in content:
        if not isinstance(part, dict):
            raise ChatError(f"a content part must be a dict, got {part!r:.60}")
        if part.get("type") in ("image", "image_url"):
            out += images.next()
        else:
            out += images.text(part["text"])
    return out


# ---------------------------------------------------------------- messages


def _message(attrs: list[tuple[str, Any]], body: list[Segment]) -> list[Segment]:
    """§4.2: ``<|open|>message …<|sep|>BODY<|close|>message<|sep|><|end_of_msg|>``."""
    return mk.open_tag("message", attrs) + body + mk.close_tag("message") + mk.end_of_msg()


def _system_notice(kind: str, body: str) -> list[Segment]:
    """An internal ``role="system" type=KIND`` message; the release strips its body."""
    return _message([("role", "system"), ("type", kind)], mk.text(body.strip()))


def _tool_declare(tools: Any, *, new: bool) -> list[Segment]:
    """§4.2 item 1 (and item 3 for a mid-conversation system message with ``tools``):
    deep-sorted compact JSON in a json fence; the body is not stripped."""
    body = (_NEW_TOOLS_BODY if new else _TOOLS_BODY).format(json=compact_json(deep_sort(tools)))
    return _message([("role", "system"), ("type", "tool-declare")], mk.text(body))


def _name_attr(attrs: list[tuple[str, Any]], message: dict) -> list[tuple[str, Any]]:
    # §4.2: optional ``name`` attribute, emitted only when non-empty.
    return attrs + [("name", message["name"])] if message.get("name") else attrs


def _tool_calls(calls: list, images: _Images) -> list[Segment]:
    """§4.2: ``<|open|>tools<|sep|>`` + one ``call`` per entry (1-based ``index``)."""
    out = mk.open_tag("tools")
    for index, call in enumerate(calls, start=1):
        fn = _function(call)
        args, json_block = normalize_arguments(fn.get("arguments"))
        out += mk.open_tag("call", [("tool", fn["name"]), ("index", index)])
        if json_block is not None:
            # §4.2: arguments that are not JSON are kept verbatim in a json element.
            out += mk.open_tag("json", [("type", "object")]) + images.text(json_block)
            out += mk.close_tag("json")
        else:
            for key, value in args.items():
                out += mk.open_tag("argument", [("key", key), ("type", argument_type(value))])
                out += images.text(argument_text(value)) + mk.close_tag("argument")
        out += mk.close_tag("call")
    return out + mk.close_tag("tools")


def _assistant(message: dict, images: _Images, thinking: bool) -> list[Segment]:
    """§4.2 assistant message. Returns the whole message; every segment after the open
    tag is marked ``assistant``."""
    body: list[Segment] = []
    if thinking:
        # §4.2: the think channel is always present in thinking mode, empty when there
        # is no (non-blank) reasoning; the reasoning itself is emitted unstripped.
        # §4.2 multi-turn: every past turn keeps its reasoning.
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        body += mk.open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            body += images.text(reasoning)
        body += mk.close_tag("think")
    body += mk.open_tag("response") + _content(message.get("content"), images)
    body += mk.close_tag("response")
    if message.get("tool_calls"):
        body += _tool_calls(message["tool_calls"], images)
    body += mk.close_tag("message") + mk.end_of_msg()
    head = mk.open_tag("message", _name_attr([("role", "assistant")], message))
    return head + [dataclasses.replace(s, assistant=True) for s in body]


def _response_format(response_format: Any) -> list[Segment]:
    """§4.2 item 4: json_object / json_schema (schema deep-sorted, compact)."""
    if response_format is None:
        return []
    kind = response_format.get("type") if isinstance(response_format, dict) else response_format
    if kind in (None, "text"):
        return []
    if kind == "json_object":
        return _system_notice("response-format", _JSON_OBJECT_BODY)
    if kind != "json_schema":
        raise ChatError(f"response_format type {kind!r} is not text, json_object or json_schema")
    schema = _schema(response_format)
    body = _JSON_SCHEMA_BODY.format(json=compact_json(deep_sort(schema)))
    return _system_notice("response-format", body)


def _schema(response_format: Any) -> Any:
    # Release ``extract_response_schema``: json_schema.schema, else
    # json_schema.json_schema, else the json_schema object itself.
    js = response_format.get("json_schema") if isinstance(response_format, dict) else None
    if js is None:
        raise ChatError("response_format json_schema needs a 'json_schema' object")
    if isinstance(js, dict):
        return js.get("schema", js.get("json_schema", js))
    return js


def render(
    messages: Sequence[dict],
    tools: list[dict] | None = None,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    tool_choice: Any = None,
    response_format: Any = None,
    add_generation_prompt: bool = True,
    images: Sequence[Any] | None = None,
) -> list[Segment]:
    """Render ``messages`` (OpenAI-style dicts) as XTML segments (§4.2).

    ``thinking_effort=None`` omits the effort message (it is also omitted when
    ``thinking`` is false). ``tool_choice``: None/"auto"/a named-function dict add
    nothing, "required"/"none" add a tool-choice message. ``response_format``: None,
    "text", "json_object" or "json_schema" (as a string or ``{"type": …}`` dict).
    ``images``: one prompt per image part / placeholder, each a ready prompt string or
    ``(width, height[, num_pads])`` for :func:`markup.media_block`; None renders images
    as the ``<|kimi_image_placeholder|>`` stand-in.
    """
    if thinking and thinking_effort is not None and thinking_effort not in THINKING_EFFORTS:
        allowed = ", ".join(THINKING_EFFORTS)
        raise ChatError(f"thinking_effort {thinking_effort!r} is not one of {allowed}")
    if not (tool_choice in (None, "auto", "required", "none") or isinstance(tool_choice, dict)):
        raise ChatError(f"tool_choice {tool_choice!r} is not auto, required, none or a function")
    img = _Images(images)
    out: list[Segment] = []
    if tools:  # §4.2 item 1: the tool declaration comes first
        out += _tool_declare(tools, new=False)
    if thinking and thinking_effort is not None:  # §4.2 item 2
        body = _THINKING_EFFORT_BODY.format(effort=thinking_effort)
        out += _system_notice("thinking-effort", body)

    calls: list | None = None  # the latest assistant's tool_calls
    tool_index = 0  # §4.2: tool results are numbered from 1 after each assistant message
    for m in reorder_tool_results(list(messages)):  # §4.2 item 3, in order
        role = _role(m)
        if role == "system" and m.get("tools"):
            out += _tool_declare(m["tools"], new=True)
        elif role in ("system", "user"):
            out += _message(_name_attr([("role", role)], m), _content(m.get("content"), img))
        elif role == "assistant":
            calls, tool_index = m.get("tool_calls"), 0
            out += _assistant(m, img, thinking)
        elif role == "tool":
            tool_index += 1
            name = m.get("tool", m.get("name"))
            if name is None and calls and tool_index <= len(calls):
                name = _function(calls[tool_index - 1]).get("name")  # by position
            if name is None:
                raise ChatError(
                    f"tool message {tool_index} has no tool name: give 'tool'/'name' "
                    "or a tool_call_id matching the assistant's tool_calls"
                )
            attrs = [("role", "tool"), ("tool", name), ("index", tool_index)]
            out += _message(attrs, _content(m.get("content"), img))
        else:
            raise ChatError(
                f"message role {role!r} is not system, user, assistant or tool "
                "(front-ends map 'developer' to 'system')"
            )

    # §4.2 item 4: tool-choice and response-format messages come after the conversation.
    if isinstance(tool_choice, str) and tool_choice in _TOOL_CHOICE_BODY:
        out += _system_notice("tool-choice", _TOOL_CHOICE_BODY[tool_choice])
    out += _response_format(response_format)
    if add_generation_prompt:  # §4.2 item 5
        out += mk.open_tag("message", [("role", "assistant")])
        out += mk.open_tag("think" if thinking else "response")
    img.check_consumed()
    return out


# ---------------------------------------------------------------- encoding


def _pieces(text: str) -> list[str]:
    """Split like the release tokenizer: 400k-char windows, then no run of whitespace
    or of non-whitespace longer than 25k chars (§4.1)."""
    out = []
    for w in range(0, len(text), _MAX_ENCODE_CHARS):
        window = text[w : w + _MAX_ENCODE_CHARS]
        if len(window) <= _MAX_RUN_CHARS:
            out.append(window)
            continue
        start = 0
        for run in _RUN.finditer(window):
            for cut in range(run.start() + _MAX_RUN_CHARS, run.end(), _MAX_RUN_CHARS):
                out.append(window[start:cut])
                start = cut
        out.append(window[start:])
    return out


def encode_segments(segments: Sequence[Segment], encoding: Any) -> list[int]:
    """Encode segment by segment (§4.1/§4.2): structural segments with every special
    token allowed, content with special tokens encoded as ordinary text."""
    return [i for ids in encode_segments_each(segments, encoding) for i in ids]


def encode_segments_each(segments: Sequence[Segment], encoding: Any) -> list[list[int]]:
    """The ids of each segment, in order (e.g. to build an assistant loss mask)."""
    out = []
    for s in segments:
        ids: list[int] = []
        for piece in _pieces(s.text):
            if s.structural:
                ids += encoding.encode(piece, allowed_special="all")
            else:
                ids += encoding.encode(piece, disallowed_special=())
        out.append(ids)
    return out


def render_text(messages: Sequence[dict], **kwargs: Any) -> str:
    """The rendered prompt as one string (for reading; encode with :func:`render_ids`)."""
    return "".join(s.text for s in render(messages, **kwargs))


def render_ids(messages: Sequence[dict], encoding: Any, **kwargs: Any) -> list[int]:
    """The rendered prompt as token ids, encoded segment by segment."""
    return encode_segments(render(messages, **kwargs), encoding)
