"""Command-line flags for `deepinfer serve` / `chat` / `generate`, and the YAML config that mirrors them.

Flag names follow `vllm serve` where they mean the same thing. A YAML file (`--config FILE`) takes the
same keys with underscores or dashes (`enable_prefix_caching: false`, `served_model_name: [a, b]`);
it is turned into flags placed before the real command line, so flags given there win and every
value goes through the same type checks. An unknown key is an error.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                 "default-model")
DEFAULT_MODEL_NAME = "deepinfer-default"
# Engine sizes used when a flag is not given: the general defaults (vLLM's), and smaller ones for the
# embedded demo model so that its first start (which compiles every step shape) stays short on a CPU.
GENERAL_DEFAULTS = {"max_num_seqs": 256, "max_num_batched_tokens": None, "max_model_len": None}
DEMO_DEFAULTS = {"max_num_seqs": 32, "max_num_batched_tokens": 256, "max_model_len": 2048}


def add_engine_args(p: argparse.ArgumentParser, *, model_required: bool = False) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", required=model_required, default=None,
                   help="model directory (HF safetensors + config.json + tokenizer). Default: the small "
                        "embedded demo model shipped in the package (random weights)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the model directory's config.json (benchmarks)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (prompt + output); default min(max_position_embeddings, 4096) "
                        "(2048 for the embedded demo model)")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences per engine step (default 256; 32 for the embedded demo model)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step (default max(2048, max_num_seqs); 256 for the demo model)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory for weights + KV cache")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--enable-expert-parallel", action="store_true", help="experts sharded over TP x DP")
    g.add_argument("--page-size", "--block-size", dest="page_size", type=int, default=64,
                   help="tokens per KV cache page (vLLM's --block-size)")
    g.add_argument("--num-pages", type=int, default=None, help="fix the KV cache size in pages")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat-template", default=None, help="a Jinja file, a built-in name or template text")
    g.add_argument("--attn-impl", default=None, help="attention implementation (engine default if unset)")
    g.add_argument("--moe-impl", default=None, help="MoE implementation (engine default if unset)")
    g.add_argument("--unroll-max-tokens", type=int, default=None,
                   help="steps of at most this many token slots run the layers unrolled: faster decode steps, "
                        "but each such bucket's programs take tens of seconds more to compile on an empty "
                        "cache (default: 256 on a GPU; 0: never, the quickest cold start)")
    g.add_argument("--prefill-layers", choices=["scan", "indexed"], default=None,
                   help="how steps above --unroll-max-tokens run their layers: lax.scan, or straight-line with "
                        "each layer's weights read by a runtime index (compiled once for all layers; the default "
                        "on a GPU)")
    g.add_argument("--prefill-context-variant", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill buckets get a program with the attention's context part and one without, picked "
                        "on the host, instead of a per-layer branch that keeps the host waiting for the step "
                        "(default: on; off compiles fewer programs)")
    g.add_argument("--greedy-variant", action=argparse.BooleanOptionalAction, default=None,
                   help="decode buckets get a program for steps whose every request is greedy, without the random "
                        "draw (default: on; off compiles fewer programs)")
    g.add_argument("--prefill-shared-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill buckets run a step as two programs, the bucket's forward (shared by its sampling "
                        "variants) and the variant's sampler, so warm-up compiles fewer whole forwards (one "
                        "device; default: on)")
    g.add_argument("--compilation-cache-dir", default="default",
                   help='XLA compilation cache, and in its programs/ the compiled step programs a warm start '
                        'loads untraced ("default": $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer-jax/xla; "none": off)')


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file with the same keys as these flags")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model'; the first is reported (default: the --model value)")
    g.add_argument("--api-key", default=os.environ.get("DEEPINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $DEEPINFER_API_KEY)")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1"],
                   help="split <think>...</think> into reasoning_content")
    g.add_argument("--tool-call-parser", default=None, choices=["deepseek_v3", "deepseek_v31"])
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility; tool_choice 'auto' works whenever --tool-call-parser is set")
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="sequences allowed to wait beyond --max-num-seqs; more get 429 (default: unbounded)")
    g.add_argument("--max-payload-size", type=int, default=16 * 2**20, help="largest request body in bytes (413)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def yaml_to_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """Turn a YAML mapping of flag names to values into argv (see the module docstring)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"error: {path}: the config must be a mapping of flag names to values")
    options = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = options.get(dest)
        if action is None or dest in ("config", "help"):
            raise SystemExit(f"error: {path}: unknown key {key!r}")
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if value is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise SystemExit(f"error: {path}: {key} must be true or false")
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise SystemExit(f"error: {path}: {key} must be true or false")
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv += [flag] + [str(v) for v in value]
        else:
            argv += [flag, str(value).lower() if isinstance(value, bool) else str(value)]
    return argv


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv, first expanding `--config FILE` into flags that argv then overrides."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        argv = yaml_to_argv(known.config, parser) + list(argv)
    return parser.parse_args(argv)


def resolve_model(ns: argparse.Namespace) -> tuple[str, str]:
    """(model directory, default served name): --model, or the embedded default model."""
    if ns.model:
        return ns.model, ns.model
    return DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME


def engine_kwargs(ns: argparse.Namespace, *, progress: bool = True) -> dict[str, Any]:
    """Keyword arguments for `LLM(model, **kw)` from the engine flags."""
    sizes = {k: getattr(ns, k) if getattr(ns, k) is not None else d
             for k, d in (GENERAL_DEFAULTS if ns.model else DEMO_DEFAULTS).items()}
    kw: dict[str, Any] = dict(
        dtype=ns.dtype, **sizes, page_size=ns.page_size,
        gpu_memory_utilization=ns.gpu_memory_utilization, enable_prefix_caching=ns.enable_prefix_caching,
        seed=ns.seed, tensor_parallel_size=ns.tensor_parallel_size, data_parallel_size=ns.data_parallel_size,
        enable_expert_parallel=ns.enable_expert_parallel, num_pages=ns.num_pages,
        chat_template=ns.chat_template, progress=progress, load_format=ns.load_format,
        compilation_cache_dir=None if ns.compilation_cache_dir == "none" else ns.compilation_cache_dir)
    if ns.attn_impl:
        kw["attn_impl"] = ns.attn_impl
    if ns.moe_impl:
        kw["moe_impl"] = ns.moe_impl
    if ns.unroll_max_tokens is not None:
        kw["unroll_max_tokens"] = ns.unroll_max_tokens
    if ns.prefill_layers is not None:
        kw["prefill_layers"] = ns.prefill_layers
    if ns.prefill_context_variant is not None:
        kw["prefill_context_variant"] = ns.prefill_context_variant
    if ns.greedy_variant is not None:
        kw["greedy_variant"] = ns.greedy_variant
    if ns.prefill_shared_forward is not None:
        kw["prefill_shared_forward"] = ns.prefill_shared_forward
    return kw
