"""Regression tests of the server's limits through the real server: lone surrogates, tokenizing off the event
loop with a character cap, requests that can never be admitted, the prompts x n cap, read timeouts, the early
413, and streams cut by --shutdown-timeout ending with an error event and [DONE]."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import openai
import pytest

from e2e_helpers import API_KEY, MODEL, SERVER_FLAGS, ServerThread, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
MSG = [{"role": "user", "content": "hi"}]


async def _post(url: str, path: str, raw: bytes):
    async with aiohttp.ClientSession(url) as s:
        async with s.post(path, data=raw, headers=AUTH) as r:
            return r.status, await r.text()


def post_raw(server, path: str, raw: bytes):
    return asyncio.run(_post(server.url, path, raw))


def error_of(status: int, text: str, want: int) -> dict:
    assert status == want, text
    body = json.loads(text)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/completions", '{"prompt": "a\\udfffb"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "a\\ud800"]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                             '"function": {"name": "f\\ud800"}}]}', "tools"),
    ("/v1/chat/completions", '{"model": "a\\ud800b", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "a\\ud800": 1}', "a\\ud800"),
])
def test_lone_surrogate_is_400(server, path, body, param):
    err = error_of(*post_raw(server, path, body.encode()), 400)
    assert "surrogate" in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_surrogate_pair_is_text(client):
    """The official client cannot send a lone surrogate (it encodes UTF-8 strictly); a valid pair, one astral
    character, is ordinary text."""
    out = client.completions.create(model=MODEL, prompt="smile \U0001F600", max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_text_work_is_off_the_event_loop(server):
    """A slow tokenizer (a 2 s encode) holds one /tokenize; /health and /v1/models answer meanwhile."""
    tok = server.server.serving.tokenizer
    real = tok.encode

    def slow(*a, **kw):
        time.sleep(2.0)
        return real(*a, **kw)

    async def go():
        async with aiohttp.ClientSession(server.url) as s:
            async def tokenize():
                async with s.post("/tokenize", json={"prompt": "hello"}) as r:
                    return r.status
            task = asyncio.create_task(tokenize())
            await asyncio.sleep(0.3)
            t = time.time()
            async with s.get("/health") as r:
                assert r.status == 200
            async with s.get("/v1/models", headers=AUTH) as r:
                assert r.status == 200
            waited = time.time() - t
            return waited, await task

    tok.encode = slow
    try:
        waited, status = asyncio.run(go())
    finally:
        del tok.encode
    assert status == 200
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a tokenize"


def test_character_cap_before_tokenizing(server, client):
    s = server.server.serving
    cap = s.max_prompt_chars
    assert cap == 512 * max(len(s.tokenizer.id_to_token(i) or "") for i in range(s.tokenizer.vocab_size))
    calls = []
    real = s.tokenizer.encode
    s.tokenizer.encode = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        big = "word " * (cap // 5 + 1)
        err = error_of(*post_raw(server, "/tokenize", json.dumps({"prompt": big}).encode()), 400)
        assert "characters" in err["message"] and err["param"] == "prompt"
        with pytest.raises(openai.BadRequestError, match="characters"):
            client.completions.create(model=MODEL, prompt=big, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="characters"):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": big}], max_tokens=2)
        assert not calls, "a text over the cap was tokenized"
    finally:
        del s.tokenizer.encode


def test_never_admissible_is_400_not_429(server, client):
    """16 running + 64 waiting is the most this server can ever hold: more in one request is a 400."""
    wait_idle(server)
    with pytest.raises(openai.BadRequestError, match="can ever hold") as e:
        client.chat.completions.create(model=MODEL, messages=MSG, n=81, max_tokens=2)
    assert e.value.response.headers.get("Retry-After") is None
    with pytest.raises(openai.BadRequestError, match="can ever hold"):
        client.completions.create(model=MODEL, prompt=["a", "b", "c"], n=27, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"81 sequences \(best_of=81\)") as e:  # best_of runs them all
        client.completions.create(model=MODEL, prompt="a", best_of=81, max_tokens=2)
    assert e.value.body["param"] == "best_of"
    out = client.completions.create(model=MODEL, prompt=["a", "b"], n=40, max_tokens=1)  # 80: admissible
    assert len(out.choices) == 80
    wait_idle(server)


def test_prompts_times_n_cap(server, client):
    with pytest.raises(openai.BadRequestError, match="max-request-sequences"):
        client.completions.create(model=MODEL, prompt=["p"] * 100, n=128, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="prompt list length 1025 exceeds the maximum allowed count of 1024"):
        client.completions.create(model=MODEL, prompt=["p"] * 1025, max_tokens=1)
    cfg = server.server.serving.config
    old, cfg.max_request_sequences = cfg.max_request_sequences, 5
    try:
        with pytest.raises(openai.BadRequestError, match="at most 5"):
            client.completions.create(model=MODEL, prompt=["a", "b", "c"], n=2, max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="at most 5"):
            client.chat.completions.create(model=MODEL, messages=MSG, n=6, max_tokens=1)
        assert len(client.completions.create(model=MODEL, prompt=["a"], n=5, max_tokens=1).choices) == 5
    finally:
        cfg.max_request_sequences = old
    wait_idle(server)


def test_huge_content_length_is_413_at_once(server):
    async def go():
        r, w = await asyncio.open_connection(server.server.host, server.server.port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000000000000000\r\n\r\n{")
        await w.drain()
        t = time.time()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        w.close()
        return head.decode(), time.time() - t

    head, took = asyncio.run(go())
    assert head.startswith("HTTP/1.1 413"), head
    assert took < 2.0


# ---- a second server with short timeouts, shut down at the end -----------------------------------------------
@pytest.fixture(scope="module")
def short_server(scripted_model, xla_cache_dir):
    st = ServerThread(["--model", scripted_model[0], "--port", "0", *SERVER_FLAGS, "--read-timeout", "1",
                       "--shutdown-timeout", "0.5"]).start()
    yield st
    if st.server is not None and not st.server.serving.draining:
        st.stop()


def test_slow_headers_and_body_time_out(short_server):
    async def go():
        host, port = short_server.server.host, short_server.server.port
        r, w = await asyncio.open_connection(host, port)
        t = time.time()
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        await w.drain()
        rest = await asyncio.wait_for(r.read(), 5)
        headers_closed = time.time() - t
        w.close()
        r, w = await asyncio.open_connection(host, port)
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prom")
        await w.drain()
        t = time.time()
        head = (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)).decode()
        body_closed = time.time() - t
        length = int(next(h.split(":")[1] for h in head.split("\r\n") if h.lower().startswith("content-length")))
        reply = head + (await r.readexactly(length)).decode()
        w.close()
        return rest, headers_closed, reply, body_closed

    rest, headers_closed, reply, body_closed = asyncio.run(go())
    assert rest == b"" and 0.8 < headers_closed < 3.0
    assert reply.startswith("HTTP/1.1 408"), reply
    assert "Connection: close" in reply and '"code": "request_timeout"' in reply and 0.8 < body_closed < 3.0


def test_shutdown_ends_cut_streams_with_an_error_and_done(short_server):
    """--shutdown-timeout 0.5: a stream still running then gets a final error event and [DONE], a plain request a
    503; both in OpenAI's shape."""
    body = {"model": MODEL, "prompt": [0, 7], "max_tokens": 505, "ignore_eos": True}
    results: dict = {}

    async def go():
        async with aiohttp.ClientSession(short_server.url) as s:
            async def stream():
                async with s.post("/v1/completions", json={**body, "stream": True}, headers=AUTH) as r:
                    results["stream"] = (r.status, await r.text())

            async def plain():
                async with s.post("/v1/completions", json=body, headers=AUTH) as r:
                    results["plain"] = (r.status, await r.text())

            await asyncio.gather(stream(), plain())

    t = threading.Thread(target=lambda: asyncio.run(go()))
    t.start()
    deadline = time.time() + 30
    while short_server.engine.num_requests_in_flight < 2 and time.time() < deadline:
        time.sleep(0.02)
    assert short_server.engine.num_requests_in_flight == 2
    short_server.stop()
    t.join(30)
    status, text = results["stream"]
    assert status == 200
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    err = json.loads(events[-2][len("data: "):])["error"]
    assert "shutting down" in err["message"] and err["code"] == 503
    assert any('"text"' in e for e in events[:-2])  # some tokens came before the cut
    assert error_of(*results["plain"], 503)["code"] == "shutting_down"
