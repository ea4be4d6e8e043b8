"""DeepSeek-V4 as released (FP8 linears, FP4 routed experts; tests/hf_models_v4.py `write_v4_release`) through the
whole engine: `LLM` keeps the weights in their formats ("auto") and its greedy tokens are HF transformers' on the
dequantized weights, in fp32, with chunked prefill and a batch; the routed experts through the quantized grouped
GEMMs (`moe_impl` pallas_interpret, as "pallas" runs them on a GPU)."""

from __future__ import annotations

import pytest

from hf_models import random_prompts
from deepinfer_jax import LLM, SamplingParams


@pytest.fixture(scope="module")
def release(v4_release):
    return v4_release[:2]


def test_llm_serves_the_release_format_with_hf_greedy_tokens(release, hf_greedy):
    from deepinfer_jax.models.quant_fp4 import is_fp4

    model, rel = release
    llm = LLM(rel, dtype="float32", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=13, page_size=4, num_pages=48, progress=False, token_buckets=(13,),
              greedy_variant=False, warmup_runs=1, moe_impl="pallas_interpret")
    assert is_fp4(llm.engine.runner.params["layers"][0]["moe"]["experts"]["gate_up"])
    prompts = random_prompts(41, [5, 19, 27], model.config.vocab_size)
    n = [9, 7, 11]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in n])
    for p, k, o in zip(prompts, n, outs):
        assert o.outputs[0].token_ids == hf_greedy(model, p, k), f"prompt of {len(p)} tokens"
