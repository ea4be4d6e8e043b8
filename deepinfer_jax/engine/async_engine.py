"""AsyncEngine: one LLMEngine on one loop thread, per-request asyncio queues for the server.

The loop thread owns every piece of engine state (scheduler, runner, detokenizers). The asyncio side
talks to it only through commands (add, abort, stop) put in a list under a condition variable; the
thread sleeps on that condition while it has nothing to do (no polling). After each step it pushes the
new output of every request onto that request's asyncio.Queue with one `loop.call_soon_threadsafe`
per step (ARCHITECTURE.md rule 7).

`submit(...)` returns a `RequestStream`: an async iterator of RequestOutput *deltas* -- each
CompletionOutput carries only the text, token ids and logprobs that are new since the previous item
(finish_reason set on the last one); the final item has `finished=True`. Leaving the iteration early
(break, exception, task cancelled by a client disconnect) aborts the request, which frees its KV blocks
before the next step.

Admission: requests are refused with QueueFullError when the sequences in flight (best_of's, where it is above
n) would exceed
`max_num_seqs + max_queue_len` (the ones that cannot run at once wait; this bounds the waiting
count), and with ValueError when the request alone is larger than that (it could never be admitted).
An engine step that raises fails every request in flight with EngineStepError and aborts them;
the engine keeps serving, and `healthy` is False until a step succeeds again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from deepinfer_jax.types import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)

STATS_LOG_INTERVAL_S = 10.0  # the loop's periodic stats line, while requests run


def stats_line(stats, last_spec, steps: tuple[int, float, float] | None = None) -> str:
    """The periodic log line: running / waiting sequences, KV cache use, the engine steps since the previous line
    (`steps`: their count, seconds in `step()` and seconds of those waiting for the device's results; a step that
    hardly waits found its device idle, waiting for the host) and, when speculating, the mean acceptance length since
    `last_spec` (the SpecDecodeStats of the previous line, or None)."""
    line = (f"running {stats.num_running}, waiting {stats.num_waiting}, KV cache {100 * stats.kv_cache_usage:.1f}%, "
            f"preemptions {stats.num_preemptions}")
    if steps is not None and steps[0]:
        n, seconds, waited = steps
        line += f", {n} steps of {1e3 * seconds / n:.1f} ms ({1e3 * waited / n:.1f} ms of it waiting for the device)"
    sd = stats.spec_decode
    if sd is not None:
        drafts = sd.num_drafts - (last_spec.num_drafts if last_spec else 0)
        verified = sd.num_draft_tokens - (last_spec.num_draft_tokens if last_spec else 0)
        accepted = sd.num_accepted_tokens - (last_spec.num_accepted_tokens if last_spec else 0)
        mean = 1 + accepted / drafts if drafts else 0.0
        line += (f", spec decode: mean acceptance length {mean:.2f}, accepted {accepted} of {verified} draft tokens"
                 f" ({100 * accepted / verified if verified else 0:.1f}%)")
    return line


class EngineNotReadyError(RuntimeError):
    """The engine is still loading / compiling, failed to start, or is shutting down."""


class QueueFullError(RuntimeError):
    """Too many requests are waiting (max_queue_len)."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in flight were aborted."""


class RequestStream:
    """Async iterator of RequestOutput deltas for one request (see module docstring).

    When the consumer falls behind, the deltas waiting in its queue are merged into one item, so a
    slow client costs one write per wake-up rather than one per engine step.

    Timing facts (time.time() seconds, taken on the loop thread) for metrics: `arrival_time`;
    `scheduled_time` (start of the step that produced the first output; for a prompt prefilled in
    several chunks it is the last chunk's step); `first_token_time`; `finish_time`; and
    `take_token_gaps()`, the gaps between the steps that produced tokens since the last call.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, num_seqs: int, loop: asyncio.AbstractEventLoop):
        self._engine, self.request_id, self.num_seqs = engine, request_id, num_seqs
        self.slots = num_seqs  # sequences counted against admission: best_of's, where it samples more than n
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held: BaseException | None = None
        self._gaps: list[float] = []
        self._last_token_time: float | None = None
        self.finished = False
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    # -- consumer side (event loop) ----------------------------------------------------------------
    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._held is not None:
            item, self._held = self._held, None
        else:
            if self.finished and self._queue.empty():
                raise StopAsyncIteration
            try:
                item = await self._queue.get()
            except BaseException:
                self.abort()
                raise
        if isinstance(item, BaseException):
            self.finished = True
            self._engine._forget(self)
            raise item
        while not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._held = nxt
                break
            item = _merge(item, nxt)
        if item.finished:
            self.finished = True
            self._engine._forget(self)
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def take_token_gaps(self) -> list[float]:
        gaps, self._gaps = self._gaps, []
        return gaps

    # -- producer side (loop thread) ---------------------------------------------------------------
    def _note(self, out: RequestOutput, step_start: float, now: float) -> None:
        """Record the timing facts of one engine delta (RequestOutputKind.DELTA, the kind `submit` asks for)."""
        if any(o.token_ids for o in out.outputs):
            if self.first_token_time is None:
                self.scheduled_time, self.first_token_time = step_start, now
            else:
                self._gaps.append(now - self._last_token_time)
            self._last_token_time = now
        if out.finished:
            self.finish_time = now


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one."""
    by = {c.index: c for c in a.outputs}
    for c in b.outputs:
        p = by.get(c.index)
        if p is None:
            by[c.index] = c
            continue
        lps = None if p.logprobs is None and c.logprobs is None else (p.logprobs or []) + (c.logprobs or [])
        by[c.index] = CompletionOutput(c.index, p.text + c.text, p.token_ids + c.token_ids, lps, c.finish_reason,
                                       c.stop_reason, c.cumulative_logprob)
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, b.num_cached_tokens,
                         [by[i] for i in sorted(by)], b.finished,
                         prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs)


class AsyncEngine:
    """Runs an LLMEngine on a daemon thread; see the module docstring.

    `build` returns the LLMEngine (called on the loop thread, so loading and warm-up happen there
    while the server already answers /health with 503). `max_num_seqs` defaults to the engine's.
    """

    def __init__(self, build: Callable[[], Any], *, max_queue_len: int | None = None,
                 max_num_seqs: int | None = None, log_stats: bool = True):
        self._build = build
        self.max_queue_len = max_queue_len
        self.max_num_seqs = max_num_seqs
        self.engine: Any = None
        self.ready = False
        self.startup_error: BaseException | None = None
        self.healthy = True
        self.last_error: str | None = None
        self.stats: Any = None  # the latest SchedulerStats snapshot, written by the loop thread
        self._logged_at = time.monotonic()  # the last periodic stats line (`stats_line`)
        self._logged_spec = None
        self._logged_steps = (0, 0.0, 0.0)  # the engine's step counters at the last line
        self.log_stats = log_stats  # the periodic line (serve --disable-log-stats: off)
        self._cond = threading.Condition()
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._calls: list[tuple] = []  # (fn, asyncio future, its loop): `call`, run on the loop thread between steps
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}
        self._seqs_in_flight = 0
        self._ready_event = threading.Event()
        self._ready_callbacks: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        self._thread.start()
        return self

    def add_ready_callback(self, fn: Callable[[], None]) -> None:
        """Call `fn()` on the loop thread once the engine is built or failed to build."""
        with self._cond:
            if not self._ready_event.is_set():
                self._ready_callbacks.append(fn)
                return
        fn()

    @property
    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is built (or failed to build); True when ready."""
        self._ready_event.wait(timeout)
        return self.ready

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort everything in flight and stop the loop thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests (event-loop side) --------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
               prompt: str | None = None, keep_special_tokens: tuple[str, ...] = ()) -> RequestStream:
        """Queue a request; returns its stream. Raises EngineNotReadyError, QueueFullError, ValueError."""
        if self._stopping:
            raise EngineNotReadyError("the server is shutting down")
        if not self.ready:
            raise EngineNotReadyError("the engine failed to start" if self.startup_error else
                                      "the engine is still starting (loading weights / compiling)")
        self.engine.check_held_back(params)  # LLMEngine.add_request's check, before the stream starts
        n = params.best_of or params.n  # the sequences the engine runs (best_of samples that many, returns n)
        loop = asyncio.get_running_loop()
        with self._cond:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if self.max_queue_len is not None:
                cap = (self.max_num_seqs or 0) + self.max_queue_len
                if n > cap:  # no retry could ever be admitted: not a QueueFullError (429)
                    raise ValueError(f"{n} sequences can never be admitted: at most {cap} may be in flight "
                                     f"({self.max_num_seqs} running + {self.max_queue_len} waiting)")
                if self._seqs_in_flight + n > cap:
                    raise QueueFullError(f"the request queue is full ({self.max_queue_len} sequences may wait "
                                         f"beyond the {self.max_num_seqs} running)")
            stream = RequestStream(self, request_id, params.n, loop)
            stream.slots = n
            self._streams[request_id] = stream
            self._seqs_in_flight += n
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
            self._adds.append((stream, list(prompt_token_ids), params, prompt, tuple(keep_special_tokens)))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            self._seqs_in_flight -= stream.slots
            self._aborts.append(request_id)
            self._cond.notify()

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` on the loop thread between two steps (an admin command that changes engine state, such as a
        rebalance of the experts); its result, or its exception raised here. The event loop does not wait on it."""
        if self._stopping or not self.ready or not self._thread.is_alive():
            raise EngineNotReadyError("the engine is not running")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            self._calls.append((fn, fut, loop))
            self._cond.notify()
        return await fut

    def _forget(self, stream: RequestStream) -> None:
        with self._cond:
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]
                self._seqs_in_flight -= stream.slots

    # ---- the loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._build()
            if self.max_num_seqs is None:
                self.max_num_seqs = self.engine.scheduler_config.max_num_seqs
            self.stats = self.engine.stats()
            self.ready = True
        except BaseException as e:  # noqa: BLE001 - reported through /health and the log
            # bad input (a ValueError or OSError naming it) is for the caller to report in a line; anything
            # else is a bug, logged with its traceback
            expected = isinstance(e, (ValueError, OSError))
            log.log(logging.DEBUG if expected else logging.ERROR, "engine failed to start", exc_info=True)
            self.startup_error = e
            return
        finally:
            with self._cond:
                self._ready_event.set()
                callbacks, self._ready_callbacks = self._ready_callbacks, []
            for fn in callbacks:
                try:
                    fn()
                except Exception:  # noqa: BLE001
                    log.exception("ready callback failed")
        eng = self.engine
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._calls or self._stopping
                           or eng.has_unfinished_requests()):
                    self._cond.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
                stopping = self._stopping
            for fn, fut, loop in calls:
                self._answer(eng, fn, fut, loop)
            pushes: dict[asyncio.AbstractEventLoop, list] = {}
            try:
                if not self._iteration(eng, adds, aborts, stopping, pushes):
                    return
            except Exception as e:  # noqa: BLE001 - a bug outside step(): fail what is in flight, keep going
                self._fail_all(eng, pushes, e, "engine loop error")
            finally:
                self._flush(pushes)
                try:
                    self.stats = eng.stats()
                    self._log_stats()
                except Exception:  # noqa: BLE001
                    log.exception("engine stats failed")

    @staticmethod
    def _answer(eng, fn, fut, loop) -> None:
        """Run a `call` and hand its result or exception to the awaiting event loop."""
        try:
            result, error = fn(eng), None
        except Exception as e:  # noqa: BLE001 - the caller's to report
            result, error = None, e

        def deliver():
            if not fut.done():
                fut.set_exception(error) if error is not None else fut.set_result(result)

        loop.call_soon_threadsafe(deliver)

    def _log_stats(self) -> None:
        """The periodic stats line (`stats_line`), every STATS_LOG_INTERVAL_S while requests run."""
        now = time.monotonic()
        if not self.log_stats or now - self._logged_at < STATS_LOG_INTERVAL_S or self.stats is None:
            return
        self._logged_at = now
        counters = getattr(self.engine, "step_counters", None)
        counters = counters() if counters is not None else None
        if self.stats.num_running or self.stats.num_waiting:
            steps = None if counters is None else tuple(a - b for a, b in zip(counters, self._logged_steps))
            log.info("%s", stats_line(self.stats, self._logged_spec, steps))
            self._logged_spec = getattr(self.stats, "spec_decode", None)
        if counters is not None:
            self._logged_steps = counters

    def _iteration(self, eng, adds, aborts, stopping: bool, pushes) -> bool:
        """Apply the commands and run one step; False once the loop should end."""
        for stream, ids, params, prompt, keep in adds:
            try:
                eng.add_request(stream.request_id, ids, params, prompt=prompt, keep_special_tokens=keep)
            except Exception as e:  # noqa: BLE001 - bad input reaches the client, not the loop
                self._push(pushes, stream, ValueError(str(e)) if isinstance(e, ValueError) else e)
        for rid in aborts:
            eng.abort_request(rid)
        if stopping:
            with self._cond:
                streams = list(self._streams.values())
            for stream in streams:
                eng.abort_request(stream.request_id)
                self._push(pushes, stream, EngineNotReadyError("the server is shutting down"))
            return False
        if eng.has_unfinished_requests():
            t0 = time.time()
            try:
                outputs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep the server up
                self._fail_all(eng, pushes, e, "engine step failed")
                return True
            self.healthy = True
            now = time.time()
            with self._cond:
                streams = dict(self._streams)
            for out in outputs:
                stream = streams.get(out.request_id)
                if stream is None:  # aborted by the client in the meantime
                    continue
                stream._note(out, t0, now)
                self._push(pushes, stream, out)
        return True

    def _fail_all(self, eng, pushes, e: Exception, what: str) -> None:
        with self._cond:
            streams = list(self._streams.values())
        log.exception("%s; aborting %d requests", what, len(streams))
        self.healthy, self.last_error = False, f"{type(e).__name__}: {e}"
        err = EngineStepError(f"{what}: {type(e).__name__}: {e}")
        for stream in streams:
            try:
                eng.abort_request(stream.request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failure failed")
            self._push(pushes, stream, err)

    @staticmethod
    def _push(pushes, stream: RequestStream, item) -> None:
        pushes.setdefault(stream._loop, []).append((stream._queue, item))

    @staticmethod
    def _flush(pushes) -> None:
        for loop, items in pushes.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed (shutting down)
                pass
        pushes.clear()


def _deliver(items) -> None:
    for queue, item in items:
        queue.put_nowait(item)
