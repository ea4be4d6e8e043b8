"""32 concurrent streams through the official openai client (chat with n=1 and n=2, completions with two prompts),
half of them closed by their client after a few chunks: the others complete, /health and /v1/models answer all
along, and every KV page comes back (the pool's free page count returns to where it started)."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from e2e_helpers import API_KEY, MODEL, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_32_streams_with_aborts(server):
    from openai import AsyncOpenAI

    wait_idle(server)
    pool = server.engine.engine.scheduler.kv_cache_manager.block_pool
    free_before = pool.num_free_blocks

    async def one(c, i: int):
        abort = i % 2 == 1
        kind = ("chat", "chat_n2", "completion")[i % 3]
        kw = dict(model=MODEL, stream=True, max_tokens=400 if abort else 12, stream_options={"include_usage": True},
                  extra_body={"ignore_eos": True})
        if kind == "completion":
            stream = await c.completions.create(prompt=[f"prompt {i}", f"other {i}"], **kw)
        else:
            stream = await c.chat.completions.create(messages=[{"role": "user", "content": f"request {i}"}],
                                                     n=2 if kind == "chat_n2" else 1, **kw)
        finish: dict[int, str] = {}
        usage, chunks = None, 0
        async for ch in stream:
            chunks += 1
            for x in ch.choices:
                if x.finish_reason:
                    finish[x.index] = x.finish_reason
            usage = ch.usage or usage
            if abort and chunks == 3:
                await stream.close()  # the client goes away mid-stream
                return kind, abort, None, None
        return kind, abort, finish, usage

    async def ping(s, lat: list, stop: asyncio.Event):
        while not stop.is_set():
            t = time.perf_counter()
            async with s.get("/health") as r:
                assert r.status == 200
            async with s.get("/v1/models", headers=AUTH) as r:
                assert r.status == 200
            lat.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)

    async def go():
        lat: list[float] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(server.url) as s, \
                AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
            pinger = asyncio.create_task(ping(s, lat, stop))
            results = await asyncio.gather(*[one(c, i) for i in range(32)])
            stop.set()
            await pinger
        return results, lat

    results, lat = asyncio.run(go())
    for kind, abort, finish, usage in results:
        if abort:
            continue
        choices = 2 if kind != "chat" else 1
        assert finish == {i: "length" for i in range(choices)}, (kind, finish)
        assert usage.completion_tokens == 12 * choices, (kind, usage)
    assert len(lat) >= 3 and max(lat) < 1.0, f"/health + /v1/models took up to {max(lat):.2f} s"
    wait_idle(server)
    assert server.engine.num_requests_in_flight == 0
    assert pool.num_free_blocks == free_before
