"""The `deepinfer` command: serve, chat, generate, bench, convert.

    deepinfer serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--config FILE.yaml] ...
    deepinfer chat [--model DIR]                    interactive, streaming, reasoning shown dimmed
    deepinfer generate [--model DIR] --prompt TEXT  one-shot generation
    deepinfer bench serve --base-url URL ...        Protocol B / C against a running server
    deepinfer bench offline [--preset NAME] ...     Protocol A (offline batch, random weights)
    deepinfer convert ...                           deepinfer_jax.weights.convert
    deepinfer plan --model DIR [--gpu-memory GIB]   weights / KV bytes per device, whether it fits (no weights read)

Without --model, the embedded default model is used, so every command works on a fresh machine without
downloads: a 5M-parameter DeepSeek-V3-architecture model (MLA, routed experts, an MTP layer) trained by
tools/train_default_model.py for greetings and small talk, sums and products with a <think> working, get_weather /
get_time tool calls and JSON with asked keys; its card (deepinfer_jax/assets/default-model/README.md) gives its
rates. It knows nothing else. Heavy imports (JAX) happen only inside the subcommands that need them.
Usage errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _serve_parser() -> argparse.ArgumentParser:
    from deepinfer_jax.server.args import ArgParser, add_engine_args, add_server_args

    from deepinfer_jax.server import vllm_flags

    p = ArgParser(prog="deepinfer serve", description="OpenAI-compatible HTTP server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model directory, as `vllm serve MODEL` (the same as --model)")
    add_server_args(p)
    add_engine_args(p)
    vllm_flags.install(p)
    return p


def _plan(argv: list[str]) -> int:
    """`deepinfer plan`: serve's flag names, value checks and model-directory checks (one-line usage errors, exit
    status 2), then engine/plan.py `report`."""
    from deepinfer_jax.server import args as a

    p = a.ArgParser(prog="deepinfer plan", description="will a model fit (reads no weights)")
    p.add_argument("--model", required=True)
    p.add_argument("--tensor-parallel-size", "-tp", type=a.positive_int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=a.positive_int, default=1)
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true")
    p.add_argument("--pipeline-parallel-size", "-pp", type=a.positive_int, default=1)
    p.add_argument("--dtype", type=a.value_alias("dtype"), default="auto",
                   choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--quantization", "-q", default=None, choices=["auto", "none", "fp8", "int8", "int4"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    p.add_argument("--gpu-memory", type=a.positive_float, default=None, metavar="GIB", help="GiB of memory per device")
    p.add_argument("--gpu-memory-utilization", type=a.fraction, default=0.9)
    p.add_argument("--max-model-len", type=a.token_count, default=None)
    p.add_argument("--page-size", "--block-size", dest="page_size", type=a.power_of_two, default=64,
                   help="tokens per KV cache page (DeepSeek-V4: sizes its per-group pools)")
    p.add_argument("--max-num-seqs", type=a.positive_int, default=256,
                   help="DeepSeek-V4: sequences its windowed pools hold")
    p.add_argument("--max-num-batched-tokens", type=a.token_count, default=None,
                   help="DeepSeek-V4: a step's tokens its windowed pools hold (default max(2048, --max-num-seqs))")
    p.add_argument("--cpu-offload-gb", type=a.nonnegative_float, default=0.0, metavar="GIB",
                   help="GiB of weights in host memory")
    p.add_argument("--kv-offloading-size", type=a.nonnegative_float, default=0.0, metavar="GIB",
                   help="GiB of host memory for the KV host tier")
    p.add_argument("--speculative-config", "-sc", type=a.speculative_config, default=None,
                   help='serve\'s JSON, e.g. {"method": "deepseek_mtp", "num_speculative_tokens": 1}: the MTP '
                        "layer's cache rows are counted per token")
    p.add_argument("--json", action="store_true", help="the plan as JSON (its fields: docs/quantization.md)")
    ns = p.parse_args(argv)
    problem = a.model_dir_problem(ns.model)
    if problem:
        p.error(f"argument --model: {problem}")
    if ns.max_model_len is not None:
        from deepinfer_jax.config import ModelConfig

        limit = ModelConfig.from_model_dir(ns.model).max_position_embeddings
        if ns.max_model_len > limit:
            p.error(f"argument --max-model-len: {ns.max_model_len} exceeds the model's max_position_embeddings {limit}")
    from deepinfer_jax.engine import plan

    return plan.report(ns)


def _convert(argv: list[str]) -> int:
    try:
        mod = importlib.import_module("deepinfer_jax.weights.convert")
    except ModuleNotFoundError as e:
        if e.name not in ("deepinfer_jax.weights.convert",):
            raise
        print("deepinfer convert: error: weight conversion is not available in this build "
              "(the module deepinfer_jax.weights.convert is missing)", file=sys.stderr)
        return 2
    return int(mod.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("serve", "chat", "generate", "bench", "convert", "plan")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        if argv and argv[0] in ("--version", "-V"):
            from deepinfer_jax import __version__

            print(f"deepinfer {__version__}")
            return 0
        if argv and argv[0] not in ("-h", "--help"):
            print(f"deepinfer: error: unknown command {argv[0]!r} (choose from {', '.join(commands)}; "
                  "deepinfer --help)", file=sys.stderr)
            return 2
        print(__doc__.strip(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "convert":
        return _convert(rest)
    if cmd == "plan":
        return _plan(rest)
    if cmd == "bench":
        from deepinfer_jax.server import bench

        return bench.main(rest)
    if cmd == "serve":
        from deepinfer_jax.server.args import check_engine_args, parse_with_config

        parser = _serve_parser()
        ns = check_engine_args(parser, parse_with_config(parser, rest))
        from deepinfer_jax.server.app import serve

        return serve(ns)
    from deepinfer_jax.server import terminal

    return terminal.main(cmd, rest)


if __name__ == "__main__":
    sys.exit(main())
