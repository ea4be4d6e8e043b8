"""An FP8 block-scaled checkpoint under mesh layouts on 8 fake CPU devices; print JSON.

    python tests/sharding/run_fp8.py MODEL_DIR LAYOUT [LAYOUT ...]

LAYOUT is one of tests/sharding/run_case.py's ("TPxDP[ep]"). For each: the checkpoint loaded onto the layout (the
FP8 leaves kept, their dtypes and the partitions of q and scale of a few of them, the largest per-device sum of
the params' shards beside `deepinfer plan`'s weight bytes per device), then run_case.py's mixed greedy batch.
A layout whose split would cut a scale block gives {"refused": the loader's message, "plan_refused": plan's}.
Prints one line "RESULT " + JSON {LAYOUT: {...}}.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_case  # noqa: E402  (sets the 8 fake devices before JAX starts)

LEAVES = {  # name -> path into the params of the first MoE segment
    "q_b_proj": ("attn", "q_b_proj"), "o_proj": ("attn", "o_proj"), "shared_gate_up": ("moe", "shared", "gate_up"),
    "experts_gate_up": ("moe", "experts", "gate_up"), "experts_down": ("moe", "experts", "down"),
}


def load_info(model_dir: str, layout: str) -> dict:
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.plan import plan
    from deepinfer_jax.models.quant import is_fp8
    from deepinfer_jax.sharding import build_sharding
    from deepinfer_jax.weights.loader import load_model

    pc = run_case.parse_layout(layout)
    kw = dict(tensor_parallel_size=pc.tensor_parallel_size, data_parallel_size=pc.data_parallel_size,
              enable_expert_parallel=pc.enable_expert_parallel)
    cfg0 = ModelConfig.from_model_dir(model_dir)
    sharding = build_sharding(cfg0, pc)
    try:
        _, params = load_model(model_dir, jnp.float32, shardings=sharding.param_shardings(cfg0), progress=False,
                               vocab_multiple=sharding.vocab_multiple)
    except ValueError as e:
        try:
            plan(model_dir, dtype="float32", **kw)
            plan_refused = None
        except ValueError as p:
            plan_refused = str(p)
        return {"refused": str(e), "plan_refused": plan_refused}
    fp8 = [x for x in jax.tree.leaves(params, is_leaf=is_fp8) if is_fp8(x)]
    per_dev: dict = {}
    for leaf in jax.tree.leaves(params):
        for s in leaf.addressable_shards:
            per_dev[s.device.id] = per_dev.get(s.device.id, 0) + s.data.nbytes
    seg = params["segments"][1]
    specs = {}
    for name, path in LEAVES.items():
        w = seg
        for k in path:
            w = w[k]
        specs[name] = [run_case._spec(w.q), run_case._spec(w.scale)]
    return {"fp8_leaves": len(fp8), "q_dtypes": sorted({str(w.q.dtype) for w in fp8}), "specs": specs,
            "allocated_bytes": max(per_dev.values()),
            "planned_bytes": plan(model_dir, dtype="float32", **kw).weight_bytes_per_device}


def main() -> None:
    import numpy as np

    from deepinfer_jax.config import ModelConfig

    model_dir, layouts = sys.argv[1], sys.argv[2:]
    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, vocab, n).tolist() for n in run_case.PROMPT_LENGTHS]
    out = {}
    for layout in layouts:
        info = {} if run_case.parse_layout(layout).is_single_device else load_info(model_dir, layout)
        if "refused" not in info:
            info.update(run_case.run(model_dir, layout, prompts))
        out[layout] = info
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
