"""Scheduler groups (pipeline parallelism's decode overlap): disjoint groups, each planned on its own, a request in
the group that admitted it until it leaves, even admission, preemption across groups, a preempted request back in its
own group only."""

import pytest

from deepinfer_jax.config import CacheConfig, SchedulerConfig
from deepinfer_jax.scheduler.scheduler import Scheduler
from deepinfer_jax.types import Request, RequestStatus, SamplingParams

PS = 4


def make(groups=2, num_pages=64, budget=32, max_seqs=8, max_len=32):
    s = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len),
                  CacheConfig(page_size=PS, enable_prefix_caching=True), num_pages)
    s.num_groups = groups
    return s


def req(rid, n, base=100, max_tokens=8):
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,))


def step(s, group, token=7):
    plan = s.schedule(group)
    s.update_from_output(plan, {q.request_id: token for q in plan.seqs if q.sample})
    return [q.request_id for q in plan.seqs]


def test_groups_are_disjoint_and_even():
    s = make()
    for i, rid in enumerate("abcde"):
        s.add_request(req(rid, 3, base=100 * (i + 1)))
    assert step(s, 0) == ["a", "b", "c"]  # its share: ceil(5 / 2)
    assert step(s, 1) == ["d", "e"]
    assert s.group_of == {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1}
    for _ in range(2):  # each group decodes its own requests only, whatever the other's steps did
        assert step(s, 0) == ["a", "b", "c"]
        assert step(s, 1) == ["d", "e"]
    s.add_request(req("f", 3, base=600))
    assert step(s, 0) == ["a", "b", "c"]  # group 0 holds its share (ceil(6 / 2)): f waits for group 1
    assert step(s, 1) == ["d", "e", "f"] and s.group_of["f"] == 1


def test_one_group_is_the_plain_scheduler():
    s = make(groups=1, max_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 3, base=ord(rid) * 10))
    assert step(s, 0) == ["a", "b"] and s.num_waiting == 1  # max_num_seqs, every request in the one group


def test_finished_request_leaves_its_group():
    s = make()
    for rid in "ab":
        s.add_request(req(rid, 3, base=ord(rid) * 10, max_tokens=1))
    assert step(s, 0) == ["a"] and step(s, 1) == ["b"]
    assert s.group_of == {} and not s.has_unfinished_requests()


def test_preempted_request_returns_to_its_own_group():
    # 9 pages (8 usable) of 4 tokens: two 14-token prompts take 4 pages each; then group 0's decode needs a 5th page
    s = make(num_pages=9, max_len=24)
    s.add_request(req("a", 14, base=100, max_tokens=8))
    s.add_request(req("b", 14, base=200, max_tokens=8))
    for _ in range(3):  # the prompts, then positions 14 and 15: 16 tokens in 4 pages each
        assert step(s, 0) == ["a"] and step(s, 1) == ["b"]
    assert step(s, 0) == ["a"]  # a's position 16 needs a 5th page: b (newest, of group 1) is preempted
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and s.group_of["b"] == 1 and s.num_preemptions == 1
    s.finish_request("a", "stop")  # every page free again
    assert step(s, 0) == []  # group 0 does not admit group 1's request
    assert b.status == RequestStatus.PREEMPTED
    assert step(s, 1) == ["b"] and b.status == RequestStatus.RUNNING and s.group_of["b"] == 1


def test_bad_group_is_refused():
    s = make()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match=r"group must be in \[0, 2\), got 2"):
        s.schedule(2)
