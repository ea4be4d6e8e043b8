"""Live-server fixtures: one real server (real HTTP on 127.0.0.1, a free port) for the whole session,
run in-process on a background thread over the scripted checkpoint (scripted.py), so tests can also
look at engine internals (block usage) and inject faults. A session-wide XLA cache lets the second
engine (test_engine_direct.py) and the CLI subprocesses skip compilation.

Server flags: --max-model-len 512 --max-num-seqs 16 --max-num-batched-tokens 64 --page-size 8
--max-queue-len 64 --api-key API_KEY --reasoning-parser deepseek_r1 --tool-call-parser deepseek_v3
--max-payload-size 1 MiB.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

API_KEY = "sk-test-key"
MODEL = "scripted"
SERVER_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                "--page-size", "8", "--max-queue-len", "64", "--dtype", "float32", "--api-key", API_KEY,
                "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "deepseek_v3",
                "--max-payload-size", str(2**20), "--shutdown-timeout", "5", "--served-model-name", MODEL,
                "other-name"]


@pytest.fixture(scope="session")
def xla_cache_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("xla_cache"))
    os.environ["DEEPINFER_CACHE_DIR"] = d
    return d


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory):
    """(model dir, {script token string: id})."""
    from scripted import build_scripted_model

    d = str(tmp_path_factory.mktemp("scripted-model"))
    return d, build_scripted_model(d)


class ServerThread:
    """`start_server` on its own event loop in a daemon thread; `stop()` drains like SIGTERM does."""

    def __init__(self, argv: list[str]):
        from deepinfer_jax.cli import _serve_parser

        self.ns = _serve_parser().parse_args(argv)
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.error: BaseException | None = None
        self.server = None
        self.thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def _run(self) -> None:
        from deepinfer_jax.server.app import start_server

        asyncio.set_event_loop(self.loop)
        try:
            self.server = self.loop.run_until_complete(start_server(self.ns))
        except BaseException as e:  # noqa: BLE001
            self.error = e
        self._started.set()
        if self.error is None:
            self.loop.run_forever()

    def start(self, timeout: float = 300) -> "ServerThread":
        self.thread.start()
        self._started.wait(timeout)
        if self.error is not None:
            raise self.error
        assert self.server.engine.wait_ready(timeout), self.server.engine.startup_error
        return self

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def engine(self):
        return self.server.engine


@pytest.fixture(scope="session")
def server(scripted_model, xla_cache_dir):
    model_dir, _ = scripted_model
    st = ServerThread(["--model", model_dir, "--port", "0", *SERVER_FLAGS]).start()
    yield st
    st.stop()


@pytest.fixture(scope="session")
def tokenizer(scripted_model):
    from deepinfer_jax.text import load_tokenizer

    return load_tokenizer(scripted_model[0])


@pytest.fixture
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


def wait_idle(server, timeout: float = 10.0) -> None:
    """Wait until the engine has nothing in flight (requests finish asynchronously after a response)."""
    import time

    deadline = time.time() + timeout
    while time.time() < deadline:
        st = server.engine.stats
        if server.engine.num_requests_in_flight == 0 and st.num_running == 0 and st.num_waiting == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {server.engine.stats}")


def parse_metrics(text: str) -> dict[tuple, float]:
    """Prometheus text -> {(sample name, ((label, value), ...) sorted): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
