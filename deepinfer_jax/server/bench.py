"""`deepinfer bench`: the benchmark protocols of BENCHMARKS.md.

    deepinfer bench serve --base-url http://127.0.0.1:8000 [--input-len 512 --output-len 128]
        [--max-concurrency 1,8,32,128] [--num-prompts N] [--request-rate inf] [--dataset random|shared-prefix]
    deepinfer bench offline ...      Protocol A: runs benchmarks/offline.py (source checkouts only)

Protocol B (serving), like `vllm bench serve` / `sglang.bench_serving`: prompts of exactly
--input-len tokens (random English words, tokenized by the server's /tokenize, sent as token ids so
the length is exact; or, with --vocab-size, random ids as vLLM's random dataset draws them),
--output-len tokens each with ignore_eos, streamed from /v1/completions. For
each concurrency cap (and a Poisson --request-rate, or all at once with inf) it reports request
throughput, output and total tokens/s, and TTFT, TPOT ((e2e - ttft) / (tokens - 1)), ITL (gaps
between streamed chunks) and E2E latency: mean, median and p99, in milliseconds.
Protocol C (--dataset shared-prefix): every prompt is one shared prefix of --shared-prefix-len tokens
plus --input-len unique tokens; compare TTFT with the server's prefix caching on and off.

`benchmarks/serving.py` calls `main`; `run_serving(...)` returns the figures as a dict.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

WORDS = ("the of and to in is was for that with as on by at from his her an which or be are this had not it "
         "were but they have one all their there been has when who more will would no if out so said what up "
         "its about into than them can only other new some could time these two may then first any like now "
         "my such make over our even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good very world still "
         "own see men work long get here between both life being under never day same another know while last "
         "might us great old year off come since against go came right used take three small house water").split()


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def _tokenize(session, base: str, text: str, headers) -> list[int]:
    async with session.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                            headers=headers) as r:
        r.raise_for_status()
        return (await r.json())["tokens"]


async def make_prompts(session, base: str, headers, *, num: int, input_len: int, dataset: str, prefix_len: int,
                       seed: int, vocab_size: int | None = None) -> list[list[int]]:
    """Prompts of token ids: random English words tokenized by the server, or with `vocab_size` random
    ids in [100, vocab_size) (vLLM's random dataset; for dummy weights, where words would all be rare)."""
    rng = random.Random(seed)

    async def ids(n: int) -> list[int]:
        if vocab_size:
            return [rng.randrange(min(100, vocab_size - 1), vocab_size) for _ in range(n)]
        out: list[int] = []
        while len(out) < n:
            out += await _tokenize(session, base, " ".join(rng.choice(WORDS) for _ in range(n)), headers)
        return out[:n]

    prefix = await ids(prefix_len) if dataset == "shared-prefix" else []
    return [prefix + await ids(input_len) for _ in range(num)]


async def one_request(session, base: str, headers, model: str, prompt: list[int], output_len: int,
                      temperature: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True,
            "temperature": temperature, "stream_options": {"include_usage": True}}
    res = Result(ok=False, prompt_tokens=len(prompt))
    t0 = last = time.perf_counter()
    try:
        async with session.post(base + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.e2e = time.perf_counter() - t0
        res.ok = True
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        res.error = f"{type(e).__name__}: {e}"
    return res


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(xs)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    return {"mean": 1000 * statistics.fmean(s), "median": 1000 * statistics.median(s), "p99": 1000 * p99}


def summarize(results: list[Result], duration: float, concurrency: int | None) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "max_concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]), "e2e_ms": _stats([r.e2e for r in ok]),
    }


async def run_level(session, base, headers, model, prompts, output_len, temperature, concurrency: int | None,
                    request_rate: float, seed: int) -> dict:
    sem = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)

    async def limited(p):
        async with sem:
            return await one_request(session, base, headers, model, p, output_len, temperature)

    t0 = time.perf_counter()
    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(limited(p)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return summarize(results, time.perf_counter() - t0, concurrency)


async def run_serving(base_url: str, *, model: str | None = None, api_key: str | None = None, input_len: int = 512,
                      output_len: int = 128, concurrencies=(1, 8, 32, 128), num_prompts: int | None = None,
                      request_rate: float = float("inf"), dataset: str = "random", shared_prefix_len: int = 2048,
                      temperature: float = 0.0, seed: int = 0, vocab_size: int | None = None, log=print) -> dict:
    import aiohttp

    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = _headers(api_key)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        if model is None:
            async with session.get(base + "/v1/models", headers=headers) as r:
                r.raise_for_status()
                model = (await r.json())["data"][0]["id"]
        log(f"live dashboard: {base}/dashboard" + (" (with an API key: open /dashboard?key=KEY once)" if api_key else ""))
        levels = []
        for c in concurrencies:
            n = num_prompts or max(4 * (c or 1), 16)
            prompts = await make_prompts(session, base, headers, num=n, input_len=input_len, dataset=dataset,
                                         prefix_len=shared_prefix_len, seed=seed + (c or 0), vocab_size=vocab_size)
            await one_request(session, base, headers, model, prompts[0], min(output_len, 4), temperature)  # warm-up
            level = await run_level(session, base, headers, model, prompts, output_len, temperature, c,
                                    request_rate, seed)
            log(format_level(level))
            levels.append(level)
    return {"base_url": base, "model": model, "dataset": dataset, "input_len": input_len, "output_len": output_len,
            "shared_prefix_len": shared_prefix_len if dataset == "shared-prefix" else 0,
            "request_rate": request_rate, "levels": levels}


def format_level(s: dict) -> str:
    f = lambda d: f"{d['mean']:.1f}/{d['median']:.1f}/{d['p99']:.1f}"  # noqa: E731
    return (f"concurrency {s['max_concurrency']}: {s['completed']} ok, {s['failed']} failed in "
            f"{s['duration_s']:.2f} s | {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s, "
            f"{s['total_token_throughput']:.1f} total tok/s | ms mean/median/p99: TTFT {f(s['ttft_ms'])}, "
            f"TPOT {f(s['tpot_ms'])}, ITL {f(s['itl_ms'])}, E2E {f(s['e2e_ms'])}"
            + (f" | errors: {s['errors']}" if s["errors"] else ""))


def _base_url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// URL, got {text!r}")
    return text.rstrip("/")


def _concurrencies(text: str) -> list[int]:
    from deepinfer_jax.server.args import positive_int

    out = [positive_int(x.strip()) for x in text.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}")
    return out


def _serve_main(argv: list[str]) -> int:
    from deepinfer_jax.server.args import ArgParser, nonnegative_float, nonnegative_int, positive_float, positive_int

    p = ArgParser(prog="deepinfer bench serve", description="Protocol B / C against a running server")
    p.add_argument("--base-url", type=_base_url, default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"))
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--input-len", type=positive_int, default=512)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--shared-prefix-len", type=nonnegative_int, default=2048)
    p.add_argument("--max-concurrency", type=_concurrencies, default=[1, 8, 32, 128], help="comma-separated sweep")
    p.add_argument("--num-prompts", type=positive_int, default=None,
                   help="per level (default max(4 x concurrency, 16))")
    p.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="Poisson rate in req/s (inf: burst)")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=positive_int, default=None,
                   help="prompts of random ids below this instead of tokenized words (dummy weights)")
    p.add_argument("--result-file", default=None, help="write the figures as JSON")
    a = p.parse_args(argv)
    import aiohttp

    try:
        out = asyncio.run(run_serving(a.base_url, model=a.model, api_key=a.api_key, input_len=a.input_len,
                                      output_len=a.output_len, concurrencies=a.max_concurrency,
                                      num_prompts=a.num_prompts, request_rate=a.request_rate, dataset=a.dataset,
                                      shared_prefix_len=a.shared_prefix_len, temperature=a.temperature, seed=a.seed,
                                      vocab_size=a.vocab_size))
    except (aiohttp.ClientError, OSError) as e:  # no server there, or it refused the set-up requests
        print(f"deepinfer bench serve: error: {a.base_url}: {e}", file=sys.stderr)
        return 1
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(lv["failed"] == 0 for lv in out["levels"]) else 1


def _offline_main(argv: list[str]) -> int:
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "benchmarks", "offline.py")
    if not os.path.isfile(path):
        print("deepinfer bench offline: error: Protocol A needs benchmarks/offline.py from a source checkout of "
              "deepinfer-jax", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("deepinfer_offline_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return int(mod.main(argv, prog="deepinfer bench offline") or 0)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "serve":
        return _serve_main(argv[1:])
    if argv and argv[0] == "offline":
        return _offline_main(argv[1:])
    if argv and argv[0] not in ("-h", "--help"):
        print(f"deepinfer bench: error: unknown benchmark {argv[0]!r} (choose from serve, offline)", file=sys.stderr)
        return 2
    print(__doc__.split("\n\n")[1], file=sys.stdout if argv else sys.stderr)
    return 0 if argv else 2
