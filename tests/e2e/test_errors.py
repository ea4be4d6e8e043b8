"""Bad input and faults over raw HTTP (aiohttp client): every error is OpenAI-shaped and nothing
crashes the server."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from e2e_helpers import API_KEY, wait_idle
from scripted import TOOLS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]


async def _post(url: str, path: str, body=None, *, raw: bytes | None = None, headers=None):
    async with aiohttp.ClientSession(url) as s:
        data = raw if raw is not None else json.dumps(body)
        async with s.post(path, data=data, headers={**AUTH, "Content-Type": "application/json", **(headers or {})}) as r:
            return r.status, dict(r.headers), await r.text()


def post(server, path, body=None, **kw):
    status, headers, text = asyncio.run(_post(server.url, path, body, **kw))
    return status, headers, text


def assert_error(status, text, want_status, param=None):
    assert status == want_status, text
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def test_malformed_and_empty_bodies(server):
    for raw in (b"{not json", b"", b"   ", b"\xff\xfe\x00garbage", b"[" * 100000):
        status, _, text = post(server, "/v1/chat/completions", raw=raw)
        assert_error(status, text, 400)
    for body in ([], "a string", 3, None):
        status, _, text = post(server, "/v1/completions", body)
        assert_error(status, text, 400)


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "temperature": 2.5}, "temperature"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "top_p": 1.5}, "top_p"),
    ({"messages": MSG, "top_k": -2}, "top_k"),
    ({"messages": MSG, "min_p": 2}, "min_p"),
    ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": MSG, "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"messages": MSG, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "n": 1000}, "n"),
    ({"messages": MSG, "seed": 2**70}, "seed"),
    ({"messages": MSG, "stop": 5}, "stop"),
    ({"messages": MSG, "stop": [""]}, "stop"),
    ({"messages": MSG, "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"messages": MSG, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MSG, "logit_bias": {"5": 101}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": MSG, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "strin"}}}}, "response_format"),
    ({"messages": MSG, "guided_regex": "[a-"}, "guided_regex"),
    ({"messages": MSG, "guided_choice": []}, "guided_choice"),
    ({"messages": MSG, "guided_decoding_backend": "xgrammar", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"messages": MSG, "guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern"),
    ({"messages": MSG, "structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"messages": MSG, "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "max_tokens": 2},
     "messages"),
    # messages OpenAI refuses: content missing or null (only an assistant turn may go without), a text part
    # without text, a name or tool_calls of the wrong shape
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "system", "content": None}, *MSG]}, "messages"),
    ({"messages": [{"role": "tool"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages"),
    ({"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [{"function": 5}]}]}, "messages"),
    # values the engine step could not take (int32 arrays): refused here, not a failed step for the whole batch
    ({"messages": MSG, "top_k": 2**31}, "top_k"),
    ({"messages": MSG, "min_tokens": 1, "max_tokens": 3, "stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"messages": MSG, "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"messages": MSG, "min_tokens": 600}, "min_tokens"),  # more than the default max_tokens (what fits)
    # accepted-but-ignored is refused by name
    ({"messages": MSG, "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"messages": MSG, "stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options"),
    ({"messages": MSG, "response_format": {"type": "text", "json_schema": {}}}, "response_format"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format"),
    ({"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "shema": {}}}},
     "response_format"),
    ({"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": MSG, "tools": TOOLS + TOOLS}, "tools"),
])
def test_invalid_chat_fields(server, body, param):
    status, _, text = post(server, "/v1/chat/completions", body)
    assert_error(status, text, 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_at_most_eight(server, stream):
    """min_tokens holds back the stop ids and EOS in the sampler, 8 at most: a ninth would be silently let through.
    LLMEngine's check (LLM.generate's too, tests/engine/test_engine_features.py) refuses it: a 400, streaming or not,
    before any output."""
    body = {"messages": MSG, "min_tokens": 2, "max_tokens": 4, "stop_token_ids": list(range(100, 108)),
            "stream": stream}
    status, _, text = post(server, "/v1/chat/completions", body)
    err = assert_error(status, text, 400)
    assert "at most 8 stop_token_ids and EOS ids can be held back" in err["message"], err


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "hi", "best_of": 3, "stream": True}, "best_of"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "suffix": "x"}, "suffix"),
    ({"prompt": "hi", "suffix": []}, "suffix"),
    ({"prompt": "hi", "max_tokens": 600}, "max_tokens"),
    ({"prompt": [1] * 600, "max_tokens": None}, "prompt"),
    ({"prompt": "hi", "top_k": 2**40}, "top_k"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options"),
])
def test_invalid_completion_fields(server, body, param):
    status, _, text = post(server, "/v1/completions", body)
    assert_error(status, text, 400, param)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages_": 1}, "messages_"),
    ("/tokenize", {"messages": MSG, "add_special_tokens": False}, "add_special_tokens"),  # a prompt's field
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, "return_token_strs"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": False}, "skip_special_tokens"),
])
def test_invalid_tokenize_fields(server, path, body, param):
    status, _, text = post(server, path, body)
    assert_error(status, text, 400, param)


def test_context_length_message(server):
    status, _, text = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 510})
    err = assert_error(status, text, 400, "max_tokens")
    assert "maximum context length is 512" in err["message"]


def test_unknown_model_404(server):
    for path, body in (("/v1/chat/completions", {"model": "gpt-9", "messages": MSG}),
                       ("/v1/completions", {"model": "gpt-9", "prompt": "x"})):
        status, _, text = post(server, path, body)
        err = assert_error(status, text, 404, "model")
        assert err["code"] == "model_not_found" and "gpt-9" in err["message"]


def test_api_key(server):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, text = post(server, "/v1/completions", {"prompt": "x"}, headers=headers)
        assert assert_error(status, text, 401)["code"] == "invalid_api_key"

    async def get(path):
        async with aiohttp.ClientSession(server.url) as s:
            async with s.get(path) as r:
                return r.status, await r.text()

    assert_error(*asyncio.run(get("/v1/models")), 401)
    assert asyncio.run(get("/health"))[0] == 200  # health and metrics are open, as in vLLM
    assert asyncio.run(get("/metrics"))[0] == 200


def test_body_too_large_413(server):
    big = json.dumps({"prompt": "x" * (2**20 + 10)}).encode()
    status, _, text = post(server, "/v1/completions", raw=big)
    assert_error(status, text, 413)


def test_unknown_route_and_method(server):
    async def go():
        async with aiohttp.ClientSession(server.url) as s:
            async with s.get("/v1/nothing", headers=AUTH) as r:
                a = (r.status, await r.text())
            async with s.get("/v1/completions", headers=AUTH) as r:
                b = (r.status, await r.text())
        return a, b

    a, b = asyncio.run(go())
    assert_error(*a, 404)
    assert_error(*b, 405)


def test_queue_full_429(server):
    """16 running + 64 waiting fit; the rest of a burst of 100 streams is refused with 429 + Retry-After.
    Every accepted stream stays open until all 100 have their status, then disconnects (aborts)."""
    wait_idle(server)
    n = 100
    got: list[int] = []

    async def one(s, all_in: asyncio.Event):
        body = {"prompt": [0, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with s.post("/v1/completions", json=body, headers=AUTH) as r:
            got.append(r.status)
            if len(got) == n:
                all_in.set()
            result = (r.status, dict(r.headers), await r.text() if r.status != 200 else "")
            await all_in.wait()
            return result

    async def go():
        all_in = asyncio.Event()
        async with aiohttp.ClientSession(server.url, connector=aiohttp.TCPConnector(limit=0)) as s:
            return await asyncio.wait_for(asyncio.gather(*[one(s, all_in) for _ in range(n)]), 120)

    results = asyncio.run(go())
    codes = [r[0] for r in results]
    # exactly 80 / 20 unless a 400-token stream finished before the burst was in (a very slow machine)
    assert codes.count(200) >= 80 and codes.count(429) >= 1 and codes.count(200) + codes.count(429) == n, codes
    for status, headers, text in results:
        if status == 429:
            assert headers["Retry-After"] == "1"
            assert assert_error(status, text, 429)["type"] == "rate_limit_error"
    wait_idle(server)


def test_engine_step_failure(server):
    """An engine step that raises: 500 for a plain request, an error event then [DONE] in a stream;
    the server keeps serving afterwards."""
    wait_idle(server)
    eng = server.engine.engine
    real_step = eng.step
    state = {"fail": 0}

    def flaky_step():
        if state["fail"]:
            state["fail"] -= 1
            raise RuntimeError("injected device failure")
        return real_step()

    eng.step = flaky_step
    try:
        state["fail"] = 1
        status, _, text = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 5})
        err = assert_error(status, text, 500)
        assert "injected device failure" in err["message"] and err["type"] == "server_error"
        state["fail"] = 1
        status, headers, text = post(server, "/v1/chat/completions", {"messages": MSG, "stream": True})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert "injected device failure" in json.loads(events[-2][6:])["error"]["message"]
    finally:
        eng.step = real_step
    status, _, text = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, text
    wait_idle(server)


def test_engine_refusal_is_400(server):
    """A request LLMEngine.add_request refuses (a ValueError on the engine thread, e.g. prompt_logprobs with
    data-parallel attention) is a 400, not an internal error; streamed, an error event with code 400 then [DONE]."""
    wait_idle(server)
    eng = server.engine.engine
    real_add = eng.add_request

    def refuse(*a, **kw):
        raise ValueError("prompt_logprobs is not supported here")

    eng.add_request = refuse
    try:
        status, _, text = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        err = assert_error(status, text, 400)
        assert "prompt_logprobs is not supported here" in err["message"] and err["type"] == "invalid_request_error"
        status, _, text = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, "stream": True})
        events = [e for e in text.split("\n\n") if e]
        assert status == 200 and events[-1] == "data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == 400 and err["type"] == "invalid_request_error" and "not supported here" in err["message"]
    finally:
        del eng.add_request
    assert eng.add_request == real_add
    status, _, text = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, text
    wait_idle(server)


def test_random_garbage_never_500(server):
    rng = random.Random(0)
    values = [None, True, -1, 0, 1.5, 10**30, float("inf"), "x", "", [], [1], {}, {"a": 1}, [[1]], ["a"], "\x00"]
    keys = ["model", "prompt", "messages", "max_tokens", "temperature", "n", "stop", "stream", "logprobs",
            "top_logprobs", "tools", "tool_choice", "seed", "echo", "top_k", "stream_options", "stop_token_ids",
            "chat_template_kwargs", "min_tokens"]
    for _ in range(60):
        body = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(1, 6))}
        for path in ("/v1/chat/completions", "/v1/completions"):
            raw = json.dumps(body, allow_nan=True).encode()
            status, _, text = post(server, path, raw=raw)
            assert status in (200, 400, 404), (path, body, status, text)
            if status != 200:
                assert_error(status, text, status)
    wait_idle(server)
    async def health():
        async with aiohttp.ClientSession(server.url) as s:
            async with s.get("/health") as r:
                return r.status
    assert asyncio.run(health()) == 200
