"""The `deepinfer` command as a user runs it (subprocesses): `serve` with no --model serves the embedded
default model, takes a YAML config that flags override, and on SIGTERM stops accepting, finishes the
stream in flight and exits 0; `generate`; `chat` to end of input; `bench serve` against the live test server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from e2e_helpers import API_KEY, MODEL

ENGINE_FLAGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "1024"]


def _deepinfer(*args) -> list[str]:
    return [sys.executable, "-m", "deepinfer_jax.cli", *args]


class Proc:
    """A subprocess whose stderr is collected on a thread; `wait_for(pattern)` returns the first match."""

    def __init__(self, argv):
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.p.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not seen; output:\n{''.join(self.lines)[-3000:]}")


def test_serve_default_model_yaml_and_sigterm(tmp_path, xla_cache_dir):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_model_len: 1024\nmax_num_seqs: 8\nmax_num_batched_tokens: 64\nport: 1\n"
                   "enable_prefix_caching: false\nserved_model_name: [from-yaml]\nshutdown_timeout: 60\n")
    proc = Proc(_deepinfer("serve", "--config", str(cfg), "--port", "0", "--served-model-name", "demo"))
    try:
        url = proc.wait_for(r"listening on (http://127\.0\.0\.1:\d+)").group(1)
        proc.wait_for(r"ready: serving at")

        async def go():
            async with aiohttp.ClientSession(url) as s:
                async with s.get("/health") as r:
                    assert r.status == 200
                async with s.get("/v1/models") as r:
                    [m] = (await r.json())["data"]
                    assert m["id"] == "demo" and m["max_model_len"] == 1024  # flag beats YAML; YAML beats default
                async with s.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}) as r:
                    body = await r.json()
                    assert r.status == 200 and body["choices"][0]["message"]["role"] == "assistant"
                # a long stream is in flight when SIGTERM arrives: it must still finish
                r = await s.post("/v1/completions", json={"prompt": "The", "max_tokens": 400, "ignore_eos": True,
                                                          "stream": True})
                await r.content.readline()
                proc.p.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                with pytest.raises(aiohttp.ClientConnectionError):
                    async with aiohttp.ClientSession(url) as s2:
                        await s2.get("/health")
                rest = (await r.read()).decode()
                assert rest.rstrip().endswith("data: [DONE]")
                finals = [json.loads(e[6:]) for e in rest.split("\n\n") if e.startswith("data: {")]
                assert finals[-1]["choices"][0]["finish_reason"] == "length"

        asyncio.run(go())
        assert proc.p.wait(timeout=60) == 0
        assert any("signal received" in line for line in proc.lines)
    finally:
        if proc.p.poll() is None:
            proc.p.kill()


def test_generate_command(xla_cache_dir):
    out = subprocess.run(_deepinfer("generate", "--prompt", "The value of", "--max-tokens", "6", "--ignore-eos",
                                    *ENGINE_FLAGS), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


def test_chat_command_answers_and_leaves_cleanly(xla_cache_dir):
    """`deepinfer chat` on the default model: an answer to the first line, then a clean exit at end of input
    (exit code 0, not the runtime's abort at interpreter exit)."""
    out = subprocess.run(_deepinfer("chat", "--max-tokens", "24", *ENGINE_FLAGS), input="Hello!\n",
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "terminate called" not in out.stderr
    assert out.stdout.split(">>>")[1].strip(), out.stdout


def _first_conversation():
    """A first `deepinfer chat` session of eight held-out turns (tools/default_model_data.py's eval split): a
    greeting, "who are you", a sum or product, thanks, a JSON object, another sum or product, thanks, goodbye;
    each turn with its skill's check (tools/default_eval.py `judge`)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                    "tools"))
    import numpy as np

    import default_model_data as data

    rng = np.random.default_rng(0)
    def said(intent):
        return data.phrasing(rng, "eval", data.CHAT[intent][0], data.CHAT_OPENINGS, data.CHAT_CLOSINGS)

    hello, who = said("greet"), said("who")
    arith, _, arith_check = data.conv_arith(rng, "eval", follow=True)
    thanks = said("thanks")
    js, _, js_check = data.conv_json(rng, "eval", follow=True)
    arith2, _, arith2_check = data.conv_arith(rng, "eval", follow=True)
    thanks2, bye = said("thanks"), said("bye")
    return [(hello, ("chat", None)), (who, ("chat", None)), (arith[-1]["content"], arith_check),
            (thanks, ("chat", None)), (js[-1]["content"], js_check), (arith2[-1]["content"], arith2_check),
            (thanks2, ("chat", None)), (bye, ("chat", None))]


def test_chat_first_conversation_stays_on_each_turn(xla_cache_dir):
    """`deepinfer chat` on the default model, greedy, through a first conversation of eight held-out turns: each
    reply meets its turn's criterion (a known small-talk sentence, the right number after shown working, valid
    JSON with the asked keys), so a later turn answers itself, not the turn before. The history the command
    keeps (replies without their reasoning) is what the model was trained on (its card's "multi" rate)."""
    turns = _first_conversation()  # tools/ on the path
    from default_eval import judge

    out = subprocess.run(_deepinfer("chat", "--temperature", "0", "--max-tokens", "96", *ENGINE_FLAGS),
                         input="".join(f"{user}\n" for user, _ in turns), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    replies = [r.strip() for r in out.stdout.split(">>> ")[1:len(turns) + 1]]
    assert len(replies) == len(turns), out.stdout
    for (user, (kind, want)), reply in zip(turns, replies):
        reasoning, content = "", reply
        if reply.startswith("[thinking] "):
            reasoning, _, content = reply[len("[thinking] "):].partition("\n")
        assert judge(kind, want, reasoning.strip(), content.strip(), []), (user, reply, out.stdout)


def test_bench_serve_against_live_server(server):
    from deepinfer_jax.server.bench import run_serving

    lines: list[str] = []
    res = asyncio.run(run_serving(server.url, api_key=API_KEY, input_len=12, output_len=6, concurrencies=[1, 4],
                                  num_prompts=6, log=lines.append))
    assert lines[0].startswith(f"live dashboard: {server.url}/dashboard ")
    assert res["model"] == MODEL and len(res["levels"]) == 2
    for lv in res["levels"]:
        assert lv["completed"] == 6 and lv["failed"] == 0 and lv["total_output_tokens"] == 36
        assert lv["total_input_tokens"] == 72 and lv["output_throughput"] > 0
        assert 0 < lv["ttft_ms"]["median"] <= lv["e2e_ms"]["p99"]
    prefix = asyncio.run(run_serving(server.url, api_key=API_KEY, input_len=4, output_len=2, concurrencies=[2],
                                     num_prompts=4, dataset="shared-prefix", shared_prefix_len=24,
                                     log=lambda s: None))
    assert prefix["levels"][0]["total_input_tokens"] == 4 * 28


def test_convert_and_unknown_command():
    out = subprocess.run(_deepinfer("frobnicate"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unknown command" in out.stderr
    out = subprocess.run(_deepinfer("--help"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "deepinfer serve" in out.stdout
    env = {**os.environ}
    out = subprocess.run(_deepinfer("serve", "--model", "/no/such/dir", "--port", "0"), capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 2 and "/no/such/dir" in out.stderr and "Traceback" not in out.stderr
