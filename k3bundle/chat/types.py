"""Data types of the K3 chat format: rendered segments and parsed output.

Format: docs/chat.md (segments and parsed output).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Segment:
    """One piece of a rendered prompt, tokenized on its own (§4.2).

    ``structural`` segments (the markers ``<|open|>``, ``<|close|>``, ``<|sep|>``,
    ``<|end_of_msg|>`` and media blocks) are encoded with special tokens allowed;
    every other segment is content, encoded with special tokens disallowed, so a
    literal ``<|open|>`` typed by a user becomes ordinary BPE tokens.
    ``assistant`` marks the body of an assistant message (after its open tag, up to
    and including its ``<|end_of_msg|>``), as the release's ``is_assistant`` does;
    use it to build a loss mask.
    """

    text: str
    structural: bool = False
    assistant: bool = False


@dataclass
class ToolCall:
    """One ``<|open|>call …<|sep|>`` element of a tools channel (§4.3).

    ``arguments`` holds each ``argument`` decoded by its declared ``type``
    (``string`` raw, others JSON). For the non-JSON fallback
    (``<|open|>json type="object"<|sep|>…<|close|>json<|sep|>``) ``json_block`` is
    its verbatim body and ``arguments`` is that body decoded when it is a JSON
    object, else ``{}``. ``raw`` is the call's verbatim text, from its open tag to
    the end of its close tag (or of the input when ``complete`` is false: the call
    was cut off before ``<|close|>call<|sep|>``).
    """

    name: str
    index: int
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    json_block: str | None = None
    complete: bool = True

    def arguments_json(self) -> str:
        """The arguments as an OpenAI ``function.arguments`` string (vLLM's form)."""
        if self.json_block is not None and not self.arguments:
            return self.json_block
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedMessage:
    """Generated assistant output split into its channels (§4.3).

    ``finished``: the message was closed (``<|close|>message<|sep|>`` or
    ``<|end_of_msg|>`` seen). ``truncated_tool_section``: a tools channel was opened
    and never closed; its calls are still reported (a cut-off one with
    ``complete=False``).
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    truncated_tool_section: bool = False
    finished: bool = False


@dataclass(frozen=True)
class Delta:
    """One streaming event: new ``reasoning`` or ``content`` text, or a ``tool_call``
    once its element is closed (or, on flush, cut off)."""

    kind: Literal["reasoning", "content", "tool_call"]
    text: str = ""
    tool_call: ToolCall | None = None
