"""XTML parser (spec §4.3): one-shot and streaming, from text and from token ids."""

from __future__ import annotations

import json

import pytest

from k3bundle.chat import (
    ChatError,
    ParsedMessage,
    StreamParser,
    ToolCall,
    parse,
    render_ids,
    render_text,
)
from k3bundle.synth.tokenizer import write_tokenizer
from k3bundle.tokenizer import load_tiktoken

# Generated output after the thinking generation prompt, written by hand (§4.3).
GENERATED = (
    "The user wants weather.\n<|close|>think<|sep|>"
    "<|open|>response<|sep|>Let me check.<|close|>response<|sep|>"
    "<|open|>tools<|sep|>"
    '<|open|>call tool="get&amp;&quot;weather&quot;" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris "Centre"<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
    '<|open|>argument key="ratio" type="number"<|sep|>0.25<|close|>argument<|sep|>'
    '<|open|>argument key="metric" type="boolean"<|sep|>false<|close|>argument<|sep|>'
    '<|open|>argument key="note" type="null"<|sep|>null<|close|>argument<|sep|>'
    '<|open|>argument key="opts" type="object"<|sep|>{"a": {"b": [1, 2]}}<|close|>argument<|sep|>'
    '<|open|>argument key="tags" type="array"<|sep|>["x", 1, null]<|close|>argument<|sep|>'
    '<|open|>argument key="num_as_text" type="string"<|sep|>42<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
    '<|open|>call tool="shell" index="2"<|sep|>'
    '<|open|>json type="object"<|sep|>ls -la {<|close|>json<|sep|>'
    "<|close|>call<|sep|>"
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)
CALL_1_RAW = GENERATED[GENERATED.index("<|open|>call"):GENERATED.index('<|open|>call tool="shell"')]
CALL_2_RAW = GENERATED[GENERATED.index('<|open|>call tool="shell"'):GENERATED.index("<|close|>tools")]
EXPECTED = ParsedMessage(
    reasoning="The user wants weather.\n",
    content="Let me check.",
    tool_calls=[
        ToolCall(
            name='get&"weather"',
            index=1,
            arguments={"city": 'Paris "Centre"', "days": 3, "ratio": 0.25, "metric": False,
                       "note": None, "opts": {"a": {"b": [1, 2]}}, "tags": ["x", 1, None],
                       "num_as_text": "42"},
            raw=CALL_1_RAW,
        ),
        ToolCall(name="shell", index=2, arguments={}, raw=CALL_2_RAW, json_block="ls -la {"),
    ],
    truncated_tool_section=False,
    finished=True,
)


@pytest.fixture(scope="module")
def enc(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, 1024)
    return load_tiktoken(d)


def stream(chunks_of, data, size, **kw):
    """Feed ``data`` in chunks of ``size``; return (final message, all deltas)."""
    p = StreamParser(**kw)
    deltas = []
    for i in range(0, len(data), size):
        deltas += p.feed(chunks_of(data[i:i + size]))
    deltas += p.flush()
    return p.finish(), deltas


def check_deltas(msg, deltas):
    assert "".join(d.text for d in deltas if d.kind == "reasoning") == msg.reasoning
    assert "".join(d.text for d in deltas if d.kind == "content") == msg.content
    assert [d.tool_call for d in deltas if d.kind == "tool_call"] == msg.tool_calls


def test_parse_hand_written_output():
    msg = parse(GENERATED)
    assert msg == EXPECTED
    assert msg.tool_calls[0].raw.startswith('<|open|>call tool="get&amp;')
    assert msg.tool_calls[0].raw.endswith("<|close|>call<|sep|>")
    assert json.loads(msg.tool_calls[0].arguments_json())["days"] == 3
    assert msg.tool_calls[1].arguments_json() == "ls -la {"


def test_parse_non_thinking_and_plain_answer():
    msg = parse("Hi there.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>", thinking=False)
    assert msg == ParsedMessage(content="Hi there.", finished=True)
    # a leading repeat of the generation prompt's opening tag is skipped
    msg = parse("<|open|>think<|sep|>hmm<|close|>think<|sep|><|open|>response<|sep|>ok<|close|>response<|sep|>")
    assert (msg.reasoning, msg.content, msg.finished) == ("hmm", "ok", False)
    # end of message alone also finishes
    assert parse("x<|close|>response<|sep|><|end_of_msg|>", thinking=False).finished


def test_bad_json_value_falls_back_to_text():
    out = ('<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>'
           '<|open|>call tool="f" index="1"<|sep|>'
           '<|open|>argument key="n" type="number"<|sep|>3 apples<|close|>argument<|sep|>'
           '<|open|>json type="object"<|sep|>{"k": 1}<|close|>json<|sep|>'
           "<|close|>call<|sep|><|close|>tools<|sep|>")
    (call,) = parse(out).tool_calls
    assert call.arguments == {"n": "3 apples", "k": 1}
    assert call.json_block == '{"k": 1}'


def test_truncated_reasoning():
    msg = parse("still thinking about <|clo")
    assert msg == ParsedMessage(reasoning="still thinking about <|clo", finished=False)


def test_truncated_tool_section_is_reported():
    cut = GENERATED.index('<|open|>argument key="days"') + len('<|open|>argument key="days" type="number"<|sep|>3')
    text = GENERATED[:cut]
    msg = parse(text)
    assert msg.truncated_tool_section and not msg.finished
    assert msg.reasoning == "The user wants weather.\n" and msg.content == "Let me check."
    (call,) = msg.tool_calls
    assert (call.name, call.index, call.complete) == ('get&"weather"', 1, False)
    assert call.arguments == {"city": 'Paris "Centre"'}  # the cut argument is not decoded
    assert call.raw == text[text.index("<|open|>call"):]
    # cut after a complete call: it is complete, the section is still truncated
    text = GENERATED[:GENERATED.index('<|open|>call tool="shell"')]
    msg = parse(text)
    assert msg.truncated_tool_section and msg.tool_calls == EXPECTED.tool_calls[:1]
    # a cut right after the tools opening tag: no calls, but reported
    msg = parse(GENERATED[:GENERATED.index("<|open|>tools<|sep|>") + len("<|open|>tools<|sep|>")])
    assert msg.truncated_tool_section and msg.tool_calls == []


@pytest.mark.parametrize("size", [1, 7, 23])
def test_streaming_text_matches_one_shot(size):
    msg, deltas = stream(str, GENERATED, size)
    assert msg == EXPECTED
    check_deltas(msg, deltas)
    cut = GENERATED[:GENERATED.index("<|close|>call") + 4]  # ends inside a marker
    msg, deltas = stream(str, cut, size)
    assert msg == parse(cut) and msg.truncated_tool_section
    check_deltas(msg, deltas)


@pytest.mark.parametrize("size", [1, 7, 23])
def test_streaming_ids_matches_one_shot(enc, size):
    ids = enc.encode(GENERATED, allowed_special="all")
    assert parse(ids, encoding=enc) == EXPECTED
    msg, deltas = stream(list, ids, size, encoding=enc)
    assert msg == EXPECTED
    check_deltas(msg, deltas)


def test_marker_split_across_chunks():
    p = StreamParser()
    assert [d.text for d in p.feed("abc<|cl")] == ["abc"]
    assert p.feed("ose|>think<|s") == []
    assert [d.text for d in p.feed("ep|><|open|>response<|sep|>x <")] == ["x "]
    assert [d.text for d in p.feed("b>")] == ["<b>"]
    msg = p.finish()
    assert (msg.reasoning, msg.content) == ("abc", "x <b>")


def test_ids_keep_literal_markers_in_content(enc):
    # In content a literal "<|close|>response<|sep|>" is ordinary BPE (§4.1): from ids
    # the parser sees no marker there; from text it cannot tell (docs/chat.md).
    gen = ["ok ", "<|close|>response<|sep|>", " done"]
    ids = (enc.encode("r") + [enc.encode_single_token("<|close|>")] + enc.encode("think")
           + [enc.encode_single_token("<|sep|>"), enc.encode_single_token("<|open|>")]
           + enc.encode("response") + [enc.encode_single_token("<|sep|>")]
           + enc.encode("".join(gen), disallowed_special=())
           + [enc.encode_single_token("<|close|>")] + enc.encode("response")
           + [enc.encode_single_token("<|sep|>")])
    assert parse(ids, encoding=enc).content == "ok <|close|>response<|sep|> done"
    assert parse(enc.decode(ids)).content != "ok <|close|>response<|sep|> done"


def test_response_cut_by_tools_or_message_close():
    out = 'a<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    msg = parse(out, thinking=False)
    assert msg.content == "a" and [c.name for c in msg.tool_calls] == ["f"] and not msg.truncated_tool_section
    assert parse("b<|close|>message<|sep|>", thinking=False) == ParsedMessage(content="b", finished=True)


def test_parser_errors(enc):
    with pytest.raises(ChatError, match="encoding"):
        parse([1, 2, 3])
    p = StreamParser(encoding=enc)
    p.feed("text")
    with pytest.raises(ChatError, match="not both"):
        p.feed([1, 2])


# ---------------------------------------------------------------- render -> parse


ROUND_TRIP_TURNS = [
    {"role": "assistant", "content": "Plain answer.", "reasoning_content": "Easy.\n"},
    {"role": "assistant", "content": "", "reasoning_content": "",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps(
         {"q": 'a "quoted" & <tagged> query', "n": 5, "x": -1.5e-3, "ok": True, "none": None,
          "obj": {"z": [1, {"y": "ü"}]}, "arr": [], "empty": ""})}},
                    {"id": "c2", "type": "function", "function": {"name": "raw&\"fn", "arguments": "oops {"}},
                    {"id": "c3", "type": "function", "function": {"name": "noargs", "arguments": "{}"}}]},
    {"role": "assistant", "content": "Multi\nline\n\n", "reasoning_content": "Step 1\nStep 2",
     "tool_calls": [{"function": {"name": "f", "arguments": {"k&\"ey": "v"}}}]},
]


def expected_calls(turn):
    out = []
    for i, call in enumerate(turn.get("tool_calls") or [], start=1):
        args = call["function"]["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        out.append((call["function"]["name"], i, args))
    return out


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("turn", range(len(ROUND_TRIP_TURNS)))
def test_round_trip_render_then_parse(enc, thinking, turn):
    prompt = [{"role": "user", "content": "Question?"}]
    msg = ROUND_TRIP_TURNS[turn]
    before = render_text(prompt, thinking=thinking)
    after = render_text(prompt + [msg], thinking=thinking, add_generation_prompt=False)
    assert after.startswith(before)
    generated = after[len(before):]
    ids_before = render_ids(prompt, enc, thinking=thinking)
    ids_after = render_ids(prompt + [msg], enc, thinking=thinking, add_generation_prompt=False)
    assert ids_after[:len(ids_before)] == ids_before
    gen_ids = ids_after[len(ids_before):]

    results = [parse(generated, thinking=thinking), parse(gen_ids, thinking=thinking, encoding=enc)]
    for size in (1, 7, 23):
        results.append(stream(str, generated, size, thinking=thinking)[0])
        results.append(stream(list, gen_ids, size, thinking=thinking, encoding=enc)[0])
    for got in results:
        assert got == results[0]
    got = results[0]
    assert got.finished and not got.truncated_tool_section
    assert got.reasoning == (msg["reasoning_content"] if thinking else "")
    assert got.content == msg["content"]
    assert [(c.name, c.index, c.arguments) for c in got.tool_calls] == expected_calls(msg)
    assert "".join(c.raw for c in got.tool_calls) in generated
