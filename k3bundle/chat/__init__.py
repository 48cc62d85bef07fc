"""Kimi K3 chat format (XTML): render conversations, parse generated output.

The format and the API are described in ``docs/chat.md``.

Render::

    segs = render(messages, tools=None, thinking=True, thinking_effort="max",
                  tool_choice=None, response_format=None, add_generation_prompt=True,
                  images=None)                     # list[Segment]
    ids = render_ids(messages, encoding, ...)      # segment-wise tiktoken encoding
    text = render_text(messages, ...)

Parse what the model generated after the generation prompt::

    msg = parse(text_or_ids, thinking=True, encoding=None)   # ParsedMessage
    sp = StreamParser(thinking=True, encoding=None)
    for chunk in stream: deltas = sp.feed(chunk)
    msg = sp.finish()
"""

from k3bundle.chat.markup import escape_attr, media_block, unescape_attr
from k3bundle.chat.parse import StreamParser, decode_argument, parse
from k3bundle.chat.render import (
    THINKING_EFFORTS,
    compact_json,
    deep_sort,
    encode_segments,
    encode_segments_each,
    render,
    render_ids,
    render_text,
    reorder_tool_results,
)
from k3bundle.chat.errors import ChatError
from k3bundle.chat.types import Delta, ParsedMessage, Segment, ToolCall

__all__ = [
    "THINKING_EFFORTS",
    "ChatError",
    "Delta",
    "ParsedMessage",
    "Segment",
    "StreamParser",
    "ToolCall",
    "compact_json",
    "decode_argument",
    "deep_sort",
    "encode_segments",
    "encode_segments_each",
    "escape_attr",
    "media_block",
    "parse",
    "render",
    "render_ids",
    "render_text",
    "reorder_tool_results",
    "unescape_attr",
]
