"""Run one greedy batch of a tiny DeepSeek-V4 checkpoint through `LLM` under several layouts; print JSON.

    python tests/sharding/run_v4.py CASE=MODEL_DIR:MOE_IMPL[/ATTN_IMPL]:LAYOUT[,LAYOUT...] ...

LAYOUT is "TPxDP" or "TPxDPep" (tests/sharding/run_case.py's names); ATTN_IMPL the attention's (default reference). In its own process because the number of
fake CPU devices (8) must be fixed before JAX starts. Prints one line "RESULT " + JSON {CASE: {LAYOUT: {"tokens",
"device_weight_bytes" (the params' bytes on the first device), "plan_weight_bytes" (`deepinfer plan`'s per-device
figure for the same layout), "device_kv_bytes", "expert_spec", "head_specs" (layer 0's q_b_proj, sinks, o_a_proj,
o_b_proj; an FP8 one's q), "shared_shards" (layer 0's shared expert gate_up, down: the first device's slice shape; an
FP8 one's q), "compiles_after_warmup", "collectives" (run_case.collectives of the compiled step programs),
"seq_rows", "all_reduces" (the all-reduce instructions in each compiled step program)}}, "prompts", "max_tokens"}.
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

# Longer than the sliding window (8) and several compression windows (4, 8); chunked under a 13-token budget.
PROMPT_LENGTHS = [5, 19, 27, 2]
MAX_TOKENS = [9, 7, 11, 6]


def device_bytes(tree, device) -> int:
    import jax

    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)


def shard_shape(w, device) -> tuple:
    """The shape of a leaf's (an FP8 one's q) slice on `device`."""
    return next(s.data.shape for s in getattr(w, "q", w).addressable_shards if s.device == device)


def spec_of(w) -> list[str]:
    return [str(a) for a in getattr(getattr(w, "q", w).sharding, "spec", ())]


def run(model_dir: str, impls: str, layout: str, prompts) -> dict:
    import jax

    from deepinfer_jax import LLM, SamplingParams
    from deepinfer_jax.engine.plan import plan
    from deepinfer_jax.models.quant_fp4 import is_fp4
    from run_case import collectives

    moe_impl, attn_impl = (impls.split("/") + ["reference"])[:2]
    ep = layout.endswith("ep")
    tp, dp = (int(x) for x in layout.removesuffix("ep").split("x"))
    llm = LLM(model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=13, page_size=4, num_pages=48, progress=False, token_buckets=(13,),
              greedy_variant=False, warmup_runs=1, moe_impl=moe_impl, attn_impl=attn_impl, tensor_parallel_size=tp,
              data_parallel_size=dp, enable_expert_parallel=ep)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    runner = llm.engine.runner
    dev = jax.devices()[0]
    gu = runner.params["layers"][0]["moe"]["experts"]["gate_up"]
    attn = runner.params["layers"][0]["attn"]
    sh = (gu.q if is_fp4(gu) or hasattr(gu, "q") else gu).sharding
    spec = getattr(sh, "spec", ())
    shared, programs = runner.params["layers"][0]["moe"]["shared"], list(runner.programs.executables.values())
    p = plan(model_dir, tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep, dtype="float32")
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "device_weight_bytes": device_bytes(runner.params, dev), "plan_weight_bytes": p.weight_bytes_per_device,
            "device_kv_bytes": device_bytes(runner.kv_cache, dev), "expert_spec": [str(a) for a in spec],
            "head_specs": {k: spec_of(attn[k]) for k in ("q_b_proj", "sinks", "o_a_proj", "o_b_proj")},
            "shared_shards": {k: list(shard_shape(w, dev)) for k, w in shared.items()},
            "compiles_after_warmup": runner.compiles_after_warmup, "collectives": collectives(programs),
            "seq_rows": llm.engine.shapes.seq_rows(13),
            "all_reduces": [len(re.findall(r" all-reduce(?:-start)?\(", e.as_text())) for e in programs]}


def main() -> None:
    rng = np.random.default_rng(41)
    prompts = [rng.integers(2, 101, n).tolist() for n in PROMPT_LENGTHS]
    out: dict = {"prompts": prompts, "max_tokens": MAX_TOKENS}
    for arg in sys.argv[1:]:
        case, rest = arg.split("=", 1)
        model_dir, moe_impl, layouts = rest.rsplit(":", 2)
        out[case] = {lay: run(model_dir, moe_impl, lay, prompts) for lay in layouts.split(",")}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
