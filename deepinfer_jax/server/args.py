"""Command-line flags for `deepinfer serve` / `chat` / `generate`, and the YAML config that mirrors them.

Flag names (and their vLLM spellings: `--max_model_len`, `32k`) follow `vllm serve` where they mean the same thing.
A YAML file (`--config FILE`) takes the same keys with underscores or dashes (`served_model_name: [a, b]`), turned
into flags placed before the real command line: flags given there win, every value goes through the same checks.

Every usage error is one line, `deepinfer CMD: error: ...`, exit status 2 (`ArgParser`), found while parsing: the
flags' values by their `type=` checks, --model and what needs its config.json by `check_engine_args` right after.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "default-model")
DEFAULT_MODEL_NAME = "deepinfer-default"
# What the embedded model is (tools/train_default_model.py trains it), for --help and the first log line.
DEFAULT_MODEL_NOTE = ("the embedded default model, a small DeepSeek-V3-architecture model that ships in the package "
                      "(deepinfer_jax/assets/default-model; its README.md model card says how it was trained and what "
                      "it does well). It is there to try the server and the API without a download; pass --model DIR "
                      "for a real model")
# What to ask it first (its training skills: tools/default_model_data.py), shown by `deepinfer chat`.
DEFAULT_MODEL_TRY = ("the default model does small talk, sums and JSON; try: Hello! | What is 37 + 48? | "
                     "Give me a JSON object with the keys name and age.")


class ArgParser(argparse.ArgumentParser):
    """argparse with every usage error on one line: `PROG: error: MESSAGE` on stderr, exit status 2 (no usage
    block; --help prints it)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        from deepinfer_jax.server.vllm_flags import refusal

        args = dashed(list(sys.argv[1:] if args is None else args))
        msg = refusal(self, args)  # vLLM flags refused by name
        if msg:
            self.error(msg)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("unrecognized arguments: "):
            message += unknown_flag_hint(self, message.split()[2:])
        self.exit(2, f"{self.prog}: error: {message}\n")


def dashed(argv: list[str]) -> list[str]:
    """`--max_model_len` is `--max-model-len`, as vLLM reads it (flag names only, up to a `--`)."""
    out = list(argv)
    for i, tok in enumerate(out):
        if tok == "--":
            break
        if tok.startswith("--") and "_" in tok.split("=", 1)[0]:
            name, eq, value = tok.partition("=")
            out[i] = "--" + name[2:].replace("_", "-") + eq + value
    return out


def unknown_flag_hint(parser: argparse.ArgumentParser, tokens: list[str]) -> str:
    """The first unknown flag's hint: vLLM's dotted JSON form refused by name, or our nearest flag ("" if none)."""
    import difflib

    flags = [s for s in parser._option_string_actions if s.startswith("--")]
    for tok in tokens:
        if not tok.startswith("--"):
            continue
        name = tok.split("=", 1)[0]
        base = name.split(".", 1)[0]
        if "." in name and base in flags:
            return f" ({base}.KEY VALUE, vLLM's dotted form, is not supported: pass {base} as one JSON value)"
        near = difflib.get_close_matches(name, flags, n=1, cutoff=0.85)
        return f" (did you mean {near[0]}?)" if near else ""
    return ""


from deepinfer_jax.server.arg_types import (VALUE_ALIASES, at_least_two, fraction,  # noqa: F401 (re-exported)
                                            nonnegative_float, nonnegative_int, number, port_number, positive_float,
                                            positive_int, power_of_two, speculative_config, token_count, value_alias)


def model_dir_problem(path: str) -> str | None:
    """Why `path` cannot be served (no directory, no or a bad config.json, an unsupported model), or None."""
    from deepinfer_jax.config import ConfigError, ModelConfig

    if not os.path.isdir(path):  # a Hub id (org/name) is what `vllm serve` would have downloaded
        hub = path.count("/") == 1 and not path.startswith((".", "/", "~"))
        return f"{path!r} is not a directory" if os.path.exists(path) else f"{path!r} does not exist" + (
            " (models are local directories: `huggingface-cli download REPO --local-dir DIR`, then --model DIR)" * hub)
    if not os.path.isfile(os.path.join(path, "config.json")):
        return f"{path!r} is not a model directory (no config.json)"
    try:
        ModelConfig.from_model_dir(path)
    except json.JSONDecodeError as e:
        return f"{os.path.join(path, 'config.json')} is not valid JSON ({e})"
    except (ConfigError, OSError, ValueError, TypeError, KeyError) as e:  # the last three: "hidden_size": "x"
        why = e if isinstance(e, (ConfigError, OSError)) else f"a field of the wrong type ({type(e).__name__}: {e})"
        return f"{os.path.join(path, 'config.json')}: {why}"
    return None


def add_engine_args(p: argparse.ArgumentParser, *, model_required: bool = False) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", required=model_required, default=None,
                   help="model directory (HF safetensors or converted, config.json, tokenizer). Default: "
                        + DEFAULT_MODEL_NOTE.replace("%", "%%"))
    g.add_argument("--dtype", type=value_alias("dtype"), default="auto",
                   choices=["auto", "bfloat16", "float16", "float32"],
                   help="compute dtype (auto: the checkpoint's, float32 ones in bfloat16); vLLM's half and float "
                        "are float16 and float32")
    g.add_argument("--quantization", "-q", default=None, choices=["auto", "none", "fp8", "int8", "int4"],
                   help="weights' format (default auto: the checkpoint's own, FP8 kept as FP8); none: an FP8 "
                        "checkpoint dequantized to --dtype at load; fp8: a bf16/fp32 checkpoint quantized online "
                        "to 128x128-block FP8; int8/int4: a checkpoint converted with that --quantize")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="latent KV cache element type: auto (the compute dtype) or fp8 (e4m3, scale 1.0: half the "
                        "bytes per token of bf16; attention then runs on the XLA path)")
    g.add_argument("--load-format", type=value_alias("load_format"), default="auto", choices=["auto", "dummy"],
                   help="auto (or vLLM's safetensors): the checkpoint; dummy: random weights from the model "
                        "directory's config.json (benchmarks)")
    g.add_argument("--max-model-len", type=token_count, default=None,
                   help="context length (prompt + output; 32k = 32000, 32K = 32768); default min(max_position_"
                        "embeddings, 4096), 2048 for small models (up to 20M parameters, as the embedded demo model)")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="sequences per engine step (default 256; 32 for small models)")
    g.add_argument("--max-num-batched-tokens", type=token_count, default=None,
                   help="tokens per engine step (default max(2048, max_num_seqs); 256 for small models)")
    g.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                   help="fraction of device memory for weights + KV cache, in (0, 1]")
    g.add_argument("--gpu-memory", type=positive_float, default=None, metavar="GIB",
                   help="memory of each device in GiB, for one without memory figures or to leave room: the KV cache "
                        "is sized from it, and a model that cannot fit is refused before loading (deepinfer plan)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--kv-offloading-size", type=nonnegative_float, default=0.0, metavar="GIB",
                   help="GiB of host memory for the KV cache's host tier: prefix-cache pages leaving device memory "
                        "are kept there and copied back on a hit (needs prefix caching; 0: off; docs/kv-tier.md)")
    g.add_argument("--cpu-offload-gb", type=nonnegative_float, default=0.0, metavar="GIB",
                   help="GiB of weights kept in host memory and copied to the device by each step (routed experts "
                        "first, deepest layers first; one device; 0: off; docs/offload.md)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1)
    g.add_argument("--enable-expert-parallel", "-ep", action="store_true", help="experts sharded over TP x DP")
    g.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                   help="decoder layers split into this many stages, each on its own TP x DP devices")
    g.add_argument("--all2all-backend", default="allgather_reducescatter",
                   choices=["allgather_reducescatter", "all_to_all"],  # sharding/mesh.py ALL2ALL_BACKENDS
                   help="how expert parallelism moves tokens: every device sees every token (allgather_reducescatter) "
                        "or each token goes only to its experts' devices (all_to_all; docs/multi-gpu.md)")
    g.add_argument("--enable-eplb", action="store_true",
                   help="expert load balancing: redundant copies of the hot experts, placed at start (needs -ep)")
    g.add_argument("--eplb-config", default=None, metavar="JSON",
                   help='{"num_redundant_experts": R, "expert_load": "counts.json"} (docs/multi-gpu.md)')
    g.add_argument("--page-size", "--block-size", dest="page_size", type=power_of_two, default=64,
                   help="tokens per KV cache page (vLLM's --block-size)")
    g.add_argument("--num-pages", "--num-gpu-blocks-override", dest="num_pages", type=at_least_two, default=None,
                   help="fix the KV cache size in pages (vLLM's --num-gpu-blocks-override)")
    g.add_argument("--seed", type=lambda t: number(int, t, "an integer in 0..2**63-1", lambda v: 0 <= v < 2**63),
                   default=0)
    g.add_argument("--chat-template", default=None, help="a Jinja file, a built-in name or template text")
    g.add_argument("--attn-impl", default=None, choices=["auto", "pallas", "pallas_interpret", "reference"],
                   help="attention implementation (default auto: the Pallas kernels on a GPU, XLA elsewhere)")
    g.add_argument("--moe-impl", default=None, choices=["auto", "pallas", "pallas_interpret", "ragged", "dense"],
                   help="MoE implementation (default auto: the Pallas kernels on a GPU, XLA's ragged dot elsewhere)")
    g.add_argument("--unroll-max-tokens", type=nonnegative_int, default=None,
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
                        "draw (default: on, but off for small models on a CPU; off compiles fewer programs)")
    g.add_argument("--prefill-shared-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill buckets run a step as two programs, the bucket's forward (shared by its sampling "
                        "variants) and the variant's sampler, so warm-up compiles fewer whole forwards (one "
                        "device; default: on)")
    g.add_argument("--speculative-config", "-sc", type=speculative_config, default=None,
                   help='speculative decoding as JSON, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4} (docs/speculative.md)')
    g.add_argument("--compilation-cache-dir", default="default",
                   help='XLA compilation cache, and in its programs/ the compiled step programs a warm start '
                        'loads untraced ("default": $DEEPINFER_CACHE_DIR or ~/.cache/deepinfer-jax/xla; "none": off)')


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML file with the same keys as these flags (repeatable: a "
                   "later file wins, the command line over all)")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=port_number, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model'; the first is reported (default: the --model value)")
    g.add_argument("--api-key", nargs="+", metavar="KEY",
                   default=[k] if (k := os.environ.get("DEEPINFER_API_KEY") or os.environ.get("VLLM_API_KEY")) else None,
                   help="require 'Authorization: Bearer KEY' on /v1/* and /admin/*, any one of the keys given (as "
                        "vLLM's; default: $DEEPINFER_API_KEY, else $VLLM_API_KEY as vLLM reads it)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults of requests that do not set them: auto (the model's generation_config.json), "
                        "vllm (none) or a folder holding a generation_config.json (its max_new_tokens also caps "
                        "max_tokens), as in vLLM")
    g.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "deepseek_v3", "deepseek_v4", "qwen3"],
                   help="split <think>...</think> into reasoning_content (deepseek_v3: vLLM's name for V3.1 / V3.2; "
                        "qwen3: Qwen3's; the same rules; deepseek_v4: a DSML tool-call block ends reasoning too)")
    g.add_argument("--tool-call-parser", default=None,
                   choices=["deepseek_v3", "deepseek_v31", "deepseek_v4", "hermes", "llama3_json"])
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model choose to call tools (tool_choice 'auto', the default when a request has "
                        "tools), as in vLLM; needs --tool-call-parser. Without it a request's tools are only shown "
                        "to the model and an explicit tool_choice 'auto' is a 400")
    g.add_argument("--plugin", action="extend", nargs="+", default=None, metavar="MODULE:ATTR",
                   help="load a server plugin (repeatable); the installed entry points of the group "
                        "deepinfer.plugins load too (docs/plugins.md)")
    g.add_argument("--max-queue-len", type=nonnegative_int, default=None,
                   help="sequences allowed to wait beyond --max-num-seqs; more get 429 (default: unbounded)")
    g.add_argument("--max-request-sequences", type=positive_int, default=1024,
                   help="most sequences one request may ask for, prompts x n (more: 400); n itself is at most 128")
    g.add_argument("--max-completion-prompts", type=positive_int, default=1024,
                   help="most prompts in one /v1/completions request (more: 400), vLLM's "
                        "VLLM_MAX_COMPLETION_PROMPTS and default")
    g.add_argument("--max-payload-size", type=positive_int, default=16 * 2**20,
                   help="largest request body in bytes (413, answered from the Content-Length header at once)")
    g.add_argument("--read-timeout", type=positive_float, default=60.0,
                   help="seconds a client may take to send a request's headers, and again its body (408); "
                        "also how long an idle keep-alive connection stays open")
    g.add_argument("--shutdown-timeout", type=nonnegative_float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish; the rest end with an error (a stream: "
                        "a final error event and [DONE])")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic statistics line in the log (every 10 s while requests run: sequences, KV cache, "
                        "engine steps); /metrics and /dashboard keep theirs")
    g.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server's own loggers (aiohttp's; vLLM's flag, for uvicorn; trace is "
                        "debug; default: --log-level)")
    h = p.add_argument_group("several hosts (one process a host; the API server on --node-rank 0 only)")
    h.add_argument("--nnodes", "-n", type=positive_int, default=1, help="hosts (processes) the mesh spans")
    h.add_argument("--node-rank", "-r", type=nonnegative_int, default=0, help="this host's rank; 0 serves the API")
    h.add_argument("--master-addr", default=None, help="rank 0's address (jax.distributed's coordinator)")
    h.add_argument("--master-port", type=port_number, default=None,
                   help="the coordinator's port on rank 0; rank 0 sends the steps on the next port up")


def yaml_to_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """Turn a YAML mapping of flag names to values into argv (see the module docstring). A file that cannot be
    read or parsed, or holds an unknown key, is a usage error of `parser` (one line, exit status 2)."""
    import yaml

    def bad(what: str):
        parser.error(f"argument --config: {path}: {what}")

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = yaml.safe_load(text) or {}
        raw = yaml.load(text, Loader=yaml.BaseLoader) or {}  # values as written: api_key: 0123 is not 83
    except OSError as e:
        bad(e.strerror or str(e))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        bad(f"not valid YAML: {getattr(e, 'problem', None) or e}{where}")
    if not isinstance(data, dict):
        bad("the config must be a mapping of flag names to values")
    options = {a.dest: a for a in parser._actions if a.option_strings}
    options.update({s[2:].replace("-", "_"): a for a in parser._actions for s in a.option_strings  # block_size
                    if s.startswith("--") and s[2:].replace("-", "_") not in options})
    argv: list[str] = []
    refusals = getattr(parser, "refused_flags", {})
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = options.get(dest)
        refused = refusals.get("--" + dest.replace("_", "-"))
        if refused:
            bad(f"{key}: {refused}")
        if action is None or dest in ("config", "help"):
            bad(f"unknown key {key!r}")
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if value is None:
            continue
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
            if not isinstance(value, bool):
                bad(f"{key} must be true or false, got {value!r}")
            if refusals.get("--no-" + flag[2:]) and not value:  # `enable_chunked_prefill: false`, as its --no- form
                bad(f"{key}: false: {refusals['--no-' + flag[2:]]}")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
        elif isinstance(value, dict) and dest in ("speculative_config", "eplb_config"):  # as the flag's JSON
            argv += [flag, json.dumps(value)]
        elif isinstance(value, dict):
            bad(f"{key} must be a value or a list, got a mapping")
        else:  # the text as written, through the flag's own checks
            argv += [flag] + ([str(v) for v in raw[key]] if isinstance(value, list) else [raw[key]])
    return argv


def parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv, first expanding `--config FILE` into flags that argv then overrides."""
    pre = ArgParser(prog=parser.prog, add_help=False)
    pre.add_argument("--config", action="append", default=[])  # several: read in turn, the later wins
    pre.add_argument("--model", default=None)
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return parser.parse_args(argv)
    ns = parser.parse_args([a for f in known.config for a in yaml_to_argv(f, parser)] + list(argv))
    if getattr(ns, "model_tag", None) is not None and known.model is None:
        ns.model = None  # `serve MODEL --config F`: the command line's model wins over the file's, as in vLLM
    return ns


def check_engine_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.Namespace:
    """The checks that need more than one flag or the model's config.json, right after parsing: --model is a
    directory this engine can serve, --max-model-len fits the model. A failure is a usage error (one line)."""
    tag = getattr(ns, "model_tag", None)
    if tag is not None:  # `deepinfer serve MODEL`, as `vllm serve MODEL`
        if ns.model is not None and ns.model != tag:
            parser.error(f"the model is given twice: {tag!r} and --model {ns.model!r}")
        ns.model = tag
    if getattr(ns, "nnodes", 1) > 1 or getattr(ns, "node_rank", 0):
        from deepinfer_jax.engine.llm import check_launch

        try:
            check_launch(ns.nnodes, ns.node_rank, ns.master_addr, ns.master_port)
        except ValueError as e:
            parser.error(str(e))
    model_dir, _ = resolve_model(ns)
    problem = model_dir_problem(model_dir)
    if problem:
        parser.error(f"argument --model: {problem}")
    for flag in ("served_model_name", "api_key"):  # nargs="+" took the model for a name or a key
        for name in (getattr(ns, flag, None) or []) if ns.model is None else []:
            if os.path.isfile(os.path.join(name, "config.json")):
                dashes = "--" + flag.replace("_", "-")
                parser.error(f"argument {dashes}: {name!r} is a model directory: give it first (`deepinfer "
                             f"serve {name} {dashes} ...`) or as --model")
    if (ns.max_num_batched_tokens or ns.max_num_seqs or 0) < (ns.max_num_seqs or 0):  # as vLLM, which refuses it
        parser.error(f"argument --max-num-batched-tokens: {ns.max_num_batched_tokens} is less than --max-num-seqs "
                     f"{ns.max_num_seqs}: a step could not hold a token of every running sequence")
    if getattr(ns, "generation_config", None) is not None:
        from deepinfer_jax.text.generation_config import load_sampling_defaults

        try:
            load_sampling_defaults(model_dir, ns.generation_config)
        except ValueError as e:
            parser.error(f"argument --generation-config: {e}")
    if getattr(ns, "enable_auto_tool_choice", False) and not ns.tool_call_parser:
        parser.error("argument --enable-auto-tool-choice: requires --tool-call-parser")
    if ns.quantization not in (None, "auto"):
        from deepinfer_jax.engine.llm import quantization_problem

        problem = quantization_problem(model_dir, ns.quantization)
        if problem:
            parser.error(f"argument --quantization: {problem}")
        if ns.load_format == "dummy":
            parser.error("argument --quantization: not supported with --load-format dummy (random weights are "
                         "drawn in the engine dtype)")
    if ns.kv_cache_dtype != "auto" and ns.attn_impl in ("pallas", "pallas_interpret"):
        parser.error(f"argument --kv-cache-dtype: {ns.kv_cache_dtype} runs with --attn-impl auto (the Pallas MLA "
                     "kernels where the model's kernels read an FP8 cache, else the reference) or reference")
    if ns.gpu_memory is not None and ns.load_format == "auto":  # refused before anything loads (engine/plan.py)
        from deepinfer_jax.engine.plan import fit_problem, resolve_dtype

        kw, _ = engine_kwargs(ns, progress=False)
        pc = (ns.tensor_parallel_size, ns.data_parallel_size, ns.enable_expert_parallel, ns.pipeline_parallel_size)
        try:
            problem = fit_problem(model_dir, pc, resolve_dtype(ns.dtype, model_dir), ns.quantization,
                                  ns.kv_cache_dtype, ns.gpu_memory, ns.gpu_memory_utilization, kw.get("max_model_len"),
                                  cpu_offload_gb=ns.cpu_offload_gb, speculative_config=ns.speculative_config)
        except ValueError as e:
            problem = str(e)
        if problem:
            parser.error(problem)
    if ns.max_model_len is not None:
        from deepinfer_jax.config import ModelConfig

        limit = ModelConfig.from_model_dir(model_dir).max_position_embeddings
        if ns.max_model_len > limit:
            parser.error(f"argument --max-model-len: {ns.max_model_len} exceeds the model's max_position_embeddings "
                         f"{limit}")
    return ns


def resolve_model(ns: argparse.Namespace) -> tuple[str, str]:
    """(model directory, default served name): --model, or the embedded default model."""
    model = ns.model or getattr(ns, "model_tag", None)
    if model:
        return model, model
    return DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME


def show_progress(log_level: int = logging.WARNING) -> bool:
    """Progress bars (to stderr) only on a terminal, where no INFO log lines come between (breaking their lines)."""
    return sys.stderr.isatty() and log_level > logging.INFO


def engine_kwargs(ns: argparse.Namespace, *, progress: bool = True,
                  platform: str | None = None) -> tuple[dict[str, Any], str]:
    """Keyword arguments for `LLM(model, **kw)` from the engine flags, with engine/serving_defaults.py for those
    not set (by the model's size and the platform: `platform`, or JAX's default backend), and that
    function's line saying which and why ("" when none)."""
    from deepinfer_jax.config import ModelConfig
    from deepinfer_jax.engine.serving_defaults import large_gpu_total, serving_defaults

    if platform is None:
        import jax

        from deepinfer_jax.xla_env import use_host_memory

        use_host_memory(ns.cpu_offload_gb, ns.kv_offloading_size)  # before the backend starts (xla_env.py)
        platform = jax.default_backend()
    model_dir, _ = resolve_model(ns)
    given = {k: getattr(ns, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "greedy_variant")}
    device_total = large_gpu_total() if platform == "gpu" else None
    auto, note = serving_defaults(ModelConfig.from_model_dir(model_dir), platform, given, device_total)
    kw: dict[str, Any] = dict(
        dtype=ns.dtype, quantization=ns.quantization, kv_cache_dtype=ns.kv_cache_dtype, page_size=ns.page_size,
        gpu_memory=ns.gpu_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization, enable_prefix_caching=ns.enable_prefix_caching,
        kv_offloading_size=ns.kv_offloading_size, cpu_offload_gb=ns.cpu_offload_gb,
        seed=ns.seed, tensor_parallel_size=ns.tensor_parallel_size, data_parallel_size=ns.data_parallel_size,
        enable_expert_parallel=ns.enable_expert_parallel, pipeline_parallel_size=ns.pipeline_parallel_size,
        all2all_backend=ns.all2all_backend, num_pages=ns.num_pages, enable_eplb=ns.enable_eplb, eplb_config=ns.eplb_config,
        chat_template=ns.chat_template, progress=progress, load_format=ns.load_format,
        compilation_cache_dir=None if ns.compilation_cache_dir == "none" else ns.compilation_cache_dir,
        speculative_config=ns.speculative_config,
        generation_config=getattr(ns, "generation_config", "vllm"))  # chat / generate: their own sampling flags
    if getattr(ns, "nnodes", 1) > 1:
        kw.update(nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr, master_port=ns.master_port)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "attn_impl", "moe_impl",
                 "unroll_max_tokens", "prefill_layers", "prefill_context_variant", "greedy_variant",
                 "prefill_shared_forward"):
        if getattr(ns, name) is not None:
            kw[name] = getattr(ns, name)
    for name, value in auto.items():
        kw.setdefault(name, value)
    return kw, note
