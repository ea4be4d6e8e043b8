"""Weights in host memory (`--cpu-offload-gb`, docs/offload.md): decode throughput with part of the routed experts
in pinned host memory against every weight on the device, and the bytes each step copies in.

    python benchmarks/offload.py              # GPU: deepseek-v2-lite shape, random bf16 weights
    python benchmarks/offload.py --v4 [CONFIG_JSON] [--v4-layers 2]   # GPU: a DeepSeek-V4 shape instead
    python benchmarks/offload.py --smoke [--v4]   # CPU: tiny model, small sizes (checks the script, not the speed)

First the host link: copies of a pinned host array of --link-mib MiB (1 GiB) to the device and back, best of 5.
Then correctness: the same prompts greedy with and without offload must give the same tokens (the programs differ
only by the copies). Then the timed runs: --batch requests of --prompt-len tokens, --output-len tokens each, after a
warm round; output tokens/s, the mean step time, the bytes copied in per step (every step program copies every
offloaded byte) and the link bandwidth those copies take at that step time. Then the device memory of the smallest
step program (the decode step) as XLA compiled it, with and without offload: the weights resident on the device,
the KV cache, the program's temporaries (`memory_analysis().temp_size_in_bytes`, which hold the offloaded weights'
copies while the step runs) and its device peak (arguments + outputs - aliased + temporaries), beside the most of
the offloaded bytes the program's jaxpr holds at once (weight_offload.copy_in_bytes: one layer's slices where the
layer loop streams them). With offload the KV cache takes the bytes the weights free, so the peaks are alike: the
temporaries tell what the copies cost the step.

What is offloaded: --offload-gib GiB (runner/weight_offload.py picks the leaves: routed experts first); by default
the routed experts' bytes times --expert-fraction (0.5), which on V2-Lite's one MoE segment takes its experts'
`down` leaf (a third of the experts' bytes; the leaf is the unit) and fills the rest of the budget with the next
leaves in the order. The step copies each layer's slice of them in its layer loop (docs/offload.md).

`--v4`: a DeepSeek-V4 shape (a deepseek_v4 config.json, or HF's DeepseekV4Config, V4-Flash's width, without one),
its first --v4-layers layers, random float weights; V4 keeps one set of weights a layer, so each layer's routed
experts are their own two leaves, and each layer holding offloaded weights copies them in inside its own call
(models/v4_paged.py). XLA may start those copies early on straight-line layers: the compiled decode program's
temporaries against one layer's share tell whether it did. Random float experts run in XLA's grouped GEMM (the
kernels take FP4 / FP8 ones), so its tokens/s is not V4's serving speed: compare the two rows.
HF's config at two layers is 26.5 GiB of bf16 weights, 24 of them routed experts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from deepinfer_jax.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig  # noqa: E402
from deepinfer_jax.types import SamplingParams  # noqa: E402


def pinned_link_bandwidth(mib: int, runs: int = 5) -> tuple[float, float]:
    """(host-to-device, device-to-host) GB/s of copies between pinned host memory and the device, best of `runs`."""
    import jax

    dev = jax.devices()[0]
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    host = jax.device_put(np.random.default_rng(0).integers(0, 255, size=mib << 20, dtype=np.uint8), pinned)
    host.block_until_ready()
    h2d, d2h = [], []
    for _ in range(runs):
        t = time.perf_counter()
        x = jax.device_put(host, on_dev)
        x.block_until_ready()
        h2d.append(time.perf_counter() - t)
        t = time.perf_counter()
        back = jax.device_put(x, pinned)
        back.block_until_ready()
        d2h.append(time.perf_counter() - t)
        del x, back
    return host.nbytes / min(h2d) / 1e9, host.nbytes / min(d2h) / 1e9


def step_memory(eng) -> dict:
    """The decode step program's device memory as XLA compiled it (the program of fewest token slots that reads the
    params), and copy_in_bytes of its jaxpr."""
    from deepinfer_jax.runner.step_io import meta_struct
    from deepinfer_jax.runner.step_programs import program_kind
    from deepinfer_jax.runner.weight_offload import copy_in_bytes

    def slots(pid):
        kind, key = program_kind(pid)
        return meta_struct(key[0] if kind == "step" else key).token_ids.shape[0]

    runner = eng.runner
    pid = min((p for p in runner.programs.executables if program_kind(p)[0] != "sampler"), key=slots)
    traced = runner.trace(pid)
    m = traced.lower().compile().memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    per_step, held = copy_in_bytes(traced.jaxpr)
    return {"slots": slots(pid), "temp": m.temp_size_in_bytes, "peak": peak,
            "host_args": getattr(m, "host_argument_size_in_bytes", 0), "copied": per_step, "held": held}


def v4_config(path: str, layers: int, tiny: bool) -> ModelConfig:
    """A DeepSeek-V4 ModelConfig: the tests' tiny one (`tiny`), else `path`'s config.json or HF's DeepseekV4Config
    ("default"), cut to its first `layers` layers, without MTP (offload_load.py's `v4_dict`)."""
    from offload_load import v4_dict

    return ModelConfig.from_hf_dict(v4_dict(path, layers, tiny))


def run(eng, prompts, output_len: int) -> dict:
    """All `prompts` at once to the end: output tokens, wall time, engine steps."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    tokens, steps = {}, 0
    t0 = time.perf_counter()
    while len(tokens) < len(prompts):
        for out in eng.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    return {"tokens": tokens, "wall": time.perf_counter() - t0, "steps": steps}


def main(argv=None) -> int:
    from deepinfer_jax.server.args import ArgParser, positive_int

    ap = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite", help="a model of configs/models")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn-impl", default="pallas")
    ap.add_argument("--moe-impl", default="pallas")
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--prompt-len", type=positive_int, default=512)
    ap.add_argument("--output-len", type=positive_int, default=128)
    ap.add_argument("--offload-gib", type=float, default=None, help="GiB of weights in host memory")
    ap.add_argument("--expert-fraction", type=float, default=0.5,
                    help="without --offload-gib: this share of the routed experts' bytes")
    ap.add_argument("--link-mib", type=positive_int, default=1024)
    ap.add_argument("--v4", nargs="?", const="default", default=None, metavar="CONFIG_JSON",
                    help="a DeepSeek-V4 shape instead of --preset (a deepseek_v4 config.json; without one HF's "
                         "DeepseekV4Config)")
    ap.add_argument("--v4-layers", type=positive_int, default=2, help="with --v4: its first this many layers")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model and sizes")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.dtype, args.attn_impl, args.moe_impl = "tiny-deepseek-v2", "float32", "reference", "dense"
        args.batch, args.prompt_len, args.output_len, args.link_mib = 4, 24, 6, 16

    from deepinfer_jax.xla_env import use_host_memory

    use_host_memory(1.0, None)  # pinned host memory: no VMM allocator, set before JAX starts (xla_env.py)
    import jax
    import jax.numpy as jnp

    from deepinfer_jax.engine.llm_engine import LLMEngine
    from deepinfer_jax.runner.compile_cache import enable_compilation_cache
    from deepinfer_jax.runner.weight_offload import host_bytes, param_leaves
    from deepinfer_jax.weights.random_init import random_params
    from kv_tier import agreement  # the tier's benchmark, beside this file

    enable_compilation_cache("default")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    h2d, d2h = pinned_link_bandwidth(args.link_mib)
    print(f"host link (pinned, {args.link_mib} MiB): host-to-device {h2d:.1f} GB/s, device-to-host {d2h:.1f} GB/s",
          flush=True)

    if args.v4:
        cfg = v4_config(args.v4, args.v4_layers, args.smoke)
        args.preset = f"deepseek-v4 ({cfg.num_hidden_layers} layers)"
    else:
        cfg = ModelConfig.from_json_file(os.path.join(os.path.dirname(HERE), "configs", "models",
                                                      f"{args.preset}.json"))
    params = random_params(cfg, jnp.dtype(args.dtype), seed=0)
    leaves = param_leaves(params)
    total = sum(n for _, n in leaves)
    experts = sum(n for p, n in leaves if "experts" in p)
    gib = args.offload_gib if args.offload_gib is not None else args.expert_fraction * experts / 2**30
    print(f"{args.preset}: weights {total / 2**30:.2f} GiB, routed experts {experts / 2**30:.2f} GiB; "
          f"--cpu-offload-gb {gib:.3f}", flush=True)
    max_len = args.prompt_len + args.output_len

    def engine(offload_gib):
        return LLMEngine(cfg, params, None, progress=False,
                         scheduler_config=SchedulerConfig(max_num_seqs=args.batch, max_model_len=max_len,
                                                          max_num_batched_tokens=max(2048, args.prompt_len)),
                         cache_config=CacheConfig(page_size=64, cpu_offload_gb=offload_gib),
                         runner_config=RunnerConfig(dtype=args.dtype, attn_impl=args.attn_impl, moe_impl=args.moe_impl))

    def prompts(n, seed):
        r = np.random.default_rng(seed)
        return [r.integers(2, cfg.vocab_size, args.prompt_len).tolist() for _ in range(n)]

    rows, first = [], None
    for name, g in (("all on device", 0.0), ("offloaded", gib)):
        eng = engine(g)
        moved = host_bytes(eng.runner.params)
        check = run(eng, prompts(min(4, args.batch), 1), args.output_len)["tokens"]
        if first is None:
            first = check
        else:
            print(f"correctness: greedy tokens against the all-on-device engine's: "
                  f"{agreement([first[k] for k in first], [check[k] for k in first])} (bf16: the two engines' "
                  f"programs differ, so a near tie of random weights may part them)", flush=True)
        run(eng, prompts(args.batch, 2), args.output_len)  # warm
        res = run(eng, prompts(args.batch, 3), args.output_len)
        report = eng.memory_report()
        rows.append((name, moved, report["weights"], res, report["kv_cache"], step_memory(eng)))
        del eng
    print(f"\n{'':16}{'host GiB':>10}{'device GiB':>12}{'out tok/s':>11}{'step ms':>9}{'MB/step':>9}{'link GB/s':>11}"
          f"{'of h2d':>8}")
    for name, moved, on_dev, res, _, _ in rows:
        step = res["wall"] / res["steps"]
        rate = moved / step / 1e9
        print(f"{name:16}{moved / 2**30:10.3f}{on_dev / 2**30:12.3f}{args.batch * args.output_len / res['wall']:11.1f}"
              f"{step * 1e3:9.2f}{moved / 1e6:9.1f}{rate:11.1f}{rate / h2d:8.0%}")
    mib = 2**20
    print(f"\ndecode step program ({rows[0][5]['slots']} token slots), device memory as compiled (MiB):")
    print(f"{'':16}{'weights':>9}{'KV cache':>10}{'temp':>9}{'peak':>10}{'host args':>11}{'copied in':>11}"
          f"{'held at once':>14}")
    for name, _, on_dev, _, kv, mem in rows:
        print(f"{name:16}{on_dev / mib:9.1f}{kv / mib:10.1f}{mem['temp'] / mib:9.1f}{mem['peak'] / mib:10.1f}"
              f"{mem['host_args'] / mib:11.1f}{mem['copied'] / mib:11.1f}{mem['held'] / mib:14.1f}")
    (_, _, _, _, _, base), (_, _, _, _, _, off) = rows
    print(f"temporaries with offload less without: {(off['temp'] - base['temp']) / mib:.1f} MiB (one layer's slices: "
          f"{off['held'] / mib:.1f} MiB; every offloaded byte: {off['copied'] / mib:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
