"""Shared e2e helpers (a uniquely named module: test files import from here, not from conftest)."""

from __future__ import annotations

import asyncio
import threading

API_KEY = "sk-test-key"
MODEL = "scripted"
SERVER_FLAGS = ["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
                "--page-size", "8", "--max-queue-len", "64", "--dtype", "float32", "--api-key", API_KEY,
                "--reasoning-parser", "deepseek_r1", "--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice",
                "--max-payload-size", str(2**20), "--shutdown-timeout", "5", "--served-model-name", MODEL,
                "other-name"]


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
