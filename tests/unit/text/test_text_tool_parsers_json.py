"""hermes / llama3_json tool-call parsers: whole text against known calls, and every split of the text into
deltas (character by character, random chunks) folding to the whole-text result."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from deepinfer_jax.text import HermesToolParser, Llama3JsonToolParser, collect_tool_stream, get_tool_parser


def ids():
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def hermes(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


HERMES_CASES = [
    # (text, content, [(name, arguments)])
    ("Let me check.\n" + hermes("get_weather", {"city": "巴黎", "n": [1, {"k": None}]}) + "\n"
     + hermes("get_time", {}), "Let me check.\n\n",
     [("get_weather", '{"city": "巴黎", "n": [1, {"k": null}]}'), ("get_time", "{}")]),
    ("plain answer with < and <tool but no call", "plain answer with < and <tool but no call", []),
    # not JSON, no name: verbatim content; the next good call still parses
    ("<tool_call>oops</tool_call>" + hermes("ok", {"a": 1}), "<tool_call>oops</tool_call>", [("ok", '{"a": 1}')]),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    # cut off: complete JSON parses, a torn one is content
    ('<tool_call>\n{"name": "f", "arguments": {"x": 2}}', "", [("f", '{"x": 2}')]),
    ('Sure <tool_call>\n{"name": "f", "argu', 'Sure <tool_call>\n{"name": "f", "argu', []),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1]}}', "",
     [("a", "{}"), ("b", '{"x": [1]}')]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "f", "parameters": {"x": ', '{"name": "f", "parameters": {"x": ', []),
]


def _folds(cls, text):
    whole = cls(id_factory=ids()).extract(text)
    for split in ("chars", 1, 2, 3):
        p, deltas = cls(id_factory=ids()), []
        if split == "chars":
            pieces = list(text)
        else:
            rng, pieces, i = random.Random(split), [], 0
            while i < len(text):
                n = rng.randint(1, 9)
                pieces.append(text[i:i + n])
                i += n
        for piece in pieces:
            deltas += p.feed(piece)
        deltas += p.flush()
        assert collect_tool_stream(deltas) == whole, split
    return whole


@pytest.mark.parametrize("cls, text, content, calls", [(HermesToolParser, *c) for c in HERMES_CASES]
                         + [(Llama3JsonToolParser, *c) for c in LLAMA_CASES])
def test_whole_text_and_streams_agree(cls, text, content, calls):
    got_content, got_calls = _folds(cls, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in got_calls)


def test_content_streams_before_the_end():
    """Text before a hermes call (and llama3_json output that is not a call) streams as it comes."""
    p = HermesToolParser()
    assert collect_tool_stream(p.feed("Hello wor"))[0] == "Hello wor"
    assert collect_tool_stream(p.feed("ld <tool_"))[0] == "ld "  # "<tool_" held: it may become <tool_call>
    q = Llama3JsonToolParser()
    assert collect_tool_stream(q.feed("The answer"))[0] == "The answer"


def test_parsers_by_vllm_names():
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    p = HermesToolParser()
    p.feed(hermes("f", {}))
    p.flush()
    assert p.num_tool_calls == 1


def dsml(name, params):
    """One DSML invoke: params [(key, value, is_string)]."""
    body = "".join(f'<｜DSML｜parameter name="{k}" string="{"true" if s else "false"}">{v}</｜DSML｜parameter>\n'
                   for k, v, s in params)
    return f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'


B, E = "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"
DSML_CASES = [
    ("Let me look.\n\n" + B + "\n" + dsml("get_weather", [("location", "杭州", True), ("days", "3", False)])
     + dsml("search", [("q", 'a "quoted" <b>', True), ("opts", '{"k": [1, null]}', False)]) + E,
     "Let me look.\n\n", [("get_weather", '{"location": "杭州", "days": 3}'),
                          ("search", '{"q": "a \\"quoted\\" <b>", "opts": {"k": [1, null]}}')]),
    (B + dsml("now", []) + E + " done", " done", [("now", "{}")]),
    ("no calls, only <｜DSML｜ text", "no calls, only <｜DSML｜ text", []),
    # a string="false" value that is not JSON stays a string; a malformed invoke is content, the next one parses
    (B + dsml("f", [("x", "not json", False)]) + '<｜DSML｜invoke>bad</｜DSML｜invoke>' + dsml("g", []) + E,
     '<｜DSML｜invoke>bad</｜DSML｜invoke>', [("f", '{"x": "not json"}'), ("g", "{}")]),
    # cut off inside an invoke: the complete calls stand, the torn one is content
    (B + dsml("f", []) + '<｜DSML｜invoke name="g">\n<｜DSML｜param', '<｜DSML｜invoke name="g">\n<｜DSML｜param',
     [("f", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", DSML_CASES)
def test_deepseek_v4_dsml_whole_text_and_streams_agree(text, content, calls):
    cls = get_tool_parser("deepseek_v4")
    got_content, got_calls = _folds(cls, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
