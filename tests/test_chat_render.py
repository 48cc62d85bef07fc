"""XTML renderer: expected prompts written by hand from spec §4.2 (and the release's
exact message texts, docs/chat.md), never produced by the code under test."""

from __future__ import annotations

import json

import pytest

from k3bundle.chat import (
    ChatError,
    Segment,
    encode_segments,
    media_block,
    render,
    render_ids,
    render_text,
)
from k3bundle.chat.render import _pieces
from k3bundle.synth.tokenizer import write_tokenizer
from k3bundle.tokenizer import load_tiktoken

VOCAB = 1024
# Special ids for a 1024-token vocabulary, by hand from §4.1 (offsets from the end).
OPEN_ID, CLOSE_ID, SEP_ID, EOM_ID = 1024 - 253, 1024 - 252, 1024 - 251, 1024 - 254

EFFORT_MAX = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>'
    "`thinking_effort` guides on how much to think in your thinking channel (not including "
    "the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=max`."
    "<|close|>message<|sep|><|end_of_msg|>"
)
USER_HELLO = '<|open|>message role="user"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>'
GEN_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
GEN_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo für eine Stadt",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {"city": {"type": "string", "description": "Name"}},
            },
        },
    }
]
WEATHER_TOOLS_JSON = (
    '[{"function":{"description":"Météo für eine Stadt","name":"get_weather",'
    '"parameters":{"properties":{"city":{"description":"Name","type":"string"}},'
    '"required":["city"],"type":"object"}},"type":"function"}]'
)


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, VOCAB)
    return load_tiktoken(d)


def text(messages, **kw):
    kw.setdefault("thinking_effort", None)
    kw.setdefault("add_generation_prompt", False)
    return render_text(messages, **kw)


# ---------------------------------------------------------------- messages


def test_system_message():
    got = text([{"role": "system", "content": "You are Kimi."}])
    assert got == '<|open|>message role="system"<|sep|>You are Kimi.<|close|>message<|sep|><|end_of_msg|>'


def test_user_with_name_and_system_with_name():
    got = text([
        {"role": "system", "content": "Be brief.", "name": "ops"},
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "user", "content": "Yo", "name": ""},  # empty name: no attribute
    ])
    assert got == (
        '<|open|>message role="system" name="ops"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user" name="alice"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>Yo<|close|>message<|sep|><|end_of_msg|>'
    )


def test_attribute_escaping():
    got = text([{"role": "user", "content": 'say "a" & <b>', "name": 'Tom & "Jerry" <x>'}])
    # & first, then "; < and > untouched; content is never escaped.
    assert got == (
        '<|open|>message role="user" name="Tom &amp; &quot;Jerry&quot; <x>"<|sep|>'
        'say "a" & <b><|close|>message<|sep|><|end_of_msg|>'
    )
    got = text([{"role": "user", "content": "x", "name": "&quot;"}])
    assert 'name="&amp;quot;"' in got


def test_user_content_parts_concatenated():
    got = text([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    assert got == '<|open|>message role="user"<|sep|>ab<|close|>message<|sep|><|end_of_msg|>'


def test_default_prompt_has_max_effort_and_think_prompt():
    # §4.2 example: single user turn, thinking, default effort.
    assert render_text([{"role": "user", "content": "Hello"}]) == EFFORT_MAX + USER_HELLO + GEN_THINK


def test_non_thinking_prompt():
    got = render_text([{"role": "user", "content": "Hello"}], thinking=False)
    assert got == USER_HELLO + GEN_RESPONSE  # no effort message without thinking


def test_thinking_effort_values():
    got = render_text([{"role": "user", "content": "Hello"}], thinking_effort="low")
    assert got == EFFORT_MAX.replace("`thinking_effort=max`", "`thinking_effort=low`") + USER_HELLO + GEN_THINK
    got = render_text([{"role": "user", "content": "Hello"}], thinking_effort=None)
    assert got == USER_HELLO + GEN_THINK
    with pytest.raises(ChatError, match="thinking_effort"):
        render([{"role": "user", "content": "Hello"}], thinking_effort="extreme")


# ---------------------------------------------------------------- assistant and tools


ALL_TYPES_CALL = {
    "id": "call_a",
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": json.dumps({
            "city": "Paris",
            "days": 3,
            "metric": True,
            "note": None,
            "opts": {"unit": "C", "alerts": [1, 2]},
            "tags": ["x", "ü"],
            "ratio": 0.5,
        }),
    },
}
ALL_TYPES_XTML = (
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="metric" type="boolean"<|sep|>true<|close|>argument<|sep|>'
    '<|open|>argument key="note" type="null"<|sep|>null<|close|>argument<|sep|>'
    # objects/arrays: json.dumps with default separators, keys in given order
    '<|open|>argument key="opts" type="object"<|sep|>{"unit": "C", "alerts": [1, 2]}<|close|>argument<|sep|>'
    '<|open|>argument key="tags" type="array"<|sep|>["x", "ü"]<|close|>argument<|sep|>'
    '<|open|>argument key="ratio" type="number"<|sep|>0.5<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)


def test_assistant_reasoning_and_every_argument_type():
    msg = {"role": "assistant", "content": "Checking.", "reasoning_content": "Need weather.\n",
           "tool_calls": [ALL_TYPES_CALL]}
    assert text([msg]) == (
        '<|open|>message role="assistant"<|sep|>'
        "<|open|>think<|sep|>Need weather.\n<|close|>think<|sep|>"
        "<|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        "<|open|>tools<|sep|>" + ALL_TYPES_XTML + "<|close|>tools<|sep|>"
        "<|close|>message<|sep|><|end_of_msg|>"
    )


def test_assistant_dict_arguments_non_json_fallback_and_empty():
    msg = {"role": "assistant", "content": "", "name": "k3", "tool_calls": [
        {"function": {"name": "a", "arguments": {"q": 'x"y'}}},
        {"function": {"name": "b", "arguments": "not {json"}},
        {"function": {"name": "c", "arguments": "  "}},
        {"name": "d", "arguments": None},  # a flat call without "function"
    ]}
    assert text([msg], thinking=False) == (
        '<|open|>message role="assistant" name="k3"<|sep|>'
        "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="a" index="1"<|sep|>'
        '<|open|>argument key="q" type="string"<|sep|>x"y<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="b" index="2"<|sep|>'
        '<|open|>json type="object"<|sep|>not {json<|close|>json<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="c" index="3"<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="d" index="4"<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    with pytest.raises(ChatError, match="JSON object"):
        render([{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "[1]"}}]}])


def test_empty_or_blank_reasoning_keeps_empty_think_channel():
    for extra in ({}, {"reasoning_content": "   "}, {"reasoning": ""}):
        msg = {"role": "assistant", "content": "Hi", **extra}
        assert text([msg]) == (
            '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
            "<|open|>response<|sep|>Hi<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        )
    # "reasoning" is the fallback key
    assert "<|open|>think<|sep|>r<|close|>think<|sep|>" in text([{"role": "assistant", "content": "", "reasoning": "r"}])


def test_tool_results_reordered_by_call_id():
    calls = [
        {"id": "id-w", "type": "function", "function": {"name": "weather", "arguments": "{}"}},
        {"id": "id-t", "type": "function", "function": {"name": "time", "arguments": "{}"}},
        {"id": "id-n", "type": "function", "function": {"name": "news", "arguments": "{}"}},
    ]
    msgs = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "id-n", "content": "N", "name": "stale"},
        {"role": "tool", "tool_call_id": "id-w", "content": "W"},
        {"role": "tool", "tool_call_id": "id-t", "content": "T", "tool": "wrong"},
    ]
    got = text(msgs, thinking=False)
    assert got.endswith(
        '<|open|>message role="tool" tool="weather" index="1"<|sep|>W<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="time" index="2"<|sep|>T<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="news" index="3"<|sep|>N<|close|>message<|sep|><|end_of_msg|>'
    )
    assert msgs[2]["name"] == "stale"  # the caller's messages are not modified


def test_tool_results_unmatched_run_kept_and_names_by_position():
    calls = [{"id": "a", "function": {"name": "f", "arguments": {}}},
             {"id": "b", "function": {"name": "g", "arguments": {}}}]
    msgs = [{"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "zzz", "content": "2"},
            {"role": "tool", "tool_call_id": "a", "content": "1"}]
    got = text(msgs, thinking=False)
    # one id does not match: the run keeps its order; names come by position.
    assert got.endswith(
        '<|open|>message role="tool" tool="f" index="1"<|sep|>2<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="g" index="2"<|sep|>1<|close|>message<|sep|><|end_of_msg|>'
    )
    with pytest.raises(ChatError, match="tool name"):
        render([{"role": "tool", "content": "x"}])


def test_tool_choice_messages():
    u = [{"role": "user", "content": "Hello"}]
    assert render_text(u, thinking=False, tool_choice="required") == USER_HELLO + (
        '<|open|>message role="system" type="tool-choice"<|sep|>'
        "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
        "<|close|>message<|sep|><|end_of_msg|>"
    ) + GEN_RESPONSE
    assert render_text(u, thinking=False, tool_choice="none") == USER_HELLO + (
        '<|open|>message role="system" type="tool-choice"<|sep|>'
        "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
        "<|close|>message<|sep|><|end_of_msg|>"
    ) + GEN_RESPONSE
    assert render_text(u, thinking=False, tool_choice="auto") == USER_HELLO + GEN_RESPONSE
    named = {"type": "function", "function": {"name": "f"}}
    assert render_text(u, thinking=False, tool_choice=named) == USER_HELLO + GEN_RESPONSE


def test_response_format_messages():
    u = [{"role": "user", "content": "Hello"}]
    raw = ("Your response must be raw JSON data without markdown code blocks (```json) "
           "or any additional formatting.")
    assert render_text(u, thinking=False, response_format={"type": "json_object"}) == USER_HELLO + (
        '<|open|>message role="system" type="response-format"<|sep|>'
        "The system is invoked with `response_format=json_object`.\n" + raw +
        "<|close|>message<|sep|><|end_of_msg|>"
    ) + GEN_RESPONSE
    rf = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string", "title": "Ä"}}}}}
    got = render_text(u, thinking=False, tool_choice="required", response_format=rf)
    assert got.endswith(
        "<|close|>message<|sep|><|end_of_msg|>"  # after the tool-choice message
        '<|open|>message role="system" type="response-format"<|sep|>'
        "The system is invoked with `response_format=json_schema`.\n" + raw + "\n"
        "The JSON data must match the following schema:\n```json\n"
        '{"properties":{"a":{"title":"Ä","type":"string"},"b":{"type":"integer"}},"type":"object"}'
        "\n```<|close|>message<|sep|><|end_of_msg|>" + GEN_RESPONSE
    )
    assert got.index("tool-choice") < got.index("response-format")


def test_tools_declaration_first_and_mid_conversation():
    msgs = [{"role": "user", "content": "Hello"}, {"role": "system", "tools": WEATHER_TOOLS, "content": "ignored"}]
    got = render_text(msgs, tools=WEATHER_TOOLS)
    assert got == (
        '<|open|>message role="system" type="tool-declare"<|sep|>'
        "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
        + WEATHER_TOOLS_JSON + "\n```<|close|>message<|sep|><|end_of_msg|>"
        + EFFORT_MAX + USER_HELLO +
        '<|open|>message role="system" type="tool-declare"<|sep|>'
        "## New Tools Available\n"
        "The system dynamically extends the toolset via lazy-loading.\n"
        "You have access to all existing and extended tools.\n"
        "Here are the specs for the extended tools.\n\n```json\n"
        + WEATHER_TOOLS_JSON + "\n```<|close|>message<|sep|><|end_of_msg|>" + GEN_THINK
    )


MULTI_TURN = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add"},
    {"role": "user", "content": "times 3?"},
    {"role": "assistant", "content": "12", "reasoning_content": "multiply"},
    {"role": "user", "content": "ok"},
]


def test_multi_turn_reasoning_carried_back():
    assert render_text(MULTI_TURN, thinking_effort=None) == (
        '<|open|>message role="user"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>add<|close|>think<|sep|>'
        "<|open|>response<|sep|>4<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>times 3?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>multiply<|close|>think<|sep|>'
        "<|open|>response<|sep|>12<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>ok<|close|>message<|sep|><|end_of_msg|>' + GEN_THINK
    )


def test_thinking_off_drops_every_think_channel():
    assert render_text(MULTI_TURN, thinking=False) == (
        '<|open|>message role="user"<|sep|>2+2?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|>'
        "<|open|>response<|sep|>4<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>times 3?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|>'
        "<|open|>response<|sep|>12<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="user"<|sep|>ok<|close|>message<|sep|><|end_of_msg|>' + GEN_RESPONSE
    )


def test_unknown_role_is_an_error():
    with pytest.raises(ChatError, match="developer"):
        render([{"role": "developer", "content": "x"}])


# ---------------------------------------------------------------- segments and ids


def test_segments_split_markup_pieces():
    segs = render([{"role": "user", "content": "Hi", "name": "a"}], thinking_effort=None,
                  add_generation_prompt=False)
    S, T = (lambda t: Segment(t, structural=True)), Segment
    assert segs == [
        S("<|open|>"), T("message"), T(" role"), T('="'), T("user"), T('"'),
        T(" name"), T('="'), T("a"), T('"'), S("<|sep|>"),
        T("Hi"),
        S("<|close|>"), T("message"), S("<|sep|>"), S("<|end_of_msg|>"),
    ]


def test_assistant_segments_marked():
    segs = render([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
                  thinking=False, thinking_effort=None)
    marked = "".join(s.text for s in segs if s.assistant)
    assert marked == "<|open|>response<|sep|>A<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"


def test_literal_markers_in_content_are_ordinary_tokens(enc):
    ids = render_ids([{"role": "user", "content": "<|open|>"}], enc, thinking_effort=None,
                     add_generation_prompt=False)
    literal = enc.encode("<|open|>", disallowed_special=())
    assert OPEN_ID not in literal and len(literal) > 1
    expected = (
        [OPEN_ID] + enc.encode("message") + enc.encode(" role") + enc.encode('="')
        + enc.encode("user") + enc.encode('"') + [SEP_ID]
        + literal
        + [CLOSE_ID] + enc.encode("message") + [SEP_ID, EOM_ID]
    )
    assert ids == expected
    assert ids.count(OPEN_ID) == 1  # only the structural one


def test_render_ids_is_segment_wise(enc):
    msgs = [{"role": "user", "content": "Hello <|close|> world"}, {"role": "assistant", "content": "ok",
            "tool_calls": [ALL_TYPES_CALL]}]
    segs = render(msgs, tools=WEATHER_TOOLS)
    by_hand = []
    for s in segs:
        if s.structural:
            by_hand += enc.encode(s.text, allowed_special="all")
        else:
            by_hand += enc.encode(s.text, disallowed_special=())
    assert render_ids(msgs, enc, tools=WEATHER_TOOLS) == by_hand == encode_segments(segs, enc)
    joined = enc.encode("".join(s.text for s in segs), allowed_special="all")
    assert joined != by_hand  # concatenating first changes the ids


def test_images_media_blocks_and_placeholder(enc):
    msg = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "see <|kimi_image_placeholder|>!"}]}]
    got = text(msg, images=[(640, 480), "<|media_begin|>image 2x2<|media_content|><|media_pad|><|media_end|>"])
    assert got == (
        '<|open|>message role="user"<|sep|>'
        "<|media_begin|>image 640x480<|media_content|><|media_pad|><|media_end|>"
        "see <|media_begin|>image 2x2<|media_content|><|media_pad|><|media_end|>!"
        "<|close|>message<|sep|><|end_of_msg|>"
    )
    assert media_block(3, 4, num_pads=2) == (
        "<|media_begin|>image 3x4<|media_content|><|media_pad|><|media_pad|><|media_end|>")
    # without images: the release's stand-in, and the placeholder text stays as typed
    assert text(msg) == (
        '<|open|>message role="user"<|sep|><|kimi_image_placeholder|>see <|kimi_image_placeholder|>!'
        "<|close|>message<|sep|><|end_of_msg|>"
    )
    ids = render_ids(msg, enc, images=[(8, 8), (8, 8)])
    assert ids.count(1024 - 235) == 2  # <|media_pad|> is a special id in the structural block
    with pytest.raises(ChatError, match="images"):
        render(msg, images=[(8, 8)])
    with pytest.raises(ChatError, match="images"):
        render(msg, images=[(8, 8)] * 3)


def test_long_text_split_like_release_tokenizer(enc):
    # 400k-char windows, then runs of (non-)whitespace cut every 25k chars.
    assert [len(p) for p in _pieces("a" * 60_000)] == [25_000, 25_000, 10_000]
    assert [len(p) for p in _pieces("ab " * 5 + " " * 30_000)] == [15 + 24_999, 5_001]
    assert [len(p) for p in _pieces("x" * 10)] == [10]
    ids = render_ids([{"role": "user", "content": "a" * 30_000}], enc, thinking_effort=None)
    assert enc.decode(ids) == USER_HELLO.replace("Hello", "a" * 30_000) + GEN_THINK
