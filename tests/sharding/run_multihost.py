"""One process of a multi-host run on fake CPU devices; rank 0 prints the greedy tokens as JSON.

    python tests/sharding/run_multihost.py MODEL_DIR LAYOUT NNODES NODE_RANK MASTER_PORT DEVICES

Every process gets DEVICES fake CPU devices and runs `LLM(..., nnodes=NNODES, node_rank=NODE_RANK,
master_addr="127.0.0.1", master_port=MASTER_PORT)` on LAYOUT ("TPxDP[ep]", as run_case.py); NNODES = 1 is the
one-process reference. Rank 0 generates run_case.py's mixed greedy batch, prints "RESULT " + JSON {"prompts",
"max_tokens", "tokens", "compiles_after_warmup"} and shuts the other ranks down; the others print "FOLLOWED".
"""

from __future__ import annotations

import json
import os
import sys

from run_case import BUDGET, MAX_SEQS, MAX_TOKENS, MODEL_LEN, PAGE, PROMPT_LENGTHS  # noqa: E402 (sets 8 devices)

model_dir, layout, nnodes, rank, port, devices = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"  # the last one counts
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from deepinfer_jax import LLM  # noqa: E402
from deepinfer_jax.types import SamplingParams  # noqa: E402


def main() -> None:
    ep = layout.endswith("ep")
    tp, dp = (int(x) for x in layout.removesuffix("ep").split("x"))
    llm = LLM(model_dir, dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
              max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, max_model_len=MODEL_LEN, page_size=PAGE,
              attn_impl="reference", moe_impl="ragged", token_buckets=(BUDGET,), skip_tokenizer_init=True,
              compilation_cache_dir=None, progress=False, warmup_runs=1,
              nnodes=nnodes, node_rank=rank, master_addr="127.0.0.1", master_port=port)
    if rank > 0:
        print("FOLLOWED", flush=True)
        return
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, vocab, n).tolist() for n in PROMPT_LENGTHS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    llm.shutdown()
    print("RESULT " + json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS,
                                  "tokens": [o.outputs[0].token_ids for o in outs],
                                  "compiles_after_warmup": llm.engine.runner.compiles_after_warmup}), flush=True)


if __name__ == "__main__":
    main()
