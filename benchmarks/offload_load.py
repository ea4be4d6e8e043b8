"""Loading with weights in host memory (`--cpu-offload-gb`, docs/offload.md): the device memory a load takes, with
the offloaded weights put straight into pinned host memory against loading everything on the device first.

    python benchmarks/offload_load.py [--dir /tmp/offload-load-v3-fp8] [--moe-layers 2] [--device-gib G]
    python benchmarks/offload_load.py --smoke      # CPU: a narrow model (checks the script, not the memory)
    python benchmarks/offload_load.py --v4 [CONFIG_JSON] [--v4-layers 2] [--smoke]   # a DeepSeek-V4 shape instead

The model: benchmarks/protocol_f.py's FP8 checkpoint of DeepSeek-V3 at full width (1 dense + --moe-layers MoE
layers, random weights; written to --dir unless its config.json is there), or with --v4 a DeepSeek-V4 bf16
checkpoint (`write_v4_checkpoint`: a deepseek_v4 config.json's shape, HF's DeepseekV4Config, V4-Flash's width,
without one, its first --v4-layers layers; random weights in HF's names, routed experts fused; --smoke: the tests'
tiny V4). --offload-gib (default: every routed
expert's bytes) goes to host memory. Each load runs in a process of its own, its device limited to --device-gib
(default: three quarters of the weights, so the whole model does not fit; XLA_PYTHON_CLIENT_MEM_FRACTION from
nvidia-smi's total), three ways:
- `all`: every weight on the device (no offload): expected to fail for want of memory under the limit;
- `moved`: loaded on the device, then the chosen weights moved to the host (`LoadFirst`, what a loader without
  `load_to` does): expected to fail the same way, since the whole model is on the device before the move;
- `direct`: the chosen weights put in pinned host memory straight from the checkpoint (`PendingParams.load_to`).
Each prints its outcome, the load's seconds, the device's peak bytes in use (the allocator's `peak_bytes_in_use`,
which counts every buffer the load made), the weights' bytes on the device and in host memory after it, and an
fp64 sum of every weight, which must be the same wherever a load succeeds (the same arrays, wherever they live).
Pass for the `direct` row: it loads, its peak is at most the weights less the offloaded bytes plus one stacked
leaf's worth of load temporaries, and its sums equal the other successful rows' (run with a --device-gib the whole
model fits to compare them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

GIB = 2**30


def _gpu_total_gib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, check=True).stdout
        return float(out.split()[0]) / 1024
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None


def child(d: str, mode: str, offload_gib: float) -> dict:
    """One load (a fresh process, so the allocator's peak is the load's) -> a result row."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from deepinfer_jax.runner.weight_offload import LoadFirst, choose, host_bytes, offload, param_leaves, place
    from deepinfer_jax.weights.loader import prepare_model

    row = {"mode": mode}
    t = time.perf_counter()
    try:
        _, announced = prepare_model(d, jnp.bfloat16, progress=False)
        pending = announced
        if mode != "all":
            pending, _ = offload(announced, offload_gib)
            if mode == "moved":
                chosen = set(choose(param_leaves(announced.abstract), int(offload_gib * GIB)))  # offload's choice
                pending = LoadFirst(pending.abstract, lambda: place(announced.load(), chosen))
        params = pending.result()
        jax.block_until_ready(params)
        row["seconds"] = time.perf_counter() - t
        host = host_bytes(params)
        row["host_gib"] = host / GIB
        row["device_gib"] = (sum(n for _, n in param_leaves(params)) - host) / GIB
        # fp64 sums in numpy, one leaf at a time (host leaves are never copied to the device)
        row["sums"] = [float(np.asarray(x).astype(np.float64).sum()) for x in jax.tree.leaves(params)]
        row["ok"] = True
    except Exception as e:  # noqa: BLE001 - an out-of-memory failure is this benchmark's expected outcome
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
                   seconds=time.perf_counter() - t)
    stats = jax.devices()[0].memory_stats() or {}
    row["peak_gib"] = stats.get("peak_bytes_in_use", 0) / GIB if stats else None
    row["limit_gib"] = stats.get("bytes_limit", 0) / GIB if stats else None
    return row


def write_v4_checkpoint(d: str, cfg: dict, seed: int = 0) -> None:
    """A DeepSeek-V4 bf16 checkpoint of `cfg` in HF's names (weights/name_table_v4.py's tensors, routed experts
    fused), one file a layer. Values: windows of a shared pool of normal draws (seconds a layer, not minutes), norms
    and hyper-connection scales around 1, correction biases in [0, 0.1), hash tables of valid expert ids."""
    import ml_dtypes
    import numpy as np

    from protocol_f import STD, _Writer

    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.weights.name_table_v4 import v4_expected_tensors

    class Writer(_Writer):
        DT = {**_Writer.DT, "I32": 4}

    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    v4 = ModelConfig.from_model_dir(d).v4
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 26, np.float32) * STD).astype(ml_dtypes.bfloat16)
    files: dict[str, list] = {}
    for r in v4_expected_tensors(v4, frozenset(range(v4.num_hidden_layers))):
        parts = r.hf_name.split(".")
        fname = f"model.layer{int(parts[2]):02d}.safetensors" if parts[1] == "layers" else "model.rest.safetensors"
        if all(r.hf_name != n for n, _ in files.get(fname, [])):  # (a tied LM head names the embedding again)
            files.setdefault(fname, []).append((r.hf_name, r.hf_shape))
    weight_map = {}
    for fname, tensors in files.items():
        w = Writer(os.path.join(d, fname), [(n, "I32" if n.endswith("tid2eid") else "BF16", s) for n, s in tensors])
        for name, shape in tensors:
            n = int(np.prod(shape))
            if name.endswith("tid2eid"):
                a = rng.integers(0, v4.n_routed_experts, shape, np.int32)
            elif name.endswith(("norm.weight", "layernorm.weight", "scale")):
                a = (1 + 0.1 * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)
            elif name.endswith("e_score_correction_bias"):
                a = rng.uniform(0, 0.1, shape).astype(ml_dtypes.bfloat16)
            else:
                start = int(rng.integers(0, pool.size))
                a = (np.resize(pool[start:], n) if n > pool.size - start else pool[start:start + n]).reshape(shape)
            w.write(name, a)
            weight_map[name] = fname
        w.close()
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def v4_dict(path: str, layers: int, tiny: bool) -> dict:
    """The deepseek_v4 config of --v4: the tests' tiny one, `path`'s, or HF's DeepseekV4Config ("default"), cut to
    its first `layers` layers, without MTP."""
    if tiny:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from hf_models_v4 import V4_TINY

        return dict(V4_TINY, model_type="deepseek_v4")
    if path == "default":
        from transformers import DeepseekV4Config

        d = DeepseekV4Config().to_dict()
    else:
        with open(path) as f:
            d = json.load(f)
    return v4_cut(d, layers)


def v4_cut(d: dict, layers: int) -> dict:
    """The deepseek_v4 config `d` cut to its first `layers` layers (the per-layer kinds with them), without MTP."""
    d = dict(d, num_hidden_layers=min(layers, d["num_hidden_layers"]), num_nextn_predict_layers=0)
    for k in ("layer_types", "mlp_layer_types"):
        if d.get(k):
            d[k] = d[k][:layers]
    return d


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/offload-load-v3-fp8")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--offload-gib", type=float, default=None, help="default: every routed expert's bytes")
    ap.add_argument("--device-gib", type=float, default=None, help="default: 3/4 of the weights")
    ap.add_argument("--modes", default="all,moved,direct")
    ap.add_argument("--smoke", action="store_true", help="a narrow V3 on the CPU: checks that the script runs")
    ap.add_argument("--v4", nargs="?", const="default", default=None, metavar="CONFIG_JSON",
                    help="a DeepSeek-V4 bf16 checkpoint instead (a deepseek_v4 config.json's shape; without one HF's "
                         "DeepseekV4Config)")
    ap.add_argument("--v4-layers", type=int, default=2, help="with --v4: its first this many layers")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("ROW " + json.dumps(child(a.dir, a.child, a.offload_gib)), flush=True)
        return 0

    from protocol_f import v3_config, write_checkpoint

    if a.v4:
        cfg, write_checkpoint = v4_dict(a.v4, a.v4_layers, a.smoke), write_v4_checkpoint  # noqa: F811
        if a.dir == ap.get_default("dir"):
            a.dir = "/tmp/offload-load-v4" + ("-smoke" if a.smoke else f"-{cfg['num_hidden_layers']}")
    else:
        cfg = v3_config(a.moe_layers)
    if a.smoke and not a.v4:
        cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_attention_heads=2,
                   num_key_value_heads=2, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                   q_lora_rank=128, kv_lora_rank=128, vocab_size=1024)
        a.dir = a.dir + "-smoke"
    if not os.path.exists(os.path.join(a.dir, "config.json")):
        t = time.time()
        write_checkpoint(a.dir, cfg)
        print(f"wrote the {'V4 bf16' if a.v4 else 'FP8'} checkpoint ({cfg['num_hidden_layers']} layers) to {a.dir} "
              f"in {time.time() - t:.0f}s",
              flush=True)
    # No deepinfer XLA defaults in the loads: their VMM-allocator command-buffer mode crashes copies to pinned host
    # memory on a GPU (the engine takes it out itself for --cpu-offload-gb), and a load runs no step programs.
    env = {**os.environ, "DEEPINFER_XLA_DEFAULTS": "0"}
    if a.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    # the weights' and the routed experts' bytes, from the checkpoint's headers (no device)
    probe = subprocess.run([sys.executable, "-c", (
        "import json, jax.numpy as jnp; from deepinfer_jax.weights.loader import prepare_model; "
        "from deepinfer_jax.runner.weight_offload import param_leaves; "
        f"l = param_leaves(prepare_model({a.dir!r}, jnp.bfloat16, progress=False)[1].abstract); "
        "print(json.dumps([sum(n for _, n in l), sum(n for p, n in l if 'experts' in p and 'shared' not in p)]))")],
        capture_output=True, text=True, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=os.path.dirname(HERE))
    if probe.returncode:
        print(probe.stderr[-2000:])
        return 1
    total, experts = json.loads(probe.stdout.strip().splitlines()[-1])
    offload_gib = a.offload_gib if a.offload_gib is not None else experts / GIB
    device_gib = a.device_gib if a.device_gib is not None else 0.75 * total / GIB
    gpu = _gpu_total_gib()
    if gpu and not a.smoke:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(device_gib / gpu, 0.95):.4f}"
    print(f"weights {total / GIB:.3f} GiB, offloaded {offload_gib:.3f} GiB (routed experts {experts / GIB:.3f}), "
          f"device limited to {device_gib:.3f} GiB" + ("" if gpu else " (no GPU: not limited)"), flush=True)
    rows = []
    for mode in a.modes.split(","):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--dir", a.dir, "--child", mode,
                              "--offload-gib", str(offload_gib)], capture_output=True, text=True, env=env)
        line = [x for x in out.stdout.splitlines() if x.startswith("ROW ")]
        if not line:
            print(f"{mode}: the process failed (rc {out.returncode}):\n{out.stderr[-2000:]}")
            rows.append({"mode": mode, "ok": False, "error": f"rc {out.returncode}"})
            continue
        rows.append(json.loads(line[-1][4:]))
    print(f"\n{'mode':>7} {'loaded':>7} {'s':>6} {'peak GiB':>9} {'device GiB':>11} {'host GiB':>9}  note")
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        print(f"{r['mode']:>7} {'yes' if r['ok'] else 'no':>7} {r.get('seconds', 0):>6.1f} {fmt(r.get('peak_gib')):>9} "
              f"{fmt(r.get('device_gib')):>11} {fmt(r.get('host_gib')):>9}  {r.get('error', '')}")
    sums = [r["sums"] for r in rows if r["ok"]]
    if len(sums) > 1:
        same = all(s == sums[0] for s in sums[1:])
        print(f"\nthe loaded weights' sums are {'the same' if same else 'DIFFERENT'} across the successful loads")
        if not same:
            return 1
    direct = next((r for r in rows if r["mode"] == "direct"), None)
    if direct is not None and not direct["ok"]:
        print("FAIL: the direct load did not fit")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
