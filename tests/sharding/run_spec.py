"""Run one greedy workload through `LLM` with speculative decoding under mesh layouts on 4 fake CPU devices; print
JSON.

    python tests/sharding/run_spec.py MODEL_DIR CASE [CASE ...]

CASE is "LAYOUT:METHOD": LAYOUT as tests/sharding/run_case.py's ("TPxDP[ep]", e.g. 2x1, 1x2ep), METHOD one of
deepseek_mtp, ngram, draft_model (the draft: the target's own checkpoint, loaded again) or none. The workload: more
requests than max_num_seqs, prompts longer than the 16-token step budget (chunked prefill), prompts that repeat
themselves (n-gram proposals). Runs in its own process because the number of fake CPU devices must be fixed before
JAX starts. Prints one line "RESULT " + JSON {"prompts", "max_tokens", "cases": {CASE: {"tokens", "ranks",
"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos", "compiles_after_warmup",
"kv_usage_after", "kv_layers", "mesh", "seconds"}}}.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

K = 2
MAX_TOKENS = [9, 7, 10, 6, 8, 9]
BUDGET, MAX_SEQS, MODEL_LEN, PAGE = 16, 4, 96, 8


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(13)
    loop = rng.integers(2, vocab, 5).tolist()
    return [loop * 4, rng.integers(2, vocab, 3).tolist(), rng.integers(2, vocab, 30).tolist(),
            rng.integers(2, vocab, 1).tolist(), loop * 2 + rng.integers(2, vocab, 4).tolist(),
            rng.integers(2, vocab, 11).tolist()]


def run(model_dir: str, case: str, ps: list[list[int]]) -> dict:
    from deepinfer_jax import LLM, SamplingParams

    layout, method = case.split(":")
    ep = layout.endswith("ep")
    tp, dp = (int(x) for x in layout.removesuffix("ep").split("x"))
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = model_dir
    if method == "ngram":  # short n-grams: the tiny models' greedy outputs repeat short cycles
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    t0 = time.time()
    llm = LLM(model_dir, dtype="float32", max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, page_size=PAGE,
              max_model_len=MODEL_LEN, token_buckets=(BUDGET,), attn_impl="reference", moe_impl="ragged",
              skip_tokenizer_init=True, compilation_cache_dir=None, progress=False, speculative_config=spec,
              tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
              spec_overlap=False)  # data-parallel attention runs the plain loop: every case runs it
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    eng = llm.engine
    sched = eng.scheduler
    st = eng.spec_stats
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "num_drafts": st.num_drafts if st else 0, "num_draft_tokens": st.num_draft_tokens if st else 0,
            "num_accepted_tokens": st.num_accepted_tokens if st else 0,
            "num_accepted_tokens_per_pos": list(st.num_accepted_tokens_per_pos) if st else [],
            "compiles_after_warmup": eng.runner.compiles_after_warmup
            + (eng.drafter.runner.compiles_after_warmup if eng.drafter else 0),
            "kv_usage_after": [s.kv_cache_manager.usage for s in getattr(sched, "ranks", [sched])],
            "kv_layers": int(eng.runner.kv_cache.shape[0]),
            "mesh": None if eng.runner.sharding is None else dict(eng.runner.sharding.mesh.shape),
            "seconds": round(time.time() - t0, 1)}


def main() -> None:
    model_dir, cases = sys.argv[1], sys.argv[2:]
    from deepinfer_jax.config import ModelConfig

    ps = prompts(ModelConfig.from_model_dir(model_dir).vocab_size)
    results = {case: run(model_dir, case, ps) for case in cases}
    print("RESULT " + json.dumps({"prompts": ps, "max_tokens": MAX_TOKENS, "cases": results}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
