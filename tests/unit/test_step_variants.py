"""The host picks a step's variant (runner/inputs.py: needs_full_variant): the base variant leaves
penalties, the top-k / top-p sort and logprobs out of the compiled step, so it must only be chosen
when no request of the step uses them."""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize("kw, full", [
    ({}, False),
    ({"temperature": 1.0, "min_p": 0.1}, False),
    ({"logprobs": 0}, True),
    ({"temperature": 0.7, "top_p": 0.9}, True),
    ({"logit_bias": {3: 5.0}}, True),
    ({"repetition_penalty": 1.1}, True),
])
def test_a_grammar_alone_needs_the_full_variant_only_without_the_mask_variant(kw, full):
    """A request with a grammar (any matcher: only its presence counts here) needs the full variant where the runner
    has no mask variant; with it, only what else it asks for decides."""
    req = Request("r", [1, 2], SamplingParams(**kw), grammar=object())
    assert needs_full_variant(req) is True
    assert needs_full_variant(req, mask_variant=True) is full


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


def test_build_metadata_lays_out_a_mixed_step():
    """A fresh prompt, a later chunk and a decode in one bucket of 16 slots (pages of 4 tokens): every real
    token's slot, position, row and cache slot, each row's page table and last token; padding slots read
    token 0 at position 0 of row 0 and write into the null page."""
    from deepinfer_jax.models.cache import NULL_PAGE
    from deepinfer_jax.runner.inputs import Shapes, build_metadata
    from deepinfer_jax.scheduler.scheduler import ScheduledSeq

    shapes = Shapes(buckets=(4, 16), max_num_seqs=4, max_pages=4, page_size=4, max_model_len=16)
    plan = [ScheduledSeq("a", [11, 12, 13, 14, 15], 0, [7, 3], True, 0),
            ScheduledSeq("b", [21, 22, 23], 4, [5, 9], False, 0),
            ScheduledSeq("c", [31], 9, [2, 6, 8], True, 5)]
    meta = build_metadata(plan, shapes, 16)
    pad = 16 - 9
    assert meta.token_ids.tolist() == [11, 12, 13, 14, 15, 21, 22, 23, 31] + [0] * pad
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 9] + [0] * pad
    assert meta.seq_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2] + [0] * pad
    assert meta.slot_mapping.tolist() == [28, 29, 30, 31, 12, 36, 37, 38, 33] + [
        NULL_PAGE * 4 + i % 4 for i in range(9, 16)]
    assert meta.page_table.tolist() == [[7, 3, NULL_PAGE, NULL_PAGE], [5, 9, NULL_PAGE, NULL_PAGE],
                                        [2, 6, 8, NULL_PAGE], [NULL_PAGE] * 4]
    assert meta.logits_indices.tolist() == [4, 7, 8, 0]
    assert all(a.dtype == np.int32 for a in (meta.token_ids, meta.positions, meta.seq_ids, meta.slot_mapping,
                                             meta.page_table, meta.logits_indices))
    empty = build_metadata([], shapes, 4)  # warm-up's padding step
    assert empty.token_ids.tolist() == [0] * 4 and empty.page_table.tolist() == [[NULL_PAGE] * 4] * 4
    short = [ScheduledSeq("d", [41, 42], 7, [4], True, 0)]  # position 7 needs a second page of 4
    with pytest.raises(ValueError, match="do not cover"):
        build_metadata(short, shapes, 16)


def test_page_rows_give_the_page_tables_of_the_lists():
    """runner/inputs.PageRows over evolving plans: lists growing at their end, lifetimes ending (preemption:
    a new page_gen, a shorter list), requests forgotten, page_gen 0 (never kept): the page tables and slots
    build_metadata makes from its arrays equal those made from the lists, and the views handed out earlier
    never change."""
    from deepinfer_jax.runner import inputs
    from deepinfer_jax.runner.inputs import PageRows, Shapes, build_metadata
    from deepinfer_jax.scheduler.scheduler import ScheduledSeq

    ps, max_pages = 4, 40
    shapes = Shapes(buckets=(8, 64), max_num_seqs=8, max_pages=max_pages, page_size=ps, max_model_len=ps * max_pages)
    rng = np.random.default_rng(3)
    rows, gen = PageRows(), iter(range(1, 10**6))
    live: dict[str, tuple[int, list[int]]] = {}  # request id -> (page_gen, pages)
    views = []
    for step in range(200):
        for rid in list(live):
            g, pages = live[rid]
            r = rng.random()
            if r < 0.05:  # finished
                del live[rid]
                rows.forget(rid)
            elif r < 0.1:  # preempted and admitted again: a new list
                live[rid] = (next(gen), list(rng.integers(1, 1000, rng.integers(1, 5))))
            elif len(pages) < max_pages and r < 0.5:
                pages.extend(rng.integers(1, 1000, rng.integers(1, 3)).tolist()[: max_pages - len(pages)])
        while len(live) < 8 and rng.random() < 0.5:
            live[f"r{step}-{len(live)}"] = (next(gen) if rng.random() < 0.9 else 0,
                                            list(rng.integers(1, 1000, rng.integers(1, 12))))
        plan = [ScheduledSeq(rid, [7], len(p) * ps - 1, list(p), True, 0, page_gen=g) for rid, (g, p) in live.items()]
        for page_rows_min in (0, 2):
            inputs_min, inputs.PAGE_ROWS_MIN = inputs.PAGE_ROWS_MIN, page_rows_min
            try:
                got = build_metadata(plan, shapes, 8, page_rows=rows)
            finally:
                inputs.PAGE_ROWS_MIN = inputs_min
            want = build_metadata(plan, shapes, 8)
            assert np.array_equal(got.page_table, want.page_table) and np.array_equal(got.slot_mapping,
                                                                                      want.slot_mapping)
        if plan:
            seq = plan[rng.integers(len(plan))]
            views.append((rows(seq), list(seq.page_ids)))
    assert all(v.tolist() == p for v, p in views)
    assert len(rows) <= len(live)
