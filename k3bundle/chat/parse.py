"""Parse generated K3 output into reasoning, content and tool calls, at once or streaming.

Format: docs/chat.md, generated output. The input is what the model generated after
the generation prompt: in thinking mode it starts inside the think channel
(``REASONING<|close|>think<|sep|><|open|>response<|sep|>…``), otherwise inside the
response channel. Behaviour follows vLLM's Kimi K3 parsers
(``vllm/frontend/processing/reasoning/kimi_k3_reasoning_parser.py`` and
``vllm/frontend/processing/tool_parsers/kimi_k3_tool_parser.py``); see ``docs/chat.md``
for where this parser differs.

Two stages: a lexer turns text or token ids into markers (``<|open|>``, ``<|close|>``,
``<|sep|>``, ``<|end_of_msg|>``) and text; a state machine over a stack of open elements
builds the result. From ids only the marker *tokens* are markers, so content that
literally contains ``<|close|>`` (encoded as ordinary BPE, §4.1) parses exactly; from
text the marker strings are all that can be seen.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Sequence
from typing import Any

from k3bundle.chat import markup as mk
from k3bundle.chat.errors import ChatError
from k3bundle.chat.types import Delta, ParsedMessage, ToolCall

_ATTR = re.compile(r'\s*([^\s="]+)="([^"]*)"')
_TEXT_CHANNELS = {"think": "reasoning", "response": "content", "argument": None, "json": None}


# ---------------------------------------------------------------- lexers


class _TextLexer:
    """Split streamed text into markers and text; a marker may straddle chunks."""

    _FIND = re.compile("|".join(re.escape(m) for m in mk.MARKERS))

    def __init__(self) -> None:
        self.buf = ""

    def feed(self, chunk: str) -> list[tuple[str, str]]:
        self.buf += chunk
        events: list[tuple[str, str]] = []
        pos = 0
        for m in self._FIND.finditer(self.buf):
            if m.start() > pos:
                events.append(("text", self.buf[pos : m.start()]))
            events.append(("marker", m.group()))
            pos = m.end()
        rest = self.buf[pos:]
        hold = _partial_marker_len(rest)  # keep a possible marker start for the next chunk
        if len(rest) > hold:
            events.append(("text", rest[: len(rest) - hold]))
        self.buf = rest[len(rest) - hold :]
        return events

    def flush(self) -> list[tuple[str, str]]:
        rest, self.buf = self.buf, ""
        return [("text", rest)] if rest else []


def _partial_marker_len(s: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of a marker."""
    best = 0
    for marker in mk.MARKERS:
        for n in range(min(len(marker) - 1, len(s)), best, -1):
            if s.endswith(marker[:n]):
                best = n
                break
    return best


class _IdLexer:
    """Turn streamed token ids into markers (only the marker tokens) and text."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.markers = {encoding.encode_single_token(m): m for m in mk.MARKERS}
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Sequence[int]) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        data = bytearray()
        for i in ids:
            i = int(i)
            marker = self.markers.get(i)
            if marker is None:
                data += self.encoding.decode_single_token_bytes(i)
                continue
            text = self.utf8.decode(bytes(data), final=True)  # bytes cut by a marker
            data.clear()
            if text:
                events.append(("text", text))
            events.append(("marker", marker))
        text = self.utf8.decode(bytes(data))
        if text:
            events.append(("text", text))
        return events

    def flush(self) -> list[tuple[str, str]]:
        text = self.utf8.decode(b"", final=True)
        return [("text", text)] if text else []


# ---------------------------------------------------------------- state machine


class _Element:
    """An open XTML element: its tag name, attributes and collected text."""

    def __init__(self, name: str, attrs: dict[str, str] | None = None) -> None:
        self.name = name
        self.attrs = attrs or {}
        self.text: list[str] = []


class _Call:
    def __init__(self, attrs: dict[str, str], position: int, raw: str) -> None:
        self.name = attrs.get("tool", "")
        index = attrs.get("index", "")
        self.index = int(index) if index.isdigit() else position
        self.arguments: dict[str, Any] = {}
        self.json_block: str | None = None
        self.raw = [raw]

    def result(self, complete: bool) -> ToolCall:
        return ToolCall(self.name, self.index, self.arguments, "".join(self.raw),
                        self.json_block, complete)


def decode_argument(value: str, declared_type: str) -> Any:
    """§4.3: ``type="string"`` values are raw text; others are JSON-decoded, falling
    back to the raw text when they are not valid JSON (as vLLM does)."""
    if declared_type == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class StreamParser:
    """Incremental §4.3 parser: ``feed`` text or id chunks, then ``finish``.

    ``feed`` returns the new :class:`Delta` events; a tool call is reported once its
    element closes. The reasoning and content deltas of ``feed`` and :meth:`flush`
    concatenate to the final message's fields, for any chunking.
    """

    def __init__(self, thinking: bool = True, encoding: Any = None) -> None:
        self.encoding = encoding
        self._lexer: _TextLexer | _IdLexer | None = None
        self._msg = ParsedMessage()
        self._parts: dict[str, list[str]] = {"reasoning": [], "content": []}  # joined at the end
        # §4.3: after the generation prompt the output starts inside the think
        # channel (thinking) or the response channel (non-thinking).
        self._stack = [_Element("message"), _Element("think" if thinking else "response")]
        self._fresh = True  # nothing seen yet: a repeated opening tag is skipped
        self._head: tuple[str, list[str]] | None = None  # pending tag: marker, text
        self._call: _Call | None = None
        self._calls_seen = 0
        self._done = False
        self._flushed = False
        self._out: list[Delta] = []

    # -- public

    def feed(self, chunk: str | Sequence[int]) -> list[Delta]:
        if self._flushed:
            raise ChatError("StreamParser.feed after finish/flush")
        self._run(self._lex(chunk).feed(chunk))
        return self._take()

    def flush(self) -> list[Delta]:
        """End of input: pending text is resolved; a cut-off call is reported."""
        if not self._flushed:
            self._flushed = True
            if self._lexer is not None:
                self._run(self._lexer.flush())
            self._end_of_input()
        return self._take()

    def finish(self) -> ParsedMessage:
        self.flush()
        return self._msg

    # -- lexing

    def _lex(self, chunk: Any) -> _TextLexer | _IdLexer:
        want = _TextLexer if isinstance(chunk, str) else _IdLexer
        if self._lexer is None:
            if want is _IdLexer and self.encoding is None:
                raise ChatError("parsing token ids needs an encoding (a tiktoken Encoding)")
            self._lexer = _TextLexer() if want is _TextLexer else _IdLexer(self.encoding)
        elif not isinstance(self._lexer, want):
            raise ChatError("feed either text or token ids, not both")
        return self._lexer

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    # -- events

    def _run(self, events: list[tuple[str, str]]) -> None:
        for kind, value in events:
            if self._done:
                return
            if self._call is not None:
                self._call.raw.append(value)
            if kind == "text":
                if self._head is not None:
                    self._head[1].append(value)
                else:
                    self._text(value)
                    self._fresh = False
            elif value in (mk.OPEN, mk.CLOSE):
                self._abandon_head()
                self._head = (value, [])
            elif value == mk.SEP and self._head is not None:
                marker, parts = self._head
                self._head = None
                self._tag(marker, "".join(parts))
                self._fresh = False
            elif value == mk.END_OF_MSG:
                # §4.2/§4.1: <|end_of_msg|> ends the message (it is the stop token).
                self._abandon_head()
                self._close_all()
            else:  # a lone <|sep|>: plain text wherever it is
                self._text(value)
                self._fresh = False

    def _abandon_head(self) -> None:
        """A tag that never got its ``<|sep|>`` is text after all."""
        if self._head is not None:
            marker, parts = self._head
            self._head = None
            self._text(marker + "".join(parts))
            self._fresh = False

    def _text(self, text: str) -> None:
        if not text:
            return
        top = self._stack[-1]
        if top.name in _TEXT_CHANNELS:
            field = _TEXT_CHANNELS[top.name]
            if field is None:
                top.text.append(text)  # an argument or json value
            else:
                self._emit(field, text)
        elif top.name == "message":
            self._emit("content", text)  # stray text between channels
        # text between tools/calls/arguments is ignored (it stays in a call's raw)

    def _emit(self, field: str, text: str) -> None:
        self._parts[field].append(text)
        self._out.append(Delta(field, text))

    def _tag(self, marker: str, head: str) -> None:
        literal = f"{marker}{head}{mk.SEP}"
        name, _, rest = head.partition(" ")
        is_open = marker == mk.OPEN
        top = self._stack[-1]
        if is_open and self._fresh and name == top.name:
            return  # the generation prompt's opening tag, generated again: skip
        if not is_open and name == top.name:
            self._close_top()
            return
        if top.name in _TEXT_CHANNELS:
            # vLLM: a tools channel or message close also ends an unclosed response.
            ends_response = (is_open and name == "tools") or (not is_open and name == "message")
            if top.name == "response" and ends_response:
                self._close_top()
                self._tag(marker, head)
            else:
                self._text(literal)  # anything else is part of the channel's text
            return
        attrs = {k: mk.unescape_attr(v) for k, v in _ATTR.findall(rest)} if is_open else {}
        if top.name == "message" and is_open and name in ("think", "response", "tools"):
            self._stack.append(_Element(name))
        elif top.name == "tools" and is_open and name == "call":
            self._calls_seen += 1
            self._call = _Call(attrs, self._calls_seen, literal)
            self._stack.append(_Element(name, attrs))
        elif top.name == "call" and is_open and name in ("argument", "json"):
            self._stack.append(_Element(name, attrs))
        elif top.name == "message":
            self._emit("content", literal)
        # other tags inside tools/call are ignored (they stay in the call's raw)

    def _close_top(self) -> None:
        """Close the innermost element (its close tag has been seen)."""
        el = self._stack.pop()
        text = "".join(el.text)
        if el.name == "argument" and self._call is not None:
            key, declared = el.attrs.get("key", ""), el.attrs.get("type", "string")
            self._call.arguments[key] = decode_argument(text, declared)
        elif el.name == "json" and self._call is not None:
            # §4.2 fallback: arguments that were not JSON, kept verbatim.
            self._call.json_block = text
            try:
                decoded = json.loads(text)
            except json.JSONDecodeError:
                decoded = None
            if isinstance(decoded, dict):
                self._call.arguments.update(decoded)
        elif el.name == "call" and self._call is not None:
            self._emit_call(complete=True)
        elif el.name == "message":
            self._close_all()

    def _emit_call(self, complete: bool) -> None:
        call = self._call.result(complete)
        self._call = None
        self._msg.tool_calls.append(call)
        self._out.append(Delta("tool_call", tool_call=call))

    def _close_all(self) -> None:
        self._msg.finished = True
        self._done = True

    def _end_of_input(self) -> None:
        self._abandon_head()
        self._msg.reasoning = "".join(self._parts["reasoning"])
        self._msg.content = "".join(self._parts["content"])
        if self._done:
            return
        if any(el.name == "tools" for el in self._stack):
            # §4.3: a tools channel cut off by the end of the output is reported.
            self._msg.truncated_tool_section = True
            if self._call is not None:
                self._emit_call(complete=False)


def parse(
    text_or_ids: str | Sequence[int], thinking: bool = True, encoding: Any = None
) -> ParsedMessage:
    """Parse generated output (text, or token ids with ``encoding``) in one go."""
    p = StreamParser(thinking=thinking, encoding=encoding)
    p.feed(text_or_ids)
    return p.finish()
