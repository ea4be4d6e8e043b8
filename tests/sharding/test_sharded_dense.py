"""The dense family under tensor parallelism on 8 fake CPU devices (tests/sharding/run_case.py, its mixed greedy
batch with chunked prefill): TP=2 splits the 2 KV heads (and the cache's KV-head axis) over the tensor axis, TP=4
replicates them (vLLM's rule when TP exceeds the KV heads). Tokens equal HF's (the single-device engine's:
tests/engine/test_dense_llm.py)."""

from __future__ import annotations

import os
from _runs import REPO, run



def _hf_greedy(model, prompt, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, use_cache=True)
    return out[0, len(prompt):].tolist()


def test_tensor_parallel_greedy_equals_hf(hf_case):
    model, path = hf_case("llama_tp")
    res = run([os.path.join(REPO, "tests", "sharding", "run_case.py"), path, "2x1", "4x1"])
    runs = res["layouts"]
    for layout in ("2x1", "4x1"):
        assert runs[layout]["compiles_after_warmup"] == 0
        for prompt, n, tokens in zip(res["prompts"], res["max_tokens"], runs[layout]["tokens"]):
            assert tokens == _hf_greedy(model, prompt, n), layout
    assert runs["2x1"]["kv_cache_spec"] == [None, None, None, None, "tensor", None]  # [L, P, page, 2, KVH, hd]
    assert runs["4x1"]["kv_cache_spec"] == [None] * 6
