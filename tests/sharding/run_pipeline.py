"""Run one greedy workload through `LLM` under pipeline-parallel layouts on 8 fake CPU devices; print JSON.

    python tests/sharding/run_pipeline.py MODEL_DIR [--micro] LAYOUT [LAYOUT ...]

LAYOUT is "TPxDP[ep]-ppN" (tests/sharding/run_case.py's layouts with N pipeline stages), e.g. 1x1-pp2 2x1-pp2,
or "1x1" for one device. The workload: two waves of requests. The first has more requests than max_num_seqs
(batching), prompts longer than the 32-token step budget (chunked prefill) and fewer KV pages than its running
requests want (preemption); the second repeats the first wave's last prompt with new tails (prefix-cache hits).
--micro: short prompts, which steps batch several of, and the bucket ladder 8, 16, 32, so that prefill steps and
steps of prefill and decode rows run as micro-batches (runner/micro_batches.py); the pipeline runner's counters too.
Prints one line "RESULT " + JSON {"prompts", "max_tokens", "layouts": {LAYOUT: {"tokens", "seconds", "compiles_after_warmup",
"preemptions", "prefix_hits", "stage_layers", "stage_devices", "stage_weight_bytes", "kv_usage_after",
"memory_devices", "steps", and with pipeline stages "stage_dispatches", "micro_batch_counts", "stage_boundary_bytes",
"group_steps", "max_steps_in_flight"}, "one_group": {"stopped": [tokens, finish reason] of the first wave run again
with a stop token id each (the middle token of its output), "tokens" of it run again with one decode group,
"refused": the error for a group more than the stages} (RERUN_LAYOUTS, not --micro)}}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

FIRST_WAVE = [3, 17, 40, 75, 1, 9, 33, 60]  # prompt lengths
MICRO_WAVE = [5, 7, 6, 3, 2, 8, 4, 12]  # --micro
SECOND_WAVE_TAILS = [5, 12]  # new tokens after the first wave's last prompt
MAX_TOKENS = [8, 6, 10, 5, 9, 7, 6, 8, 6, 7]
NUM_PAGES, PAGE, BUDGET, MAX_SEQS, MODEL_LEN = 14, 8, 32, 4, 88
MICRO_PAGES, MICRO_MODEL_LEN = 7, 32
RERUN_LAYOUTS = ("1x1-pp4", "2x2ep-pp2")  # stop token ids and one decode group: the most groups, groups under DP


def workload(vocab: int, micro: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(11)
    first = [rng.integers(2, vocab, n).tolist() for n in (MICRO_WAVE if micro else FIRST_WAVE)]
    second = [first[-1] + rng.integers(2, vocab, n).tolist() for n in SECOND_WAVE_TAILS]
    return first, second


def parse_layout(name: str) -> dict:
    base, _, pp = name.partition("-pp")
    ep = base.endswith("ep")
    tp, dp = (int(x) for x in base.removesuffix("ep").split("x"))
    return dict(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
                pipeline_parallel_size=int(pp or 1))


def run(model_dir: str, layout: str, waves, micro: bool = False) -> dict:
    import time

    import jax

    from deepinfer_jax import LLM
    from deepinfer_jax.types import SamplingParams

    t0 = time.time()
    llm = LLM(model_dir, dtype="float32", max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, page_size=PAGE,
              max_model_len=MICRO_MODEL_LEN if micro else MODEL_LEN, num_pages=MICRO_PAGES if micro else NUM_PAGES,
              token_buckets=(8, 16, BUDGET) if micro else (BUDGET,), attn_impl="reference",
              moe_impl="ragged", prefill_layers="scan", skip_tokenizer_init=True, compilation_cache_dir=None,
              progress=False, **parse_layout(layout))
    tokens, n = [], 0
    for wave in waves:
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in MAX_TOKENS[n:n + len(wave)]]
        n += len(wave)
        outs = llm.generate([{"prompt_token_ids": p} for p in wave], params)
        tokens += [o.outputs[0].token_ids for o in outs]
    eng = llm.engine
    st = eng.scheduler.stats()
    one_group = {}
    if layout in RERUN_LAYOUTS and not micro:
        # the first wave again, each request stopping at a token of its own output (its middle one), then again
        # one step at a time
        stops = [t[len(t) // 2] for t in tokens[:len(waves[0])]]
        outs = llm.generate([{"prompt_token_ids": p} for p in waves[0]],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, stop_token_ids=[s])
                             for m, s in zip(MAX_TOKENS, stops)])
        one_group["stopped"] = [[o.outputs[0].token_ids, o.outputs[0].finish_reason] for o in outs]
        try:
            eng.set_decode_groups(eng.groups + 1)
        except ValueError as e:
            one_group["refused"] = str(e)
        eng.set_decode_groups(1)
        outs = llm.generate([{"prompt_token_ids": p} for p in waves[0]],
                            [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                             for m in MAX_TOKENS[:len(waves[0])]])
        one_group["tokens"] = [o.outputs[0].token_ids for o in outs]
    runner = eng.runner
    stage_layers = [int(c.shape[0]) for c in getattr(runner, "stage_caches", [runner.kv_cache])]
    stage_devices = []
    for p, c in zip(getattr(runner, "stage_params", [runner.params]), getattr(runner, "stage_caches", [runner.kv_cache])):
        devs = {d.id for x in jax.tree.leaves(p) for d in x.sharding.device_set} | {d.id for d in c.sharding.device_set}
        stage_devices.append(sorted(devs))
    stage_bytes = []  # the params' bytes on a device of each stage (the most any of its devices holds)
    for p in getattr(runner, "stage_params", [runner.params]):
        per_dev: dict[int, int] = {}
        for x in jax.tree.leaves(p):
            for shard in x.addressable_shards:
                per_dev[shard.device.id] = per_dev.get(shard.device.id, 0) + shard.data.nbytes
        stage_bytes.append(max(per_dev.values()))
    pools = [s.kv_cache_manager.usage for s in getattr(eng.scheduler, "ranks", [eng.scheduler])]
    out = {"steps": sum(runner.steps_by_variant.values())}
    if hasattr(runner, "stage_dispatches"):
        out.update(stage_dispatches=runner.stage_dispatches, micro_batch_counts=dict(runner.micro_batch_counts),
                   stage_boundary_bytes=runner.stage_boundary_bytes, gather_collectives=gather_collectives(runner),
                   group_steps=runner.group_steps, max_steps_in_flight=eng.max_steps_in_flight)
    return out | {"tokens": tokens, "one_group": one_group, "seconds": round(time.time() - t0, 1),
                  "compiles_after_warmup": runner.compiles_after_warmup, "preemptions": st.num_preemptions,
                  "prefix_hits": st.prefix_cache_hits, "stage_layers": stage_layers, "stage_devices": stage_devices,
                  "stage_weight_bytes": stage_bytes, "kv_usage_after": pools,
                  "memory_devices": runner.memory_report()["num_devices"]}


def gather_collectives(runner) -> list:
    """The collectives (run_case.collectives) of the compiled logits gathers of split steps (runner/pipeline.py
    _gather_fn), for 16-token steps split into 8-token micro-batches."""
    import jax
    import jax.numpy as jnp

    from run_case import collectives

    last, R, V = runner.stage_shardings[-1], runner.num_ranks, runner.cfg.vocab_size
    S, S_b = runner.shapes.seq_rows(16), runner.shapes.seq_rows(8)
    index = jax.ShapeDtypeStruct((R, S), jnp.int32, sharding=runner._by_rank)
    part = jax.ShapeDtypeStruct((R * S_b, V), jnp.float32, sharding=last.logits)
    return collectives([fn.lower(index, *[part] * key[1]).compile() for key, fn in runner._fns.items()
                        if key[0] == "gather"])


def main() -> None:
    model_dir, layouts = sys.argv[1], sys.argv[2:]
    micro = "--micro" in layouts
    layouts = [x for x in layouts if x != "--micro"]
    from deepinfer_jax.config import ModelConfig

    waves = workload(ModelConfig.from_model_dir(model_dir).vocab_size, micro)
    results = {layout: run(model_dir, layout, waves, micro) for layout in layouts}
    print("RESULT " + json.dumps({"prompts": waves[0] + waves[1], "max_tokens": MAX_TOKENS[:sum(map(len, waves))],
                                  "layouts": results}))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main()
