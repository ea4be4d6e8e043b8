"""Request parsing into SamplingParams and response shapes (server/protocol.py, no JAX)."""

from __future__ import annotations

import pytest

from deepinfer_jax.server.protocol import (APIError, chat_logprobs, completion_logprobs, parse_chat_request,
                                           parse_completion_request, parse_prompt, usage)
from deepinfer_jax.types import Logprob

MSG = [{"role": "user", "content": "hi"}]


def test_chat_defaults_and_mapping():
    r = parse_chat_request({"messages": MSG})
    p = r.params
    assert p.max_tokens is None and p.n == 1 and p.temperature == 1.0 and p.logprobs is None and not r.stream
    assert r.tool_choice == "none" and r.include_reasoning
    r = parse_chat_request({"messages": MSG, "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True,
                            "top_logprobs": 3, "seed": -1, "stop": "x", "top_k": -1, "stream": True,
                            "stream_options": {"include_usage": True}})
    assert r.params.max_tokens == 7 and r.params.logprobs == 3 and r.params.stop == ["x"] and r.params.top_k == 0
    assert 0 <= r.params.seed < 2**63 and r.include_usage
    assert parse_chat_request({"messages": MSG, "logprobs": True}).params.logprobs == 0


def test_chat_messages_are_normalised():
    r = parse_chat_request({"messages": [{"role": "developer", "content": "be brief"},
                                         {"role": "assistant", "content": "ok", "reasoning": "thought"}]})
    assert r.messages[0]["role"] == "system" and r.messages[1]["reasoning_content"] == "thought"


def test_tool_choice():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert parse_chat_request({"messages": MSG, "tools": tools}).tool_choice == "auto"
    r = parse_chat_request({"messages": MSG, "tools": tools, "tool_choice": {"type": "function",
                                                                             "function": {"name": "f"}}})
    assert r.named_tool == "f"
    for bad in ("maybe", {"function": {"name": "g"}}, 3):
        with pytest.raises(APIError) as e:
            parse_chat_request({"messages": MSG, "tools": tools, "tool_choice": bad})
        assert e.value.param == "tool_choice"


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", 3), ("top_p", 0), ("n", 0),
                                         ("n", 129), ("max_tokens", 0), ("min_p", 1.5), ("top_k", -5),
                                         ("presence_penalty", 2.5), ("seed", 2**65), ("stream", 1),
                                         ("stop_token_ids", ["a"]), ("min_tokens", -1), ("ignore_eos", "y")])
def test_out_of_range_names_the_field(field, value):
    with pytest.raises(APIError) as e:
        parse_chat_request({"messages": MSG, field: value})
    assert e.value.status == 400 and e.value.param == field


def test_completion_prompts():
    assert parse_prompt("a") == ["a"]
    assert parse_prompt(["a", "b"]) == ["a", "b"]
    assert parse_prompt([1, 2]) == [[1, 2]]
    assert parse_prompt([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in (None, [], [[]], [1, "a"], [True], "", ["a", ""], 5, {"a": 1}):
        with pytest.raises(APIError):
            parse_prompt(bad)
    r = parse_completion_request({"prompt": "x", "logprobs": 2, "echo": False})
    assert r.params.max_tokens == 16 and r.params.logprobs == 2


def test_logprob_shapes():
    entries = [{5: Logprob(-0.1, 1), 6: Logprob(-2.0, 2), 7: Logprob(-3.0, 3)}]
    tok = lambda t: f"<{t}>"  # noqa: E731
    c = chat_logprobs([5], entries, 2, tok)["content"][0]
    assert c["token"] == "<5>" and c["logprob"] == -0.1 and [t["token"] for t in c["top_logprobs"]] == ["<5>", "<6>"]
    lp = completion_logprobs([5], entries, 1, tok, text_offset=3)
    assert lp == {"tokens": ["<5>"], "token_logprobs": [-0.1], "top_logprobs": [{"<5>": -0.1}], "text_offset": [3]}
    assert chat_logprobs([5], [{5: Logprob(float("-inf"), 1)}], 0, tok)["content"][0]["logprob"] == -9999.0
    assert usage(3, 4, 1) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 1}}


def test_protocol_imports_no_jax():
    import subprocess
    import sys

    code = ("import sys; import deepinfer_jax.server.protocol, deepinfer_jax.server.app, deepinfer_jax.cli; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _client_fields(module) -> list[str]:
    """The request fields the official openai client can send for an endpoint (its TypedDicts, streaming too)."""
    names = set()
    for cls in (module.CompletionCreateParamsBase, module.CompletionCreateParamsStreaming):
        names |= set(cls.__annotations__)
    return sorted(names)


def _chat_fields():
    import openai.types.chat.completion_create_params as m

    return _client_fields(m)


def _completion_fields():
    import openai.types.completion_create_params as m

    return _client_fields(m)


BAD = [{"not": "a valid value"}]  # no field of either endpoint takes a list of such objects


@pytest.mark.parametrize("name", _chat_fields())
def test_every_chat_field_of_the_client_is_checked_or_refused(name):
    """Each field the official client can send is honoured (so a value of the wrong shape is a 400 naming it) or
    refused by name: none is dropped silently."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], name: BAD}
    with pytest.raises(APIError) as e:
        parse_chat_request(body)
    assert e.value.param == name, str(e.value)


@pytest.mark.parametrize("name", _completion_fields())
def test_every_completion_field_of_the_client_is_checked_or_refused(name):
    body = {"model": "m", "prompt": "hi", name: BAD}
    with pytest.raises(APIError) as e:
        parse_completion_request(body)
    assert e.value.param == name, str(e.value)


def test_unknown_fields_are_refused_by_name_and_tags_accepted():
    with pytest.raises(APIError, match="'frobnicate' is not supported") as e:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True, "frobnicate": 1})
    assert e.value.param == "frobnicate" and "use_beam_search" in str(e.value)
    with pytest.raises(APIError, match="'best_of'"):
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "best_of": 2})
    with pytest.raises(APIError, match="not available when 'stream'") as e:
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True})
    assert e.value.param == "prompt_logprobs"
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "user": "u1", "metadata": {"a": "b"},
                              "store": False, "service_tier": "auto", "prompt_logprobs": None})
    assert req.messages[0]["content"] == "hi"
    with pytest.raises(APIError, match="'store'"):
        parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "store": True})
    parse_completion_request({"prompt": "hi", "user": "u1"})
    with pytest.raises(APIError, match="'include_reasoning' is not supported"):
        parse_completion_request({"prompt": "hi", "include_reasoning": True})


def test_every_stream_option_of_the_client_is_honoured_or_refused():
    """stream_options keys the official client can send: include_usage is honoured; a key asking for what this
    server does not do (include_obfuscation true: padded chunks) is refused by name, its false accepted."""
    from openai.types.chat import ChatCompletionStreamOptionsParam

    msgs = [{"role": "user", "content": "hi"}]
    for key in ChatCompletionStreamOptionsParam.__annotations__:
        body = {"messages": msgs, "stream": True, "stream_options": {key: True}}
        if key == "include_usage":
            assert parse_chat_request(body).include_usage is True
            continue
        with pytest.raises(APIError, match=f"stream_options.{key}") as e:
            parse_chat_request(body)
        assert e.value.param == "stream_options"
        assert parse_chat_request({**body, "stream_options": {key: False}}).include_usage is False
