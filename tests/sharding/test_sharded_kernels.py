"""The Pallas kernels (interpret mode) under expert parallelism: copies routed to another device's
experts are skipped by the MoE kernel, and greedy tokens equal HF transformers' greedy generate (which
the single-device kernel run equals: tests/engine/test_llm_greedy.py)."""

from __future__ import annotations

import json
import os

from hf_models import random_prompts
from _runs import run

LENGTHS, MAX_TOKENS = (3, 17, 40, 9), 6

SCRIPT = r"""
import json, sys
from deepinfer_jax import LLM, SamplingParams
prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[2])]
out = {}
for name, kw in [("dp2ep", dict(data_parallel_size=2, enable_expert_parallel=True)),
                 ("tp2ep", dict(tensor_parallel_size=2, enable_expert_parallel=True))]:
    llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=32, page_size=8, progress=False, attn_impl="pallas_interpret",
              moe_impl="pallas_interpret", compilation_cache_dir=None, **kw)
    res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True))
    out[name] = {"tokens": [o.outputs[0].token_ids for o in res],
                 "late_compiles": llm.engine.runner.compiles_after_warmup}
print("RESULT " + json.dumps(out))
"""


def _hf_greedy(model, prompt, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, use_cache=True)
    return out[0, len(prompt):].tolist()


def test_kernels_under_expert_parallelism(hf_case):
    model, path = hf_case("v3_grouped_noaux")
    prompts = random_prompts(0, LENGTHS, model.config.vocab_size)
    out = run(["-c", SCRIPT, path, json.dumps(prompts), str(MAX_TOKENS)],
              XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    want = [_hf_greedy(model, q, MAX_TOKENS) for q in prompts]
    assert out["dp2ep"]["tokens"] == want and out["tp2ep"]["tokens"] == want
    assert all(r["late_compiles"] == 0 for r in out.values())
