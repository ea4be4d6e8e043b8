"""/v1/chat/completions through the official openai client: plain, streaming, n, stop, logprobs,
usage, the reasoning split and tool calls (the scripted checkpoint emits a known sequence)."""

from __future__ import annotations

import json

import openai
import pytest

from e2e_helpers import MODEL, wait_idle
from scripted import ARGS, CONTENT, REASONING, TOOL_NAME, TOOLS

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
# A forced call's arguments follow the tool's schema (a grammar); with "Paris" its only city, the scripted
# arguments are the only valid ones.
FORCED_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"],
    "additionalProperties": False}}}]


def _collect(stream):
    """Fold a chat stream into per-choice dicts; also returns the chunks."""
    chunks = list(stream)
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            d = out.setdefault(c.index, {"role": None, "content": "", "reasoning": "", "tools": {}, "finish": None,
                                         "logprobs": []})
            delta = c.delta
            d["role"] = d["role"] or delta.role
            d["content"] += delta.content or ""
            extra = delta.model_extra or {}
            assert extra.get("reasoning_content") == extra.get("reasoning")
            d["reasoning"] += extra.get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                t = d["tools"].setdefault(tc.index, {"id": None, "name": None, "args": ""})
                t["id"] = t["id"] or tc.id
                if tc.function and tc.function.name:
                    t["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    t["args"] += tc.function.arguments
            if c.logprobs and c.logprobs.content:
                d["logprobs"] += c.logprobs.content
            if c.finish_reason:
                d["finish"] = c.finish_reason
    return out, chunks


def test_reasoning_content_and_tool_call(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=40)
    c = r.choices[0]
    extra = c.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == REASONING
    assert c.message.content == CONTENT
    assert c.finish_reason == "tool_calls"
    [call] = c.message.tool_calls
    assert call.type == "function" and call.function.name == TOOL_NAME and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == json.loads(ARGS)
    assert r.usage.completion_tokens == 15 and r.usage.total_tokens == r.usage.prompt_tokens + 15


def test_without_auto_tool_choice(server, client):
    """As vLLM without --enable-auto-tool-choice: tools are only shown to the model (their call comes back as
    text, not parsed), an explicit tool_choice "auto" is a 400, "required" still works with the parser."""
    cfg = server.server.serving.config
    cfg.enable_auto_tool_choice = False
    try:
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=40)
        c = r.choices[0]
        assert c.finish_reason == "stop" and not c.message.tool_calls and TOOL_NAME in c.message.content
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=4)
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required",
                                           max_tokens=40)
        assert r.choices[0].message.tool_calls[0].function.name == TOOL_NAME
    finally:
        cfg.enable_auto_tool_choice = True


def test_reasoning_and_tool_call_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=40, stream=True,
                                            stream_options={"include_usage": True})
    out, chunks = _collect(stream)
    d = out[0]
    assert d["role"] == "assistant" and d["reasoning"] == REASONING and d["content"] == CONTENT
    assert d["finish"] == "tool_calls"
    [t] = d["tools"].values()
    assert t["name"] == TOOL_NAME and t["id"].startswith("call_") and json.loads(t["args"]) == json.loads(ARGS)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    assert all(ch.usage is None for ch in chunks[:-1])


def test_reasoning_split_without_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4)
    c = r.choices[0]
    assert c.message.model_extra["reasoning_content"] == REASONING
    assert c.message.content == CONTENT and not c.message.tool_calls
    assert c.finish_reason == "length"


def test_tool_choice_named_and_required_and_none(client):
    named = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=FORCED_TOOLS, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": TOOL_NAME}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == TOOL_NAME and json.loads(call.function.arguments) == json.loads(ARGS)
    assert named.choices[0].finish_reason == "tool_calls"
    required = client.chat.completions.create(model=MODEL, messages=MSG, tools=FORCED_TOOLS, max_tokens=40,
                                              tool_choice="required")
    assert required.choices[0].message.tool_calls[0].function.name == TOOL_NAME
    assert required.choices[0].finish_reason == "tool_calls"
    none = client.chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=40, tool_choice="none")
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason == "stop"


def test_streamed_named_tool_call(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=FORCED_TOOLS, max_tokens=40, stream=True,
        tool_choice={"type": "function", "function": {"name": TOOL_NAME}})
    out, _ = _collect(stream)
    [t] = out[0]["tools"].values()
    assert t["name"] == TOOL_NAME and json.loads(t["args"]) == json.loads(ARGS)


def test_n2_stop_and_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, n=2, temperature=1.0, max_tokens=40,
                                       stop=["look"])
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "stop"
        assert c.message.content == "I will "  # stop strings act on the raw text, reasoning included
        assert c.message.model_extra["reasoning_content"] == REASONING
        assert c.model_extra["stop_reason"] == "look"
    assert r.usage.completion_tokens == 8  # 4 tokens per choice
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    assert r.model == MODEL and r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_n2_streamed(client):
    out, _ = _collect(client.chat.completions.create(model=MODEL, messages=MSG, n=2, max_tokens=3, stream=True))
    assert sorted(out) == [0, 1]
    for d in out.values():
        assert d["reasoning"] == REASONING and d["finish"] == "length"


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert [e.token for e in lp] == ["<think>", REASONING, "</think>", CONTENT]
    for e in lp:
        assert e.logprob == pytest.approx(0.0, abs=1e-3)
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.bytes == list(e.token.encode())
    out, _ = _collect(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4, logprobs=True,
                                                     stream=True))
    assert [e.token for e in out[0]["logprobs"]] == ["<think>", REASONING, "</think>", CONTENT]


def test_prompt_logprobs(client):
    """vLLM's prompt_logprobs on chat: one entry per prompt token of the rendered conversation, None first."""
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=1, extra_body={"prompt_logprobs": 0})
    plp = r.model_extra["prompt_logprobs"]
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in plp[1:])


def test_prefix_cache_reports_cached_tokens(client, server):
    wait_idle(server)
    long_msg = [{"role": "user", "content": "Tell me about the weather in Paris and in London today. " * 3}]
    first = client.chat.completions.create(model=MODEL, messages=long_msg, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=long_msg, max_tokens=2)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 16
    assert second.usage.prompt_tokens_details.cached_tokens >= 8  # at least one full page of 8


def test_request_id_header_and_other_served_name(client, server):
    raw = client.chat.completions.with_raw_response.create(model="other-name", messages=MSG, max_tokens=1,
                                                           extra_headers={"X-Request-Id": "my-req-42"})
    assert raw.headers["x-request-id"] == "my-req-42"
    assert raw.parse().model == MODEL
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG, max_tokens=1)
    assert len(raw.headers["x-request-id"]) >= 16


def test_sampling_knobs_accepted(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, max_completion_tokens=4, temperature=0.7, top_p=0.9, seed=-5,
        presence_penalty=0.5, frequency_penalty=0.5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                    "stop_token_ids": [1], "include_reasoning": False})
    c = r.choices[0]
    assert r.usage.completion_tokens == 4 and c.message.model_extra["reasoning_content"] is None
    assert c.message.content == CONTENT


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    """tool_choice "auto": with ignore_eos the script runs twice, so the model calls the tool twice; with
    parallel_tool_calls false only the first call comes back (as vLLM), streamed or not."""
    kw = dict(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=31, extra_body={"ignore_eos": True})
    both = client.chat.completions.create(**kw).choices[0].message.tool_calls
    assert [c.function.name for c in both] == [TOOL_NAME, TOOL_NAME]
    first = client.chat.completions.create(parallel_tool_calls=False, **kw).choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in first] == [(TOOL_NAME, both[0].function.arguments)]
    out, _ = _collect(client.chat.completions.create(parallel_tool_calls=False, stream=True, **kw))
    assert list(out[0]["tools"]) == [0] and out[0]["tools"][0]["name"] == TOOL_NAME


def test_stream_options_without_obfuscation(client):
    """include_obfuscation false asks for what this server does (no padding); true is refused (test_errors.py)."""
    out, chunks = _collect(client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=2, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False}))
    assert out[0]["finish"] == "length" and chunks[-1].usage.completion_tokens == 2


def test_continuous_usage_stats(client):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far; the last is the total."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSG, n=2, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    assert chunks[-1].choices == [] and {ch.usage.prompt_tokens for ch in chunks} == {chunks[-1].usage.prompt_tokens}
