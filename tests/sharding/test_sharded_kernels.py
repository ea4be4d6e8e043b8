"""The Pallas kernels (interpret mode) under expert parallelism: copies routed to another device's
experts are skipped by the MoE kernel, and greedy tokens equal the single-device kernel run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import json, sys
import numpy as np
from deepinfer_jax import LLM, SamplingParams
rng = np.random.default_rng(0)
prompts = [{"prompt_token_ids": rng.integers(2, 320, n).tolist()} for n in (3, 17, 40, 9)]
out = {}
for name, kw in [("single", {}), ("dp2ep", dict(data_parallel_size=2, enable_expert_parallel=True)),
                 ("tp2ep", dict(tensor_parallel_size=2, enable_expert_parallel=True))]:
    llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=64, page_size=8, progress=False, attn_impl="pallas_interpret",
              moe_impl="pallas_interpret", compilation_cache_dir=None, **kw)
    res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    out[name] = {"tokens": [o.outputs[0].token_ids for o in res],
                 "late_compiles": llm.engine.runner.compiles_after_warmup}
print("RESULT " + json.dumps(out))
"""


def test_kernels_under_expert_parallelism(hf_case):
    _, path = hf_case("v3_grouped_noaux")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, path], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0 and "RESULT " in p.stdout, p.stderr[-4000:]
    out = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert out["single"]["tokens"] == out["dp2ep"]["tokens"] == out["tp2ep"]["tokens"]
    assert all(r["late_compiles"] == 0 for r in out.values())
