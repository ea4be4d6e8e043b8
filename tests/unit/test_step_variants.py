"""The host picks a step's variant (runner/inputs.py: needs_full_variant): the base variant leaves
penalties, the top-k / top-p sort and logprobs out of the compiled step, so it must only be chosen
when no request of the step uses them."""

from __future__ import annotations

import pytest

from deepinfer_jax.runner.inputs import needs_full_variant
from deepinfer_jax.types import Request, SamplingParams


@pytest.mark.parametrize("kw, full", [
    ({}, False),
    ({"temperature": 0.0}, False),
    ({"temperature": 1.0, "min_p": 0.1}, False),  # min-p needs no sort: in the base variant
    ({"temperature": 0.7, "top_p": 0.9}, True),
    ({"temperature": 1.0, "top_k": 20}, True),
    ({"temperature": 1.0, "top_k": -1}, False),  # -1 = off
    ({"temperature": 0.0, "top_p": 0.5}, False),  # greedy ignores truncation
    ({"presence_penalty": 0.5}, True),
    ({"frequency_penalty": -0.2}, True),
    ({"repetition_penalty": 1.1}, True),
    ({"logprobs": 0}, True),
])
def test_needs_full_variant(kw, full):
    assert needs_full_variant(Request("r", [1, 2], SamplingParams(**kw))) is full


def test_prefill_buckets_say_whether_the_step_has_cached_context():
    """build_metadata(mark_context=True) (RunnerConfig.prefill_context_variant): a prefill bucket (more token
    slots than sequence rows) marks a step with any sequence past position 0 (a later chunk, a prefix-cache
    hit, a decode) as having context, and only a step of fresh prompts as not; decode buckets and unmarked
    steps leave it to the device (None), so that they keep one program."""
    from deepinfer_jax.runner.inputs import Shapes, build_metadata
    from deepinfer_jax.scheduler.scheduler import ScheduledSeq

    shapes = Shapes(buckets=(4, 16), max_num_seqs=4, max_pages=4, page_size=4, max_model_len=16)

    def seq(start, n):
        return ScheduledSeq("r", list(range(1, n + 1)), start, [1, 2, 3, 4], True, 0)

    fresh, later_chunk, decode = seq(0, 5), seq(4, 3), seq(9, 1)
    assert build_metadata([fresh, seq(0, 2)], shapes, 16, mark_context=True).has_context is False
    assert build_metadata([fresh, later_chunk], shapes, 16, mark_context=True).has_context is True
    assert build_metadata([decode], shapes, 16, mark_context=True).has_context is True
    assert build_metadata([], shapes, 16, mark_context=True).has_context is False  # warm-up's padding step
    assert build_metadata([decode, seq(3, 1)], shapes, 4, mark_context=True).has_context is None  # decode bucket
    assert build_metadata([fresh, later_chunk], shapes, 16).has_context is None
