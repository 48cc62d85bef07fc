"""XTML markup primitives: tags, end of message, attribute escaping, media blocks.

Format: docs/chat.md, its markup primitives. Every piece is its own
:class:`Segment` because segments are BPE'd separately; only the marker tokens and
media blocks are structural. Token strings come from :mod:`k3bundle.tokenizer_specials`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from k3bundle import tokenizer_specials as ts
from k3bundle.chat.errors import ChatError
from k3bundle.chat.types import Segment

OPEN = ts.OPEN
CLOSE = ts.CLOSE
SEP = ts.SEP
END_OF_MSG = ts.END_OF_MSG
MEDIA_PAD = ts.MEDIA_PAD
MEDIA_BEGIN = ts.MEDIA_BEGIN
MEDIA_CONTENT = ts.MEDIA_CONTENT
MEDIA_END = ts.MEDIA_END

#: The markers a parser splits generated output on (§4.3).
MARKERS: tuple[str, ...] = (OPEN, CLOSE, SEP, END_OF_MSG)


#: Stand-in for an image when no image prompts are supplied (release encoder). It is
#: not a special token: it is emitted in a structural segment but BPE-encodes as text.
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"


def escape_attr(value: Any) -> str:
    """§4.2 attribute escaping: ``&``→``&amp;`` first, then ``"``→``&quot;``."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def unescape_attr(value: str) -> str:
    """Inverse of :func:`escape_attr` (§4.3): ``&quot;`` first, then ``&amp;``."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def segment(text: Any, *, structural: bool = False) -> list[Segment]:
    """One segment, or none for empty text (the release drops empty pieces)."""
    s = str(text)
    return [Segment(s, structural=structural)] if s else []


def text(value: Any) -> list[Segment]:
    """A content segment (special tokens disallowed)."""
    return segment(value)


def open_tag(tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> list[Segment]:
    """§4.2: ``<|open|>`` + tag + per attribute `` key``, ``="``, escaped value, ``"``
    (four content segments) + ``<|sep|>``."""
    out = segment(OPEN, structural=True) + text(tag)
    for key, value in attrs:
        out += text(f" {key}") + text('="') + text(escape_attr(value)) + text('"')
    return out + segment(SEP, structural=True)


def close_tag(tag: str) -> list[Segment]:
    """§4.2: ``<|close|>`` + tag + ``<|sep|>``."""
    return segment(CLOSE, structural=True) + text(tag) + segment(SEP, structural=True)


def end_of_msg() -> list[Segment]:
    """§4.2: ``<|end_of_msg|>`` ends every message."""
    return segment(END_OF_MSG, structural=True)


def media_block(width: int, height: int, num_pads: int = 1) -> str:
    """An image prompt: ``<|media_begin|>image {W}x{H}<|media_content|>`` +
    ``<|media_pad|>`` × ``num_pads`` + ``<|media_end|>`` (§4.2; W×H are the image's
    original pixel size; engines expand the pad to the image's feature count)."""
    if num_pads < 1:
        raise ChatError(f"num_pads must be >= 1, got {num_pads}")
    head = f"{MEDIA_BEGIN}image {int(width)}x{int(height)}{MEDIA_CONTENT}"
    return head + MEDIA_PAD * num_pads + MEDIA_END
