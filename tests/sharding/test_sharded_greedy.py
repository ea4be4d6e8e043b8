"""Greedy tokens of a mixed batch (prompts of 1 to 75 tokens, chunked prefill under a 32-token budget,
more requests than max_num_seqs) are identical under every mesh layout to the single-device run, and
that run equals HF transformers' greedy generate. fp32, 8 fake CPU devices, one subprocess per model
(tests/sharding/run_case.py); both subprocesses run at once.

Layouts "TPxDP[ep]" (vLLM's knobs; EP = TP x DP when enabled):
  2x1 TP=2 | 4x1 TP=4 | 4x1ep EP=4 | 2x4ep EP=8 (DP=4 x TP=2) | 4x2ep EP=8 (DP=2 x TP=4) |
  2x2ep DP=2 x EP=4 (TP=2) | 2x2 DP=2 x TP=2, experts' intermediate dim over 4 | 1x8ep DP=8 x EP=8.
Each model has plain tensor parallelism at one degree (the same rules at either degree; the other degree is in
its combined layouts), expert parallelism alone and with data parallelism.
"""

from __future__ import annotations

import os

import pytest

from hf_models import hf_greedy
from _runs import REPO, run_all

RUN_CASE = os.path.join(REPO, "tests", "sharding", "run_case.py")

LAYOUTS = {
    "v2_greedy_yarn": ["1x1", "2x1", "4x1ep", "2x4ep", "4x2ep", "2x2ep"],  # 8 experts
    "v3_grouped_noaux": ["1x1", "4x1", "4x1ep", "2x4ep", "2x2ep", "2x2", "1x8ep"],  # 16 experts
}


@pytest.fixture(scope="module")
def runs(hf_case):
    return run_all({case: [RUN_CASE, hf_case(case)[1], *layouts] for case, layouts in LAYOUTS.items()})


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_sharded_greedy_equals_single_device(runs, hf_case, case):
    model, _ = hf_case(case)
    res = runs[case]
    layouts = res["layouts"]
    base = layouts["1x1"]["tokens"]
    assert base == [hf_greedy(model, p, n) for p, n in zip(res["prompts"], res["max_tokens"])]
    timings = []
    for name in LAYOUTS[case][1:]:
        r = layouts[name]
        timings.append(f"{name} {r['seconds']}s/{r['steps']} steps")
        assert r["tokens"] == base, f"layout {name}: {r['tokens']} != {base}"
        assert r["compiles_after_warmup"] == 0, name
        assert all(u == 0.0 for u in r["kv_usage_after"]), name  # every rank's pages back in its pool
        tp, dp = (int(x) for x in name.removesuffix("ep").split("x"))
        assert r["mesh"] == {"data": dp, "tensor": tp}
        if dp > 1:  # data-parallel attention: requests spread over every rank, cache pages split
            assert sorted(set(r["ranks"])) == list(range(dp)), (name, r["ranks"])
            assert r["kv_cache_spec"] == [None, "data", None, None], r["kv_cache_spec"]
            assert r["steps"] < layouts["1x1"]["steps"]  # each rank has its own token budget
    print(f"\n{case}: " + ", ".join(timings))
