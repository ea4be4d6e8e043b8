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
        from deepinfer_jax.engine import plan

        return plan.main(rest)
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
