"""DeepSeek-V3.2's shape on one GPU, weights as released: Protocol A and long-context decode, sparse against dense.

    python benchmarks/v32_offline.py [--layers N] [--contexts 32768,65536,131072] [--batch 4] [--steps 32]
                                     [--config CONFIG_JSON] [--phases check,dsa,dense] [--skip-check]
                                     [--engine-per-context] [--results-dir DIR]
    python benchmarks/v32_offline.py --smoke       # CPU: the tests' tiny V3.2, Pallas in interpret mode

The model: HF transformers' DeepseekV32Config (V3.2: hidden 7168, 256 routed experts top-8, 128 heads, MLA latent
512 + 64, the lightning indexer's 64 heads of 128, index_topk 2048, 61 layers of which the first 3 dense) or
`--config`'s, cut to its first `--layers` layers (default: as many as fit the device with room for the KV of
`--batch` sequences at the longest context and `--headroom-gib` for the steps' activations; the sum is printed), no
MTP. Its config.json carries V3.2's release `quantization_config` (FP8 e4m3 blocks of 128 x 128), so
`LLM(load_format="dummy")` draws every projection FP8 on the device (weights/release_random.py) as the loader keeps a
release's; `--attn-impl pallas` runs the indexer's kernel (kernels/dsa_indexer.py), XLA's top-k and sparse MLA
(kernels/mla_sparse.py), `--moe-impl pallas` the FP8 grouped GEMM (kernels/moe_gmm_quant.py). Each phase runs in a
process of its own, so each finds the device empty; `--phases` picks them (a run split over several commands gets
the same default --layers in each; with `--results-dir` the last one's closing table takes the earlier's figures):

1. Correctness (the script stops if it fails): the first `--check-layers` layers (default 4: V3.2's 3 dense layers
   and its first MoE layer) through the engine with the benchmark's impls, greedy, against the same weights through
   attn_impl "reference" / moe_impl "dense" (`--check-moe-impl`), in `--check-dtype`, on prompts of 2,600 and 2,231
   tokens (past index_topk, so the indexer drops keys). The rule is benchmarks/v4_offline.py's: tokens agree up to
   where a prompt's continuations part, and there only at a near tie (each engine's token among the other's two
   most likely: the FP8 linears round their activations to e4m3, which the reference does not). The fp32 reference
   dequantizes the MoE layer's experts (45 GB at V3.2's width); `--check-dtype bfloat16` halves that if it does
   not fit.
2. Protocol A (BENCHMARKS.md): batch 32, 512 random prompt ids, 256 out, ignore EOS, greedy: output tok/s, the
   batch's prefill time (chunks of `--max-num-batched-tokens`), decode ms a step, start-up time; in an engine of
   max_model_len 768 (its own: the engine's page table is max_model_len wide, and so are a sparse step's indexer
   scores and the top-k over them, whatever the sequences' lengths).
3. Long context, sparse (DSA), then in the same process an engine of the longest context: for each of `--contexts`,
   `--batch` random prompts of that length prefilled (chunks of `--long-chunk`), then the same prompts again (their
   pages from the prefix cache) decoding `--steps` tokens: decode ms a step and tok/s. The rows below the longest
   context pay for its width (above); `--engine-per-context` starts an engine of each context's length instead (a
   start-up each). The KV cache's bytes per token (latent + indexer keys) printed.
4. Long context, dense: the same rows for V3's dense MLA at the same layers. The engine has no switch that runs a
   V3.2 model densely: index_topk at or past the context still runs the indexer, its top-k and
   the sparse kernel over every key. So this phase runs the same config as `deepseek_v3` (no indexer: MLA over the
   whole context, V3's paged MLA kernels), its weights drawn the same way. A table of the two closes the run.
Each phase prints a timestamp (seconds since start).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from v4_offline import (RELEASE, add_run_args, check, context_rows, device_limit, expert_kernel_takes,  # noqa: E402
                        layers_that_fit, protocol_a, run_sizes, stamp, start_engine, weight_bytes, write_config)

RELEASE_V32 = {"quantization_config": RELEASE["quantization_config"]}  # V3.2's: no expert_dtype, FP8 experts
CHECK_LENGTHS, CHECK_MAX_LEN = (2600, 2231), 4096


def base_config(path: str | None, smoke: bool) -> dict:
    """The full model's deepseek_v32 config: the tests' tiny V3.2 (smoke), `path`'s, or HF's DeepseekV32Config."""
    if smoke:
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
        from hf_models import COMMON, V32_CASES

        return dict(COMMON, **V32_CASES["v32_sparse"])
    if path:
        with open(path) as f:
            return dict(json.load(f), model_type="deepseek_v32")
    from transformers import DeepseekV32Config

    return DeepseekV32Config().to_dict()


def cut(d: dict, layers: int, smoke: bool) -> dict:
    """`d` cut to its first `layers` layers, no MTP, as a release config (FP8 blocks of 8 x 12 in the smoke run: the
    tiny model's odd sizes leave partial blocks at the edges)."""
    from offload_load import v4_cut

    d = dict(v4_cut(d, layers), **json.loads(json.dumps(RELEASE_V32)))
    if smoke:
        d["quantization_config"]["weight_block_size"] = [8, 12]
    return d


def dense_config(d: dict) -> dict:
    """`d` as DeepSeek-V3: the same layers without the indexer (dense MLA)."""
    return dict({k: v for k, v in d.items() if not k.startswith("index_") and k != "layer_types"},
                model_type="deepseek_v3")


def kv_bytes_per_token(d: dict) -> tuple[int, int]:
    """(latent, indexer key) bytes a token of context takes in the cache of `d`'s layers (bf16)."""
    from deepinfer_jax.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(d)
    return 2 * cfg.num_hidden_layers * cfg.latent_dim, 2 * cfg.num_hidden_layers * cfg.index_head_dim


def kv_bytes(d: dict, seqs: int, context: int) -> int:
    """Device bytes of the cache for `seqs` sequences of `context` tokens (pages of 64, bf16)."""
    return seqs * -(-context // 64) * 64 * sum(kv_bytes_per_token(d))


def fit_report(full: dict, layers: int, a: argparse.Namespace, budget: float, context: int) -> str:
    """The sum behind the default --layers: weights outside the layers, the layers', the KV, the headroom."""
    outside, per_layer = weight_bytes(cut(full, layers, False))
    dense = min(layers, full.get("first_k_dense_replace") or 0)
    moe = per_layer[dense:] or [0]
    kv = kv_bytes(cut(full, layers, False), a.batch, context)
    total = outside + sum(per_layer) + kv + a.headroom_gib * 2**30
    g = 2**30
    return (f"{layers} layers fit {budget / g:.1f} GiB (the device's limit x --gpu-memory-utilization): weights "
            f"outside the layers {outside / g:.2f} + {dense} dense x {(per_layer[0] if dense else 0) / g:.2f} + "
            f"{layers - dense} MoE x {moe[0] / g:.2f} + KV {kv / g:.2f} ({a.batch} x {context:,} tokens, "
            f"{sum(kv_bytes_per_token(cut(full, layers, False))):,} B a token) + headroom {a.headroom_gib:.1f} = "
            f"{total / g:.2f} GiB")


def model_layers(full: dict, a: argparse.Namespace, contexts: list[int]):
    """--layers, its default (the sparse model's fit, whichever phase asks: the dense phase runs the same layers)
    set on `a` and its sum printed; returns device_limit()."""
    dev, limit, measured = device_limit()
    if a.layers is None:
        budget, longest = limit * a.gpu_memory_utilization, max(contexts) + a.steps + 1
        a.layers = layers_that_fit(full, budget, a.batch, longest, a.headroom_gib * 2**30, cut=cut, kv_bytes=kv_bytes)
        if a.layers < 1:
            sys.exit(f"not one layer fits {limit / 2**30:.1f} GiB with the KV of {a.batch} x {max(contexts):,} tokens")
        print(fit_report(full, a.layers, a, budget, longest), flush=True)
    return dev, limit, measured


def phase_dsa(full: dict, a: argparse.Namespace, contexts: list[int], impls: dict) -> dict:
    """Sections 2 and 3 of the docstring; the layers and the long-context rows."""
    import jax

    dev, limit, measured = model_layers(full, a, contexts)
    d = cut(full, a.layers, a.smoke)
    outside, per_layer = weight_bytes(d)
    dense = min(a.layers, d.get("first_k_dense_replace") or 0)
    stamp(f"device {dev.device_kind} ({jax.default_backend()}, {limit / 2**30:.1f} GiB"
          f"{'' if measured else ' assumed'}, XLA_PYTHON_CLIENT_MEM_FRACTION "
          f"{os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION']}); model: hidden "
          f"{d['hidden_size']}, {d['n_routed_experts']} experts top-{d['num_experts_per_tok']}, FP8 blocks "
          f"{d['quantization_config']['weight_block_size']}, index_topk {d['index_topk']}; {a.layers} of "
          f"{full['num_hidden_layers']} layers ({dense} dense, {a.layers - dense} MoE); weights "
          f"{(outside + sum(per_layer)) / 2**30:.2f} GiB; attn {a.attn_impl}, moe {a.moe_impl}, {a.dtype}")
    if a.moe_impl.startswith("pallas"):
        steps = sorted({a.batch, a.pa_batch, a.max_num_batched_tokens, a.long_chunk})
        takes = {n: expert_kernel_takes(d, n, "fp8") for n in steps}
        print(f"FP8 expert kernel takes the steps of {', '.join(f'{n} tokens: {t}' for n, t in takes.items())}",
              flush=True)
    latent, index = kv_bytes_per_token(d)
    print(f"KV cache bytes per token of context ({a.layers} layers, bf16): {latent + index:,} (latent {latent:,}, "
          f"indexer keys {index:,}); V3's dense MLA: {latent:,}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        path = write_config(d, root, "model")
        llm = start_engine(path, a, impls, a.pa_prompt_len + a.pa_output_len, a.pa_batch, a.max_num_batched_tokens,
                           sorted({a.pa_batch, a.max_num_batched_tokens}))
        protocol_a(llm.engine, d["vocab_size"], a.pa_batch, a.pa_prompt_len, a.pa_output_len)
        stamp(f"Protocol A done; compiles after warm-up: {llm.engine.runner.compiles_after_warmup}")
        del llm
        gc.collect()  # its weights and pages off the device before the next engine's
        stamp("long context, DeepSeek Sparse Attention:")
        if not a.engine_per_context and len(contexts) > 1:
            print(f"(one engine of max_model_len {max(contexts) + a.steps + 1:,}: a step's indexer scores and top-k "
                  "span that many keys at every context; --engine-per-context sizes an engine to each)", flush=True)
        rows = long_rows(path, a, impls, d["vocab_size"], contexts,
                         lambda ctx: f"{kv_bytes(d, a.batch, ctx) / 2**30:.2f}")
    return {"layers": a.layers, "rows": rows, "kv_per_token": latent + index}


def long_rows(path: str, a: argparse.Namespace, impls: dict, vocab: int, contexts: list[int], kv_text) -> list[dict]:
    """The long-context rows (v4_offline.context_rows) of the model at `path`: one engine for every context, or with
    --engine-per-context one each, of that context's max_model_len. (The page table is max_model_len wide, and so
    are each step's indexer scores and the top-k over them, whatever the context.)"""
    rows = []
    for group in ([[c] for c in contexts] if a.engine_per_context else [contexts]):
        llm = start_engine(path, a, impls, max(group) + a.steps + 1, a.batch, a.long_chunk,
                           sorted({a.batch, a.long_chunk}))
        rows += context_rows(llm.engine, vocab, group, a.batch, a.steps, "KV GiB", kv_text)
        stamp(f"compiles after warm-up: {llm.engine.runner.compiles_after_warmup}")
        del llm
        gc.collect()
    return rows


def phase_dense(full: dict, a: argparse.Namespace, contexts: list[int], impls: dict) -> dict:
    """Section 4 of the docstring: the long-context rows of V3's dense MLA at the same layers."""
    model_layers(full, a, contexts)
    d = dense_config(cut(full, a.layers, a.smoke))
    latent, _ = kv_bytes_per_token(d)
    stamp(f"long context, dense MLA (the same {a.layers} layers as deepseek_v3, no indexer):")
    with tempfile.TemporaryDirectory() as root:
        rows = long_rows(write_config(d, root, "dense"), a, impls, d["vocab_size"], contexts,
                         lambda ctx: f"{a.batch * -(-ctx // 64) * 64 * latent / 2**30:.2f}")
    return {"layers": a.layers, "rows": rows, "kv_per_token": latent}


def in_own_process(argv: list[str], phase: str, out: str) -> dict | None:
    """This script's `phase` in a process of its own (`argv` its arguments); its JSON result or None."""
    rc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--phase", phase, "--out", out]).returncode
    if rc:
        print(f"the {phase} phase failed (exit status {rc})", flush=True)
        return None
    with open(out) as f:
        return json.load(f)


def compare(sparse: dict, dense: dict, batch: int) -> None:
    """The closing table: decode at each context, DSA beside dense MLA."""
    print(f"\ndecode at long context, {batch} sequences, {sparse['layers']} layers (ms a step; tok/s):")
    print(f"{'context':>9} | {'DSA ms':>8} {'DSA tok/s':>10} | {'dense ms':>8} {'dense tok/s':>11} | "
          f"{'dense / DSA':>11} | KV B/token DSA / dense")
    by_ctx = {r["context"]: r for r in dense["rows"]}
    for r in sparse["rows"]:
        q = by_ctx.get(r["context"], {"error": "not run"})
        s = f"{r['decode_ms']:8.2f} {r['decode_tok_s']:10,.1f}" if "error" not in r else f"{'failed':>19}"
        t = f"{q['decode_ms']:8.2f} {q['decode_tok_s']:11,.1f}" if "error" not in q else f"{q['error'][:20]:>20}"
        ratio = f"{q['decode_ms'] / r['decode_ms']:10.2f}x" if "error" not in r and "error" not in q else f"{'':>11}"
        kv = f"{sparse['kv_per_token']:,} / {dense['kv_per_token']:,}"
        print(f"{r['context']:>9,} | {s} | {t} | {ratio} | {kv}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_run_args(ap, "32768,65536,131072", 4, "deepseek_v32")
    ap.add_argument("--long-chunk", type=int, default=4096,
                    help="the long contexts' prefill chunk (a step's indexer scores are chunk x max_model_len "
                         "fp32, 2 GiB at 4096 x 128K, and XLA's top-k runs over them)")
    ap.add_argument("--engine-per-context", action="store_true",
                    help="an engine for each long context, of that context's max_model_len")
    ap.add_argument("--phases", default="check,dsa,dense",
                    help="which of check, dsa (Protocol A and sparse long context), dense to run, in that order")
    ap.add_argument("--phase", default=None, choices=["check", "dsa", "dense"], help=argparse.SUPPRESS)
    ap.add_argument("--results-dir", default=None,
                    help="keep the phases' figures here (dsa.json, dense.json): the closing table takes an earlier "
                         "run's where this run skips that phase")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)  # a phase's JSON result
    args = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(args)
    contexts = run_sizes(a)
    if a.smoke:
        a.long_chunk = 16  # chunked prefills of the smoke's 24- and 40-token prompts
    impls = dict(attn_impl=a.attn_impl, moe_impl=a.moe_impl)
    if a.phase is not None:
        full = base_config(a.config, a.smoke)
        from deepinfer_jax.runner.compile_cache import enable_compilation_cache

        enable_compilation_cache("default")
        with tempfile.TemporaryDirectory() as root:
            if a.phase == "check":
                check(cut(full, a.check_layers, a.smoke), root, impls, a.check_moe_impl, a.check_dtype, a.smoke,
                      CHECK_LENGTHS, CHECK_MAX_LEN)
                return 0
        result = (phase_dsa if a.phase == "dsa" else phase_dense)(full, a, contexts, impls)
        with open(a.out, "w") as f:
            json.dump(result, f)
        return 0
    phases = [p for p in a.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - {"check", "dsa", "dense"})
    if unknown:
        sys.exit(f"--phases: {', '.join(unknown)} is not one of check, dsa, dense")
    results, earlier = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        keep = a.results_dir or tmp
        os.makedirs(keep, exist_ok=True)
        if "check" in phases and not a.skip_check:
            rc = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--phase", "check"]).returncode
            if rc:
                sys.exit(f"the check failed (exit status {rc}): no timings")
            stamp("check passed")
        for phase in ("dsa", "dense"):
            path = os.path.join(keep, f"{phase}.json")
            if phase in phases:
                results[phase] = in_own_process(args, phase, path)
            elif a.results_dir and os.path.exists(path):
                with open(path) as f:
                    earlier[phase] = json.load(f)
    both = {**earlier, **{k: v for k, v in results.items() if v}}
    if both.get("dsa") and both.get("dense"):
        if both["dsa"]["layers"] == both["dense"]["layers"]:
            compare(both["dsa"], both["dense"], a.batch)
        else:
            print(f"no closing table: the sparse rows are of {both['dsa']['layers']} layers, the dense rows of "
                  f"{both['dense']['layers']}", flush=True)
    stamp("done")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
