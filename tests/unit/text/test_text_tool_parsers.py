"""deepseek_v3 / deepseek_v31 tool-call parsers: whole text vs token-by-token, coarse,
character-by-character and single-delta streams."""

from __future__ import annotations

import random
import re

import pytest

from deepinfer_jax.text import (ContentDelta, DeepSeekV31ToolParser, DeepSeekV3ToolParser,
                                ToolCall, ToolCallDelta, collect_tool_stream, deltas_to_openai,
                                get_tool_parser)
from text_helpers import token_deltas

KEEP = DeepSeekV3ToolParser.special_tokens
CB, CE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
B, E, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
EOS = "<｜end▁of▁sentence｜>"


def v3_call(name, args, kind="function"):
    return f"{B}{kind}{SEP}{name}\n```json\n{args}\n```{E}"


V3_CASES = [
    # (text, expected content, expected [(name, arguments)])
    ("Let me check.\n\n" + CB + v3_call("get_weather", '{"city": "Paris", "unit": "celsius"}') + "\n"
     + v3_call("get_time", '{"tz": "Europe/Paris"}') + CE,
     "Let me check.\n\n",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"tz": "Europe/Paris"}')]),
    (CB + v3_call("lookup", '{"q": "巴黎天气 😀", "n": [1, 2, {"k": null}]}') + CE,
     "", [("lookup", '{"q": "巴黎天气 😀", "n": [1, 2, {"k": null}]}')]),
    # multi-line JSON, a fence inside a string, text after the block
    (CB + v3_call("run", '{\n  "code": "```py\\nprint(1)\\n```"\n}') + CE + " Done.",
     " Done.", [("run", '{\n  "code": "```py\\nprint(1)\\n```"\n}')]),
    # no outer begin marker; missing call end (closed by the block end); "```" without json
    (B + "function" + SEP + "f\n```\n{}\n```" + CE + "after", "after", [("f", "{}")]),
    # cut off in the middle of the arguments (max_tokens): reported as far as it got
    ("Sure. " + CB + B + "function" + SEP + "search\n```json\n{\"query\": \"long",
     "Sure. ", [("search", '{"query": "long')]),
    # malformed: no separator, and an invalid name -> kept verbatim as content
    ("A" + CB + B + "oops no separator" + E + CE + "B",
     "A" + B + "oops no separator" + E + "B", []),
    (CB + B + "function" + SEP + "bad name\n```json\n{}\n```" + E + "\n" + v3_call("ok", "{}") + CE,
     B + "function" + SEP + "bad name\n```json\n{}\n```" + E, [("ok", "{}")]),
    # garbage inside the block is content; lookalike text is untouched
    ("x < y and <｜tool but no call", "x < y and <｜tool but no call", []),
    (CB + "hmm" + CE, "hmm" + CE, []),
    # empty arguments and a call with no argument line at all
    (CB + v3_call("noop", "") + "\n" + B + "function" + SEP + "bare" + E + CE,
     "", [("noop", ""), ("bare", "")]),
]


def v31_call(name, args):
    return f"{B}{name}{SEP}{args}{E}"


V31_CASES = [
    ("I'll call two tools." + CB + v31_call("get_weather", '{"city": "北京"}')
     + v31_call("get_time", '{"tz": "Asia/Shanghai"}') + CE,
     "I'll call two tools.",
     [("get_weather", '{"city": "北京"}'), ("get_time", '{"tz": "Asia/Shanghai"}')]),
    (CB + v31_call("calc", '{"expr": "1 < 2 && 3 > 2", "emoji": "🎉"}') + CE + " ok",
     " ok", [("calc", '{"expr": "1 < 2 && 3 > 2", "emoji": "🎉"}')]),
    (CB + v31_call("spaced", ' {"a": 1}\n') + CE, "", [("spaced", ' {"a": 1}\n')]),
    (CB + B + "no separator here" + E + CE, B + "no separator here" + E, []),
    (CB + B + "f" + SEP + '{"x": "cut', "", [("f", '{"x": "cut')]),
    (CB + B + "bad name" + SEP + "{}" + E + v31_call("good", "{}") + CE,
     B + "bad name" + SEP + "{}" + E, [("good", "{}")]),
]


def counter_ids():
    n = iter(range(10**6))
    return lambda: f"call_{next(n)}"


def check_stream_shape(deltas):
    """First delta per index carries id/type/name (args ""), later ones only arguments."""
    seen = set()
    for d in deltas:
        if isinstance(d, ContentDelta):
            assert d.content
            continue
        if d.index not in seen:
            assert d.index == len(seen)
            assert (d.type, d.arguments) == ("function", "") and d.id and d.name
            seen.add(d.index)
        else:
            assert d.id is None and d.name is None and d.type is None and d.arguments


def run_stream(parser_cls, deltas):
    p = parser_cls(id_factory=counter_ids())
    out = []
    for d in deltas:
        out += p.feed(d)
    out += p.flush()
    check_stream_shape(out)
    return out, p


def summary(content, calls):
    return content, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("parser_cls,cases", [(DeepSeekV3ToolParser, V3_CASES),
                                              (DeepSeekV31ToolParser, V31_CASES)])
def test_whole_text_and_every_kind_of_stream(tok_v3, parser_cls, cases):
    for text, content, calls in cases:
        whole = parser_cls(id_factory=counter_ids()).extract(text)
        assert summary(*whole) == (content, calls), text
        assert [c.id for c in whole[1]] == [f"call_{i}" for i in range(len(calls))]
        rng = random.Random(len(text))
        streams = {"token": token_deltas(tok_v3, text, keep=KEEP),
                   "char": list(text), "one": [text]}
        for k in range(6):
            streams[f"coarse{k}"] = token_deltas(tok_v3, text, rng, keep=KEEP)
        for kind, deltas in streams.items():
            out, p = run_stream(parser_cls, deltas)
            assert collect_tool_stream(out) == whole, (kind, text)
            assert p.num_tool_calls == len(calls)


def test_arguments_stream_incrementally_and_content_comes_first(tok_v3):
    text = V3_CASES[0][0]
    out, _ = run_stream(DeepSeekV3ToolParser, token_deltas(tok_v3, text, keep=KEEP))
    kinds = ["c" if isinstance(d, ContentDelta) else d.index for d in out]
    assert kinds[0] == "c" and "c" not in kinds[kinds.index(0):]
    assert sum(1 for d in out if isinstance(d, ToolCallDelta) and d.index == 0 and d.name is None) > 3
    # the name is sent as soon as it is complete, long before the call ends
    p = DeepSeekV3ToolParser(id_factory=counter_ids())
    assert p.feed(CB + B + "function" + SEP + "get_weather\n```json\n{\"ci") == [
        ToolCallDelta(0, id="call_0", type="function", name="get_weather", arguments=""),
        ToolCallDelta(0, arguments='{"ci')]
    assert p.feed('ty": "Paris"}\n`') == [ToolCallDelta(0, arguments='ty": "Paris"}')]
    assert p.feed("``" + E + CE) == []
    assert p.flush() == []


def test_markers_split_across_deltas_are_never_content():
    p = DeepSeekV31ToolParser(id_factory=counter_ids())
    assert p.feed("Hi <｜tool▁ca") == [ContentDelta("Hi ")]
    assert p.feed("lls▁begin｜><｜tool▁call▁begin｜>f<｜tool") == []
    assert p.feed("▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>") == [
        ToolCallDelta(0, id="call_0", type="function", name="f", arguments=""),
        ToolCallDelta(0, arguments="{}")]


def test_begin_and_end_in_one_delta_with_several_calls():
    text = CB + v3_call("a", "{}") + "\n" + v3_call("b", '{"x": 1}') + CE
    p = DeepSeekV3ToolParser(id_factory=counter_ids())
    out = p.feed(text) + p.flush()
    assert out == [ToolCallDelta(0, id="call_0", type="function", name="a", arguments=""),
                   ToolCallDelta(0, arguments="{}"),
                   ToolCallDelta(1, id="call_1", type="function", name="b", arguments=""),
                   ToolCallDelta(1, arguments='{"x": 1}')]
    assert deltas_to_openai(out)["tool_calls"][0] == {
        "index": 0, "id": "call_0", "type": "function", "function": {"name": "a", "arguments": ""}}


def test_openai_shapes_and_default_ids():
    content, calls = DeepSeekV31ToolParser().extract("pre" + CB + v31_call("f", "{}") + CE)
    assert content == "pre" and re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "f", "arguments": "{}"}}
    assert deltas_to_openai([ContentDelta("a"), ContentDelta("b")]) == {"content": "ab"}
    assert deltas_to_openai([]) == {}
    assert ToolCallDelta(2, arguments="x").to_openai() == {"index": 2, "function": {"arguments": "x"}}
    assert isinstance(calls[0], ToolCall)


def test_runaway_call_head_becomes_content():
    text = CB + B + "x" * 300 + " still no separator"
    p = DeepSeekV3ToolParser()
    content, calls = p.extract(text)
    assert calls == [] and content == B + "x" * 300 + " still no separator"


def test_registry():
    assert get_tool_parser("deepseek_v3") is DeepSeekV3ToolParser
    assert get_tool_parser("deepseek_v31") is DeepSeekV31ToolParser
    with pytest.raises(ValueError, match="valid: deepseek_v3, deepseek_v31, deepseek_v4, hermes, llama3_json"):
        get_tool_parser("pythonic")


FRAGMENTS = [CB, CE, B, E, SEP, "function", "get_weather", "\n", "```json\n", "\n```", "```",
             '{"city": "Paris"}', "{", "}", " ", "text", "你好", "😀", "<", "<｜tool", "▁", "｜>",
             "bad name", "x" * 40]


@pytest.mark.parametrize("parser_cls", [DeepSeekV3ToolParser, DeepSeekV31ToolParser])
def test_random_fragment_soup_never_crashes_and_streams_consistently(parser_cls):
    rng = random.Random(2024)
    for _ in range(1500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 14)))
        whole = parser_cls(id_factory=counter_ids()).extract(text)
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8)))) \
            if len(text) > 1 else []
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        out, _ = run_stream(parser_cls, deltas)
        assert collect_tool_stream(out) == whole, (text, deltas)
        content, calls = whole
        # nothing is lost or invented: content and call parts all come from the text
        assert len(content) + sum(len(c.name) + len(c.arguments) for c in calls) <= len(text)
