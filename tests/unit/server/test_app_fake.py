"""The aiohttp app over a fake engine (no JAX): start-up 503s, engine failures, disconnects, shapes."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
from aiohttp.test_utils import TestServer

from deepinfer_jax.engine.async_engine import AsyncEngine
from deepinfer_jax.server.app import build_app
from deepinfer_jax.server.metrics import ServerMetrics
from deepinfer_jax.server.serving import Serving, ServingConfig
from fake_engine import FakeEngine


class FakeTokenizer:
    vocab_size = 100

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 100 for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"t{i} " for i in ids)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kw):
        text = "".join(m["content"] or "" for m in messages)
        return self.encode(text) if tokenize else text


def _serving(fake=None, build=None, **kw):
    fake = fake or FakeEngine(**kw)
    eng = AsyncEngine(build or (lambda: fake)).start()
    cfg = ServingConfig(served_model_names=["m"], model_path="/nowhere", max_model_len=None)  # as with no flag
    return Serving(eng, FakeTokenizer(), cfg, ServerMetrics("m")), fake


async def _with_server(serving, fn):
    server = TestServer(build_app(serving), handler_cancellation=True)
    await server.start_server()
    try:
        async with aiohttp.ClientSession(str(server.make_url(""))) as s:
            return await fn(s)
    finally:
        await server.close()
        serving.engine.shutdown()


def test_503_until_ready_then_200():
    gate = threading.Event()
    fake = FakeEngine()

    def build():
        gate.wait(5)
        return fake

    serving, _ = _serving(fake, build=build)

    async def fn(s):
        async with s.get("/health") as r:
            assert r.status == 503 and (await r.json())["status"] == "starting"
        async with s.post("/v1/completions", json={"prompt": "ab"}) as r:
            body = await r.json()
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert set(body["error"]) == {"message", "type", "param", "code"}
        gate.set()
        await asyncio.get_running_loop().run_in_executor(None, serving.engine.wait_ready, 5)
        async with s.get("/health") as r:
            assert r.status == 200
        async with s.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3}) as r:
            body = await r.json()
            assert r.status == 200 and body["choices"][0]["text"] == "t99 t0 t1 "
        async with s.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}]}) as r:
            body = await r.json()  # max_tokens: what fits in the engine's max_model_len (64)
            assert r.status == 200 and body["usage"]["completion_tokens"] == 62
        async with s.post("/v1/completions", json={"prompt": "ab", "max_tokens": 63}) as r:
            assert r.status == 400 and "maximum context length is 64" in (await r.json())["error"]["message"]
        async with s.get("/v1/models") as r:
            assert (await r.json())["data"][0]["max_model_len"] == 64

    asyncio.run(_with_server(serving, fn))


def test_engine_failure_is_500_or_an_error_event():
    serving, fake = _serving(step_delay=0.01)

    async def fn(s):
        fake.fail_next_step = True
        async with s.post("/v1/completions", json={"prompt": "ab", "max_tokens": 30}) as r:
            body = await r.json()
            assert r.status == 500 and body["error"]["type"] == "server_error"
            assert "injected" in body["error"]["message"]
        async with s.get("/health") as r:
            assert r.status == 503 and "unhealthy" in (await r.json())["status"]
        fake.fail_next_step = True
        async with s.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 30, "stream": True}) as r:
            assert r.status == 200
            events = [line for line in (await r.text()).split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][len("data: "):])
        assert "injected" in err["error"]["message"]
        async with s.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}) as r:
            assert r.status == 200  # the engine recovered
        async with s.get("/health") as r:
            assert r.status == 200

    asyncio.run(_with_server(serving, fn))


def test_disconnects_abort_streaming_and_non_streaming():
    serving, fake = _serving(step_delay=0.01)

    async def wait_empty():
        for _ in range(300):
            if not fake.reqs and serving.engine.num_requests_in_flight == 0:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"still in flight: {list(fake.reqs)}")

    async def fn(s):
        r = await s.post("/v1/completions", json={"prompt": "a", "max_tokens": 60, "stream": True})
        await r.content.readline()
        r.close()  # drop the connection mid-stream
        await wait_empty()
        assert len(fake.aborted) == 1
        try:
            await s.post("/v1/completions", json={"prompt": "a", "max_tokens": 60},
                         timeout=aiohttp.ClientTimeout(total=0.1))
        except asyncio.TimeoutError:
            pass
        await wait_empty()
        assert len(fake.aborted) == 2
        async with s.get("/metrics") as r:
            text = await r.text()
        assert 'deepinfer:request_success_total{finished_reason="abort",model_name="m"} 2.0' in text or \
            'deepinfer:request_success_total{model_name="m",finished_reason="abort"} 2.0' in text

    asyncio.run(_with_server(serving, fn))


def test_completion_shapes_n_and_multiple_prompts():
    serving, _ = _serving()

    async def fn(s):
        async with s.post("/v1/completions", json={"prompt": [[1], [5]], "n": 2, "max_tokens": 2, "echo": True,
                                                   "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(e[6:]) for e in (await r.text()).split("\n\n") if e and e != "data: [DONE]"]
        texts: dict[int, str] = {}
        for e in events:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        assert texts == {0: "t1 t2 t3 ", 1: "t1 t2 t3 ", 2: "t5 t6 t7 ", 3: "t5 t6 t7 "}
        assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10,
                                       "prompt_tokens_details": {"cached_tokens": 0}}

    asyncio.run(_with_server(serving, fn))


def test_encode_reply_is_json_dumps():
    """Replies are encoded in pieces on a text thread (serving.encode_reply): the bytes are json_response's."""
    from deepinfer_jax.server.serving import encode_reply

    nested = {"choices": [{"index": 0, "logprobs": {"content": [{"token": "é", "top_logprobs": [{"b": [1]}]}],
                                                    "tokens": [], "by_id": {5: 1.0}}, "text": "x\ud800"}],
              "usage": {"prompt_tokens": 1}, "none": None, "empty": {}, "list": [[], [1, 2.5, True]]}
    for obj in (nested, [], {}, "s", 1, None, [nested, nested]):
        assert encode_reply(obj) == json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace"), obj


def test_several_api_keys_any_one_is_accepted():
    """--api-key K1 K2 (vLLM's nargs): each key opens /v1/* and the dashboard (its own cookie); others get 401."""
    from deepinfer_jax.server import dashboard
    from deepinfer_jax.server.args import add_server_args
    import argparse

    p = argparse.ArgumentParser()
    add_server_args(p)
    assert p.parse_args(["--api-key", "k1", "k2"]).api_key == ["k1", "k2"]
    serving, _ = _serving()

    async def go():
        server = TestServer(build_app(serving, api_key=["k1", "k2"]), handler_cancellation=True)
        await server.start_server()
        try:
            async with aiohttp.ClientSession(str(server.make_url(""))) as s:
                got = []
                for key in ("k1", "k2", "k3", None):
                    headers = {"Authorization": f"Bearer {key}"} if key else {}
                    async with s.get("/v1/models", headers=headers) as r:
                        got.append(r.status)
                async with s.get("/dashboard?key=k2", allow_redirects=False) as r:
                    got.append((r.status, r.cookies[dashboard.COOKIE].value))
                async with s.get("/dashboard?key=k3", allow_redirects=False) as r:
                    got.append(r.status)
                return got
        finally:
            await server.close()
            serving.engine.shutdown()

    assert asyncio.run(go()) == [200, 200, 401, 401, (302, dashboard._cookie_value("k2")), 401]
