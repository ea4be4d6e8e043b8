"""Speculative decoding's metrics (vLLM's spec_decode_* names under deepinfer:) and the periodic log line's mean
acceptance length, from the engine's stats snapshots."""

import dataclasses

from deepinfer_jax.engine.async_engine import stats_line
from deepinfer_jax.engine.speculative import SpecDecodeStats
from deepinfer_jax.scheduler.scheduler import SchedulerStats
from deepinfer_jax.server.metrics import ServerMetrics


def _stats(spec):
    return SchedulerStats(num_running=2, num_waiting=0, kv_cache_usage=0.25, prefix_cache_queries=0,
                          prefix_cache_hits=0, num_preemptions=0, spec_decode=spec)


def _value(text: str, name: str) -> float:
    line = next(l for l in text.splitlines() if l.startswith(name + "{") or l.startswith(name + " "))
    return float(line.rsplit(" ", 1)[1])


def test_counters_follow_the_snapshots():
    m = ServerMetrics("m")
    first = SpecDecodeStats(3, num_drafts=4, num_draft_tokens=10, num_accepted_tokens=5,
                            num_accepted_tokens_per_pos=[3, 2, 0])
    m.render(_stats(first), 0)
    later = dataclasses.replace(first, num_drafts=6, num_draft_tokens=15, num_accepted_tokens=9,
                                num_accepted_tokens_per_pos=[5, 3, 1])
    text = m.render(_stats(later), 0).decode()
    assert _value(text, "deepinfer:spec_decode_num_drafts_total") == 6
    assert _value(text, "deepinfer:spec_decode_num_draft_tokens_total") == 15
    assert _value(text, "deepinfer:spec_decode_num_accepted_tokens_total") == 9
    assert 'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    assert 'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 5.0' in text


def test_log_line_gives_the_mean_acceptance_length_of_its_interval():
    a = SpecDecodeStats(2, num_drafts=10, num_draft_tokens=20, num_accepted_tokens=10)
    assert "mean acceptance length 2.00, accepted 10 of 20 draft tokens (50.0%)" in stats_line(_stats(a), None)
    b = dataclasses.replace(a, num_drafts=20, num_draft_tokens=40, num_accepted_tokens=25)
    assert "mean acceptance length 2.50, accepted 15 of 20" in stats_line(_stats(b), a)
    assert "spec decode" not in stats_line(_stats(None), None)


def test_log_line_gives_the_steps_of_its_interval():
    line = stats_line(_stats(None), None, (40, 1.0, 0.25))
    assert "40 steps of 25.0 ms (6.2 ms of it waiting for the device)" in line
    assert "steps" not in stats_line(_stats(None), None, (0, 0.0, 0.0))  # an interval without steps says nothing
