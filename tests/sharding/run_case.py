"""Run one mixed greedy batch on a model directory under several mesh layouts; print JSON.

    python tests/sharding/run_case.py MODEL_DIR [LAYOUT ...]

LAYOUT is "TPxDP" or "TPxDPep" (enable_expert_parallel), e.g. 1x1 2x1 4x1ep 2x2ep, "TPxDPep-a2a" (all2all_backend
"all_to_all"), or one of those with ":load"
(the checkpoint loaded onto the layout, no engine: {"has_mtp", "param_vocab", "num_leaves", "embed_spec",
"on_mesh", "device_updates_equal", "writes": [in-place device writes of the host load, of the other]});
environment
DEEPINFER_MOE_IMPL / DEEPINFER_ATTN_IMPL pick the implementations (ragged / reference) and
DEEPINFER_PREFILL_LAYERS RunnerConfig.prefill_layers (scan). Runs in its own
process because the number of fake CPU devices must be fixed before JAX starts (8 here). Prints one line
"RESULT " + JSON {"prompts", "max_tokens", "layouts": {LAYOUT: {"tokens": [[...] per request],
"compiles_after_warmup", "seconds", "steps", "kv_usage_after", "ranks", "mesh", "has_mtp", "param_vocab",
"collectives", "bucket", "seq_rows", "kv_cache_spec"}}}.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

# Prompts of mixed lengths: several longer than the 32-token step budget (chunked prefill), more
# requests than max_num_seqs (queueing), one-token prompts.
PROMPT_LENGTHS = [3, 17, 40, 75, 1, 9, 33, 60, 5, 24]
MAX_TOKENS = [8, 6, 10, 5, 9, 7, 6, 8, 4, 7]
BUDGET, MAX_SEQS, MODEL_LEN, PAGE = 32, 4, 128, 8


def parse_layout(name: str):
    from deepinfer_jax.sharding import ParallelConfig

    name, a2a = name.removesuffix("-a2a"), name.endswith("-a2a")
    ep = name.endswith("ep")
    tp, dp = (int(x) for x in name.removesuffix("ep").split("x"))
    return ParallelConfig(tp, dp, ep, all2all_backend="all_to_all" if a2a else "allgather_reducescatter")


def load_only(model_dir: str, layout: str) -> dict:
    """Load the checkpoint under `layout` without building an engine (LAYOUT ":load"), assembled on the host (the
    engines' load on CPU devices) and again through the in-place device updates (a GPU mesh's load)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.sharding import build_sharding
    from deepinfer_jax.weights import hf_loader
    from deepinfer_jax.weights.loader import load_model

    cfg0 = ModelConfig.from_model_dir(model_dir)
    sharding = build_sharding(cfg0, parse_layout(layout))

    def load():
        return load_model(model_dir, jnp.float32, shardings=sharding.param_shardings(cfg0), progress=False,
                          vocab_multiple=sharding.vocab_multiple)

    write, writes = hf_loader._write, []

    def counted(*args):
        writes.append(1)
        return write(*args)

    hf_loader._write = counted
    cfg, params = load()
    host_writes = len(writes)
    hf_loader.HOST_ASSEMBLY_BYTES, host_bytes = -1, hf_loader.HOST_ASSEMBLY_BYTES
    _, updated = load()
    hf_loader.HOST_ASSEMBLY_BYTES, hf_loader._write = host_bytes, write
    leaves = jax.tree.leaves(params)
    same = jax.tree.structure(params) == jax.tree.structure(updated) and all(
        a.shape == b.shape and a.dtype == b.dtype and a.sharding.is_equivalent_to(b.sharding, a.ndim)
        and np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(leaves, jax.tree.leaves(updated)))
    return {"has_mtp": cfg.has_mtp, "param_vocab": int(params["embed"].shape[0]), "num_leaves": len(leaves),
            "embed_spec": list(params["embed"].sharding.spec), "device_updates_equal": same,
            "writes": [host_writes, len(writes) - host_writes],
            "on_mesh": all(x.sharding.mesh.shape == sharding.mesh.shape for x in leaves)}


def run(model_dir: str, layout: str, prompts, moe_impl: str = "ragged", attn_impl: str = "reference",
        prefill_layers: str = "scan") -> dict:
    import jax.numpy as jnp

    from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.sharding import build_sharding
    from deepinfer_jax.types import SamplingParams
    from deepinfer_jax.weights.loader import load_model

    t0 = time.time()
    pc = parse_layout(layout)
    sharding = None
    shardings = None
    multiple = 1
    if not pc.is_single_device:
        cfg0 = ModelConfig.from_model_dir(model_dir)
        sharding = build_sharding(cfg0, pc)
        shardings = sharding.param_shardings(cfg0)
        multiple = sharding.vocab_multiple
    cfg, params = load_model(model_dir, jnp.float32, shardings=shardings, progress=False, vocab_multiple=multiple)
    eng = LLMEngine(
        cfg, params, None,
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, max_model_len=MODEL_LEN),
        cache_config=CacheConfig(page_size=PAGE, enable_prefix_caching=True),
        runner_config=RunnerConfig(dtype="float32", moe_impl=moe_impl, attn_impl=attn_impl, token_buckets=(BUDGET,),
                                   warmup_full_variant=False, prefill_layers=prefill_layers),
        progress=False, sharding=sharding)
    ids = []
    for p, n in zip(prompts, MAX_TOKENS):
        rid = eng.new_request_id()
        eng.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        ids.append(rid)
    ranks = [getattr(eng.scheduler, "rank_of", lambda _: 0)(r) for r in ids]
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        steps += 1
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    sched = eng.scheduler
    pools = [s.kv_cache_manager.usage for s in getattr(sched, "ranks", [sched])]
    return {"tokens": [done[r] for r in ids], "compiles_after_warmup": eng.runner.compiles_after_warmup,
            "seconds": round(time.time() - t0, 2), "steps": steps, "kv_usage_after": pools, "ranks": ranks,
            "mesh": None if sharding is None else dict(sharding.mesh.shape), "has_mtp": cfg.has_mtp,
            "collectives": collectives(eng.runner.programs.executables.values()),
            "bucket": BUDGET, "seq_rows": eng.shapes.seq_rows(BUDGET),
            "param_vocab": int(params["embed"].shape[0]),
            "kv_cache_spec": None if sharding is None else _spec(eng.runner.kv_cache)}


COLLECTIVE = re.compile(r"= (\(?[^=]*?\)?) (all-reduce|all-gather|reduce-scatter|all-to-all)(?:-start)?\(")


def collectives(executables) -> list:
    """Sorted distinct [kind, [dims]] of the collectives in the compiled step programs' HLO (a tuple-shaped
    all-reduce counts once per element)."""
    seen = set()
    for ex in executables:
        for m in COLLECTIVE.finditer(re.sub(r"/\*index=\d+\*/", "", ex.as_text())):  # a long tuple's markers
            for dims in re.findall(r"[a-z0-9]+\[([0-9,]*)\]", m.group(1)):
                seen.add((m.group(2), tuple(int(d) for d in dims.split(",") if d)))
    return sorted([k, list(d)] for k, d in seen)


def _spec(x) -> list:
    spec = list(x.sharding.spec)
    return spec + [None] * (x.ndim - len(spec))


def main() -> None:
    model_dir, layouts = sys.argv[1], sys.argv[2:] or ["1x1"]
    from deepinfer_jax.config import ModelConfig

    vocab = ModelConfig.from_model_dir(model_dir).vocab_size
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, vocab, n).tolist() for n in PROMPT_LENGTHS]
    impls = dict(moe_impl=os.environ.get("DEEPINFER_MOE_IMPL", "ragged"),
                 attn_impl=os.environ.get("DEEPINFER_ATTN_IMPL", "reference"),
                 prefill_layers=os.environ.get("DEEPINFER_PREFILL_LAYERS", "scan"))
    results = {layout: load_only(model_dir, layout.removesuffix(":load")) if layout.endswith(":load")
               else run(model_dir, layout, prompts, **impls) for layout in layouts}
    print("RESULT " + json.dumps({"prompts": prompts, "max_tokens": MAX_TOKENS, "layouts": results}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
