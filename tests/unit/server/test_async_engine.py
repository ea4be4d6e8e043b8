"""AsyncEngine over a fake LLMEngine: deltas, n, abort, admission, step failures, idle sleeping, shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer_jax.engine.async_engine import (AsyncEngine, EngineNotReadyError, EngineStepError,
                                               QueueFullError)
from deepinfer_jax.types import SamplingParams
from fake_engine import FakeEngine


def _engine(**kw):
    fake = FakeEngine(**{k: v for k, v in kw.items() if k != "max_queue_len"})
    eng = AsyncEngine(lambda: fake, max_queue_len=kw.get("max_queue_len")).start()
    assert eng.wait_ready(5)
    return eng, fake


def test_deltas_concatenate_to_the_whole_output():
    eng, _ = _engine()

    async def go():
        outs = [o async for o in eng.submit("a", [5], SamplingParams(max_tokens=4, logprobs=1))]
        return outs

    outs = asyncio.run(go())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    text = "".join(o.outputs[0].text for o in outs)
    ids = sum((o.outputs[0].token_ids for o in outs), [])
    lps = sum((o.outputs[0].logprobs for o in outs), [])
    assert text == "t6 t7 t8 t9 " and ids == [6, 7, 8, 9] and len(lps) == 4
    assert outs[-1].outputs[0].finish_reason == "length"
    eng.shutdown()


def test_n_children_and_stop_token():
    eng, _ = _engine()

    async def go():
        return [o async for o in eng.submit("a", [5], SamplingParams(n=2, max_tokens=9, stop_token_ids=[8]))]

    outs = asyncio.run(go())
    by_index: dict[int, list] = {}
    for o in outs:
        for c in o.outputs:
            by_index.setdefault(c.index, []).append(c)
    assert sorted(by_index) == [0, 1]
    for cs in by_index.values():
        assert sum((c.token_ids for c in cs), []) == [6, 7, 8] and cs[-1].finish_reason == "stop"
    eng.shutdown()


def test_leaving_early_aborts_and_frees():
    eng, fake = _engine(step_delay=0.005)

    async def go():
        stream = eng.submit("a", [5], SamplingParams(max_tokens=60))
        async for _ in stream:
            break
        stream.abort()
        for _ in range(200):
            if not fake.reqs:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert fake.reqs == {} and "a" in fake.aborted and eng.num_requests_in_flight == 0
    eng.shutdown()


def test_cancelled_consumer_aborts():
    eng, fake = _engine(step_delay=0.01)

    async def go():
        stream = eng.submit("a", [5], SamplingParams(max_tokens=60))

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not fake.reqs:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert fake.reqs == {} and fake.aborted == ["a"]
    eng.shutdown()


def test_queue_bound():
    eng, fake = _engine(max_num_seqs=2, max_queue_len=1, step_delay=0.01)

    async def go():
        s1 = eng.submit("a", [1], SamplingParams(max_tokens=50))
        s2 = eng.submit("b", [1], SamplingParams(max_tokens=50))
        s3 = eng.submit("c", [1], SamplingParams(max_tokens=50))
        with pytest.raises(QueueFullError):
            eng.submit("d", [1], SamplingParams(max_tokens=50))
        with pytest.raises(ValueError):
            eng.submit("a", [1], SamplingParams(max_tokens=5))
        s3.abort()
        s4 = eng.submit("d", [1], SamplingParams(max_tokens=2))  # room again
        outs = [o async for o in s4]
        s1.abort()
        s2.abort()
        return outs

    assert asyncio.run(go())[-1].finished
    eng.shutdown()


def test_best_of_counts_its_sequences():
    """best_of samples best_of sequences (and returns n): admission counts them all, and frees them all."""
    eng, fake = _engine(max_num_seqs=2, max_queue_len=1, step_delay=0.01)

    async def go():
        with pytest.raises(ValueError, match="4 sequences can never be admitted"):
            eng.submit("a", [1], SamplingParams(max_tokens=50, best_of=4))
        s1 = eng.submit("a", [1], SamplingParams(max_tokens=50, best_of=2))
        with pytest.raises(QueueFullError):
            eng.submit("b", [1], SamplingParams(max_tokens=50, best_of=2))
        assert s1.num_seqs == 1
        s1.abort()
        eng.submit("b", [1], SamplingParams(max_tokens=50, best_of=3)).abort()  # all 3 free again

    asyncio.run(go())
    eng.shutdown()


def test_bad_request_reaches_the_stream_and_the_loop_survives():
    eng, fake = _engine()

    async def go():
        fake.add_request("dup", [1], SamplingParams(max_tokens=50))  # the engine already holds this id
        with pytest.raises(ValueError, match="already in flight"):
            async for _ in eng.submit("dup", [1], SamplingParams(max_tokens=2)):
                pass
        return [o async for o in eng.submit("ok", [1], SamplingParams(max_tokens=2))]

    assert asyncio.run(go())[-1].finished
    eng.shutdown()


def test_step_failure_fails_in_flight_requests_then_recovers():
    eng, fake = _engine(step_delay=0.01)

    async def go():
        s1 = eng.submit("a", [1], SamplingParams(max_tokens=40))
        s2 = eng.submit("b", [1], SamplingParams(max_tokens=40))
        await asyncio.sleep(0.05)
        fake.fail_next_step = True
        for s in (s1, s2):
            with pytest.raises(EngineStepError, match="injected"):
                async for _ in s:
                    pass
        assert not eng.healthy
        outs = [o async for o in eng.submit("c", [1], SamplingParams(max_tokens=2))]
        return outs

    assert asyncio.run(go())[-1].finished
    assert eng.healthy and fake.reqs == {}
    eng.shutdown()


def test_idle_loop_sleeps():
    eng, fake = _engine()
    time.sleep(0.2)
    checks = fake.idle_checks
    time.sleep(0.3)
    assert fake.idle_checks == checks and fake.steps == 0
    eng.shutdown()
    assert not eng.thread_alive


def test_not_ready_and_startup_failure():
    import threading

    gate = threading.Event()

    def slow_build():
        gate.wait(5)
        raise RuntimeError("no weights")

    eng = AsyncEngine(slow_build).start()

    async def submit():
        eng.submit("a", [1], SamplingParams())

    with pytest.raises(EngineNotReadyError, match="still starting"):
        asyncio.run(submit())
    calls = []
    eng.add_ready_callback(lambda: calls.append(1))
    gate.set()
    assert eng.wait_ready(5) is False and isinstance(eng.startup_error, RuntimeError)
    assert calls == [1]
    with pytest.raises(EngineNotReadyError, match="failed to start"):
        asyncio.run(submit())


def test_shutdown_ends_open_streams():
    eng, fake = _engine(step_delay=0.01)

    async def go():
        s = eng.submit("a", [1], SamplingParams(max_tokens=60))
        await asyncio.sleep(0.03)
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineNotReadyError):
            async for _ in s:
                pass

    asyncio.run(go())
    assert fake.reqs == {}


def test_a_slow_consumer_gets_merged_deltas():
    eng, fake = _engine()

    async def go():
        stream = eng.submit("a", [5], SamplingParams(max_tokens=6, logprobs=1))
        for _ in range(400):  # let all six deltas reach the stream's queue before the first read
            if not fake.reqs and stream._queue.qsize() >= 6:
                break
            await asyncio.sleep(0.005)
        return [o async for o in stream]

    outs = asyncio.run(go())
    assert len(outs) == 1 and outs[0].finished
    c = outs[0].outputs[0]
    assert c.text == "t6 t7 t8 t9 t10 t11 " and c.token_ids == [6, 7, 8, 9, 10, 11] and len(c.logprobs) == 6
    assert c.finish_reason == "length"
    eng.shutdown()


def test_call_runs_on_the_loop_thread_between_steps():
    """`call` (an admin command such as POST /admin/rebalance_experts): fn(engine) on the loop thread, while requests
    are running, its result or its exception back to the awaiting coroutine; refused once shut down."""
    import threading

    eng, fake = _engine(step_delay=0.005)

    async def go():
        stream = eng.submit("a", [5], SamplingParams(max_tokens=20))
        first = await stream.__anext__()
        got = await eng.call(lambda e: (e is fake, threading.current_thread().name))

        def fails(e):
            raise ValueError("no expert load observed yet")

        with pytest.raises(ValueError, match="no expert load"):
            await eng.call(fails)
        rest = [o async for o in stream]
        return first, got, rest

    first, got, rest = asyncio.run(go())
    assert got == (True, "deepinfer-engine") and not first.finished and rest[-1].finished
    eng.shutdown()
    with pytest.raises(EngineNotReadyError):
        asyncio.run(eng.call(lambda e: None))


@pytest.mark.parametrize("log_stats", [True, False])
def test_periodic_stats_line_unless_disabled(log_stats, monkeypatch, caplog):
    """The engine loop's periodic line (running / waiting, KV cache) while requests run; `log_stats=False` (serve
    --disable-log-stats) writes none."""
    from deepinfer_jax.engine import async_engine

    monkeypatch.setattr(async_engine, "STATS_LOG_INTERVAL_S", 0.0)
    fake = FakeEngine(step_delay=0.002)
    eng = AsyncEngine(lambda: fake, log_stats=log_stats).start()
    assert eng.wait_ready(5)

    async def go():
        return [o async for o in eng.submit("a", [5], SamplingParams(max_tokens=8))]

    with caplog.at_level("INFO", logger="deepinfer_jax.engine.async_engine"):
        asyncio.run(go())
    eng.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("running ")]
    assert bool(lines) == log_stats
