"""The dashboard through the real server: its key guard, and the page in a real headless Chromium while the
server runs real traffic (the official client): the page's numbers change while traffic runs and, once it
stops, equal /metrics' (histogram percentiles recomputed here from /metrics' buckets); no prompt text on the
page or in its data; a screenshot is saved."""

from __future__ import annotations

import asyncio
import json
import math

import aiohttp
import pytest

from cdp_browser import Browser, find_chromium
from e2e_helpers import API_KEY, MODEL, parse_metrics, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LABEL = (("model_name", MODEL),)
MARKER = "zebra-octopus-7731"  # a prompt word that must never reach the dashboard


def test_dashboard_key_guard_and_data(server):
    async def go():
        # unsafe=True: aiohttp keeps no cookies of an IP address otherwise (a browser does)
        async with aiohttp.ClientSession(server.url, cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
            out = {}
            for path in ("/dashboard", "/dashboard/data", "/dashboard/assets/uPlot.iife.min.js"):
                async with s.get(path) as r:
                    out[path] = r.status, await r.text()
            async with s.get("/dashboard/data", headers=AUTH) as r:
                out["data"] = r.status, await r.json()
            async with s.get("/", allow_redirects=False) as r:
                out["root"] = r.status, r.headers.get("Location")
            async with s.get("/dashboard?key=wrong", allow_redirects=False) as r:
                out["wrong"] = r.status
            async with s.get(f"/dashboard?key={API_KEY}&interval=500", allow_redirects=False) as r:
                out["login"] = r.status, r.headers.get("Location"), r.cookies
            async with s.get("/dashboard/data") as r:  # the cookie from ?key= now opens it
                out["cookie"] = r.status
            async with s.get("/dashboard/assets/nope.js") as r:
                out["asset404"] = r.status
        return out

    out = asyncio.run(go())
    for path in ("/dashboard", "/dashboard/data", "/dashboard/assets/uPlot.iife.min.js"):
        status, text = out[path]
        assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", (path, text)
    status, data = out["data"]
    assert status == 200 and data["model"]["name"] == MODEL and data["flags"]["api_key"] == "set"
    assert API_KEY not in json.dumps(data)
    assert data["memory"]["weights"] > 0 and data["memory"]["kv_cache"] > 0
    assert data["device"]["platform"] == "cpu" and data["build"]["uplot"] == "1.6.32"
    assert out["root"] == (302, "/dashboard")
    assert out["wrong"] == 401
    status, location, cookies = out["login"]
    assert status == 302 and location == "/dashboard?interval=500"
    cookie = cookies["deepinfer_dashboard"]
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and API_KEY not in cookie.value
    assert out["cookie"] == 200 and out["asset404"] == 404


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """histogram_quantile as Prometheus documents it, written here independently of the server's."""
    total = buckets[-1][1]
    rank = q * total
    lo, below = 0.0, 0.0
    for le, n in buckets:
        if n >= rank:
            return lo if math.isinf(le) else (le if n == below else lo + (le - lo) * (rank - below) / (n - below))
        lo, below = le, n
    return lo


def _buckets(m: dict, name: str) -> list[tuple[float, float]]:
    rows = [(float(dict(k[1])["le"]), v) for k, v in m.items()
            if k[0] == f"deepinfer:{name}_bucket" and dict(k[1])["model_name"] == MODEL]
    return sorted(rows)


def test_dashboard_in_chromium_matches_metrics(server, tmp_path):
    exe = find_chromium()
    if exe is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium); the dashboard's browser test "
                    "needs a real browser")
    from openai import AsyncOpenAI

    wait_idle(server)
    page_values = ("generation_tokens", "prompt_tokens", "requests_finished", "errors_total", "preemptions",
                   "in_flight", "running", "ttft_p50", "ttft_p99", "itl_p50", "e2e_p99", "kv_usage", "mem_weights")
    read_js = "JSON.stringify(Object.fromEntries([...document.querySelectorAll('[data-k]')].map(" \
              "e => [e.dataset.k, e.dataset.v === '' || e.dataset.v === undefined ? null : e.dataset.v])))"

    async def go():
        async with Browser(exe, str(tmp_path / "profile")) as b:
            await b.goto(f"{server.url}/dashboard?key={API_KEY}&interval=250")
            await b.wait_for("window.__dash && window.__dash.polls >= 2")
            assert await b.eval("location.pathname + location.search") == "/dashboard?interval=250"
            before = json.loads(await b.eval(read_js))
            seen_busy = []

            async def traffic():
                async with AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
                    async def one(i):
                        stream = await c.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": f"{MARKER} request {i}"}],
                            max_tokens=40, stream=True, extra_body={"ignore_eos": True})
                        async for _ in stream:
                            pass
                    # rounds of 12 until the page has shown one in flight: a fast machine may finish a round
                    # between two polls of the page
                    for round_ in range(10):
                        await asyncio.gather(*[one(12 * round_ + i) for i in range(12)])
                        if seen_busy:
                            break
                    with pytest.raises(Exception):  # one error reply, counted by type
                        await c.completions.create(model=MODEL, prompt="x", max_tokens=0)

            async def watch(task):
                while not task.done():
                    now = json.loads(await b.eval(read_js))
                    if float(now["in_flight"] or 0) > 0:
                        seen_busy.append(now)
                    await asyncio.sleep(0.1)

            task = asyncio.create_task(traffic())
            await asyncio.gather(task, watch(task))
            await asyncio.get_running_loop().run_in_executor(None, wait_idle, server)
            polls = await b.eval("window.__dash.polls")
            await b.wait_for(f"window.__dash.polls >= {polls + 2}")
            async with aiohttp.ClientSession(server.url) as s:
                async with s.get("/metrics") as r:
                    metrics = parse_metrics(await r.text())
                async with s.get("/dashboard/data", headers=AUTH) as r:
                    data_text = await r.text()
            after = json.loads(await b.eval(read_js))
            page_text = await b.eval("document.body.innerText")
            size = await b.screenshot(str(tmp_path / "dashboard.png"))
            return before, after, seen_busy, metrics, data_text, page_text, size

    before, after, seen_busy, m, data_text, page_text, size = asyncio.run(go())
    assert set(page_values) <= set(after)
    # the page changed while traffic ran, and saw it in flight
    assert seen_busy, "the page never showed a request in flight during the traffic"
    assert float(after["generation_tokens"]) >= float(before["generation_tokens"]) + 12 * 40
    # ... and once it stopped, shows /metrics' numbers
    one = lambda name: m[(f"deepinfer:{name}", LABEL)]  # noqa: E731
    assert float(after["generation_tokens"]) == one("generation_tokens_total")
    assert float(after["prompt_tokens"]) == one("prompt_tokens_total")
    finished = sum(v for k, v in m.items() if k[0] == "deepinfer:request_success_total")
    assert float(after["requests_finished"]) == finished
    errors = sum(v for k, v in m.items() if k[0] == "deepinfer:request_errors_total")
    assert float(after["errors_total"]) == errors and errors >= 1
    assert float(after["preemptions"]) == one("num_preemptions_total")
    assert float(after["in_flight"]) == one("num_requests_in_flight") == 0
    assert float(after["kv_usage"]) == pytest.approx(100 * one("kv_cache_usage_perc"))
    assert float(after["mem_weights"]) * 2**30 == pytest.approx(
        m[("deepinfer:device_memory_bytes", (("kind", "weights"), ("model_name", MODEL)))])
    for key, name, q in (("ttft_p50", "time_to_first_token_seconds", 0.5),
                         ("ttft_p99", "time_to_first_token_seconds", 0.99),
                         ("itl_p50", "inter_token_latency_seconds", 0.5),
                         ("e2e_p99", "e2e_request_latency_seconds", 0.99)):
        assert float(after[key]) == pytest.approx(_quantile(q, _buckets(m, name))), key
    # no prompt text anywhere, and a real screenshot
    assert MARKER not in page_text and MARKER not in data_text
    assert "generation tokens" in page_text and size > 20_000
    print(f"dashboard screenshot: {tmp_path / 'dashboard.png'}")
