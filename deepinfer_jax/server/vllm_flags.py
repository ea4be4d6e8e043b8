"""Every flag of `vllm serve` (vLLM 0.26.0) and what `deepinfer serve` does with it: the same flag, a no-op
accepted because it really changes nothing here, or a refusal that names the flag and says what to do.
Nothing is accepted and ignored. tests/unit/server/test_vllm_flags.py checks this table against vLLM's flag
list (tests/data/vllm-0.26.0-serve-flags.txt, made by tools/vllm_serve_flags.py) and against the parser;
docs/from-vllm.md is written from it.

`install(parser)` adds the no-op flags (their --help says why they change nothing) and the refusals, which
`ArgParser` checks before parsing, so a refused flag is one line: `argument --flag: not supported: WHY`.
"""

from __future__ import annotations

import argparse

VLLM_VERSION = "0.26.0"

# vLLM flags this server implements under the same name (same meaning; docs/from-vllm.md notes differences).
SAME = set("""
--model --dtype --load-format --max-model-len --max-num-seqs --max-num-batched-tokens --gpu-memory-utilization
--enable-prefix-caching --tensor-parallel-size --data-parallel-size --enable-expert-parallel --block-size
--num-gpu-blocks-override --seed --chat-template --host --port --served-model-name --api-key --reasoning-parser
--tool-call-parser --enable-auto-tool-choice --shutdown-timeout --config --quantization --kv-cache-dtype --kv-offloading-size
--cpu-offload-gb
--nnodes --node-rank --master-addr --master-port --speculative-config --pipeline-parallel-size --all2all-backend
--enable-eplb --eplb-config --generation-config --uvicorn-log-level --disable-log-stats
""".split())

# Accepted, and change nothing here: {flag: why}. Boolean flags take no value; their --no- forms are refused
# (they would ask for something this server does not do), but for --no-trust-remote-code.
NOOP: dict[str, str] = {
    "--trust-remote-code": "no remote code runs here: the model code is built in",
    "--enable-chunked-prefill": "prefill is always chunked (by --max-num-batched-tokens)",
    "--max-log-len": "requests are not logged",
    "--disable-uvicorn-access-log": "there is no access log",
    "--disable-fastapi-docs": "there are no OpenAPI docs routes",
    "--enable-request-id-headers": "every response carries X-Request-Id already",
    "--enable-prompt-tokens-details": "usage.prompt_tokens_details (cached_tokens) is always sent",
    "--disable-custom-all-reduce": "collectives are XLA's; there is no custom all-reduce",
    "--disable-cascade-attn": "there is no cascade attention",
    "--disable-hybrid-kv-cache-manager": "there is one KV cache manager (the served models have one layer kind)",
    "--mamba-cache-dtype": "the served models have no Mamba layers",
    "--mamba-ssm-cache-dtype": "the served models have no Mamba layers",
    "--mamba-block-size": "the served models have no Mamba layers",
    "--mamba-cache-mode": "the served models have no Mamba layers",
    "--mamba-backend": "the served models have no Mamba layers",
    "--mamba-cache-philox-rounds": "the served models have no Mamba layers",
    "--enable-mamba-cache-stochastic-rounding": "the served models have no Mamba layers",
    "--gdn-prefill-backend": "the served models have no gated-delta-net layers",
}
NOOP_BOOLEAN = {"--trust-remote-code", "--enable-chunked-prefill", "--disable-uvicorn-access-log",
                "--disable-fastapi-docs", "--enable-request-id-headers", "--enable-prompt-tokens-details",
                "--disable-custom-all-reduce", "--disable-cascade-attn",
                "--disable-hybrid-kv-cache-manager", "--enable-mamba-cache-stochastic-rounding"}
# --no- forms: only --no-trust-remote-code is as harmless; the others ask for something this server does not do
NOOP_NO_FORM_OK = {"--trust-remote-code"}

# Flags of older vLLM releases that operators still pass, accepted: {flag: why it changes nothing here}.
# All boolean. Not in vLLM 0.26.0's list, so outside the table above (docs/from-vllm.md lists them after it).
OLD_NOOP: dict[str, str] = {
    "--disable-log-requests": "requests are not logged (vLLM's default since --enable-log-requests replaced this flag)",
}

# Being implemented now (refused until they land).
NOT_YET = {
    "--quantization-config": "not yet: --quantization fp8 takes DeepSeek's 128 x 128 blocks; a checkpoint's own "
                             "quantization_config is read from its config.json",
    "--kv-cache-dtype-skip-layers": "not yet: --kv-cache-dtype applies to every layer",
    "--spec-method": "not yet: pass --speculative-config '{\"method\": ..., \"num_speculative_tokens\": K}'",
    "--spec-model": "not yet: pass --speculative-config with its \"model\" key",
    "--spec-tokens": "not yet: pass --speculative-config with its \"num_speculative_tokens\" key",
}

_R = {  # refused, by reason: {what to do: flags}
    "models are local directories: download one first (e.g. `huggingface-cli download REPO --local-dir DIR`) and "
    "pass --model DIR": "--revision --code-revision --tokenizer-revision --download-dir --hf-token --hf-config-path "
                         "--ignore-patterns",
    "the tokenizer is read from the --model directory (tokenizer.json or tokenizer.model)":
        "--tokenizer --tokenizer-mode --skip-tokenizer-init --tokens-only",
    "every step is a compiled XLA program (there is no eager mode or CUDA graph setting); --unroll-max-tokens, "
    "--prefill-layers and --compilation-cache-dir tune compilation":
        "--enforce-eager --compilation-config --cudagraph-capture-sizes --max-cudagraph-capture-size "
        "--optimization-level --performance-mode --cudagraph-metrics",
    "kernels are chosen with --attn-impl and --moe-impl":
        "--attention-backend --attention-config --moe-backend --linear-backend --kernel-config --ir-op-priority "
        "--enable-flashinfer-autotune --enable-bf16x3-router-gemm --mm-encoder-attn-backend "
        "--override-attention-dtype --enable-flash-late-interaction --use-fp64-gumbel",
    "a sliding window (Mistral) is applied as the model's config.json sets it": "--disable-sliding-window",
    "LoRA adapters are not supported": "--enable-lora --lora-modules --max-loras --max-lora-rank --max-cpu-loras "
        "--lora-dtype --lora-target-modules --fully-sharded-loras --default-mm-loras --enable-mixed-moe-lora-format "
        "--enable-moe-shared-loras --enable-tower-connector-lora --specialize-active-lora",
    "text models only: no multimodal inputs": "--limit-mm-per-prompt --mm-processor-kwargs "
        "--mm-processor-cache-gb --mm-processor-cache-type --mm-shm-cache-max-object-size-mb --mm-encoder-tp-mode "
        "--mm-encoder-attn-dtype --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-path "
        "--mm-encoder-fp8-scale-save-margin --mm-encoder-only --mm-ipc-gpu-memory-gb --mm-tensor-ipc "
        "--media-io-kwargs --allowed-local-media-path --allowed-media-domains --interleave-mm-strings "
        "--skip-mm-profiling --enable-mm-embeds --language-model-only --video-pruning-rate --disable-chunked-mm-input",
    "one process drives all local devices (JAX); there is no Ray, multi-process or external load-balancer mode":
        "--distributed-executor-backend --data-parallel-address --data-parallel-backend --data-parallel-external-lb "
        "--data-parallel-hybrid-lb --data-parallel-multi-port-external-lb --data-parallel-rank --data-parallel-rpc-port "
        "--data-parallel-size-local --data-parallel-start-rank --data-parallel-supervisor-port "
        "--dp-supervisor-probe-failure-threshold --dp-supervisor-probe-interval-s --dp-supervisor-probe-timeout-s "
        "--headless --api-server-count --grpc --worker-cls --worker-extension-cls --ray-workers-use-nsight "
        "--distributed-timeout-seconds --cpu-distributed-timeout-seconds --disable-nccl-for-dp-synchronization "
        "--max-parallel-loading-workers --device-ids --numa-bind --numa-bind-cpus --numa-bind-nodes",
    "context parallelism, dual-batch overlap, elastic EP and other expert placements are not implemented; see "
    "docs/multi-gpu.md":
        "--decode-context-parallel-size --prefill-context-parallel-size --dcp-kv-cache-interleave-size "
        "--cp-kv-cache-interleave-size --dcp-comm-backend --enable-dbo --dbo-decode-token-threshold "
        "--dbo-prefill-token-threshold --ubatch-size --enable-elastic-ep "
        "--expert-placement-strategy --enable-ep-weight-filter",
    "the KV cache is sized by --gpu-memory-utilization or --num-pages, with a host tier from "
    "--kv-offloading-size (its own, native backend); weights go to host memory by --cpu-offload-gb alone (routed "
    "experts first, docs/offload.md), and there is no KV transfer or sharing":
        "--kv-cache-memory-bytes --cpu-offload-params --offload-backend "
        "--offload-group-size --offload-num-in-group --offload-params --offload-prefetch-step --kv-offloading-backend "
        "--kv-transfer-config --kv-events-config --ec-transfer-config --kv-sharing-fast-prefill "
        "--calculate-kv-scales --enable-sleep-mode --enable-cumem-allocator --weight-transfer-config",
    "the scheduler is first-come first-served continuous batching with chunked prefill; --max-num-seqs and "
    "--max-num-batched-tokens tune it": "--scheduling-policy --scheduler-cls --long-prefill-token-threshold "
        "--max-num-partial-prefills --max-long-partial-prefills --max-num-scheduled-tokens --prefill-schedule-interval "
        "--scheduler-reserve-full-isl --async-scheduling --stream-interval --prefix-caching-hash-algo "
        "--prefix-match-unit",
    "models load from safetensors or `deepinfer convert` directories by the built-in DeepSeek code":
        "--runner --convert --model-impl --model-class-overrides --hf-overrides --config-format "
        "--model-loader-extra-config --pt-load-map-location --safetensors-load-strategy "
        "--safetensors-prefetch-block-size --safetensors-prefetch-num-threads --use-tqdm-on-load --pooler-config "
        "--diffusion-config --additional-config --allow-deprecated-quantization",
    "--generation-config (auto, vllm or a folder) sets the sampling defaults; there is no override of single keys, "
    "no logits processor plug-in, no logprobs mode and no watermark":
        "--override-generation-config --logits-processors --logprobs-mode --watermark",
    "no TLS, CORS, Unix sockets or path prefix: put a reverse proxy in front":
        "--ssl-keyfile --ssl-certfile --ssl-ca-certs --ssl-cert-reqs --ssl-ciphers --enable-ssl-refresh "
        "--allowed-origins --allowed-methods --allowed-headers --allow-credentials --uds --root-path "
        "--h11-max-incomplete-event-size --h11-max-header-count",
    "request / response middleware is a --plugin here (docs/plugins.md)": "--middleware --io-processor-plugin",
    "at most 20 logprobs per token (top_logprobs / logprobs), fixed; a request asking for more is a 400":
        "--max-logprobs",
    "the reasoning and tool-call parsers are built in (--reasoning-parser deepseek_r1, --tool-call-parser "
    "deepseek_v3 / deepseek_v31)": "--tool-parser-plugin --reasoning-parser-plugin --reasoning-config --tool-server "
        "--exclude-tools-when-tool-choice-none",
    "the server's log level is --log-level (--uvicorn-log-level: the HTTP server's); requests are not logged":
        "--log-config-file --log-error-stack --enable-log-requests --enable-log-outputs "
        "--enable-log-deltas --disable-access-log-for-endpoints --aggregate-engine-logging "
        "--enable-logging-iteration-details",
    "metrics are /metrics and /dashboard; there is no tracing or profiler hook":
        "--otlp-traces-endpoint --collect-detailed-traces --profiler-config --show-hidden-metrics-for-version "
        "--kv-cache-metrics --kv-cache-metrics-sample --enable-mfu-metrics --enable-per-request-metrics "
        "--enable-layerwise-nvtx-tracing --jit-monitor-mode --jit-monitor-verbose --enable-server-load-tracking",
    "not implemented by this server's OpenAI front end": "--chat-template-content-format --default-chat-template-kwargs "
        "--trust-request-chat-template --response-role --return-tokens-as-token-ids --enable-force-include-usage "
        "--enable-prompt-embeds --enable-return-routed-experts --enable-tokenizer-info-endpoint --enable-offline-docs "
        "--renderer-num-workers --structured-outputs-config --fingerprint-mode --fingerprint-value "
        "--fail-on-environ-validation",
}
REFUSED: dict[str, str] = {flag: why for why, flags in _R.items() for flag in flags.split()}


def install(parser: argparse.ArgumentParser) -> None:
    """Add the no-op flags to `parser` and record the refusals (module docstring)."""
    g = parser.add_argument_group(f"accepted from vllm serve {VLLM_VERSION}, no effect here")
    for flag, why in NOOP.items():
        if flag in NOOP_BOOLEAN:
            action = argparse.BooleanOptionalAction if flag in NOOP_NO_FORM_OK else "store_true"
            g.add_argument(flag, action=action, default=None, help=f"no-op: {why}")
        else:
            g.add_argument(flag, default=None, metavar="VALUE", help=f"no-op: {why}")
    for flag, why in OLD_NOOP.items():
        g.add_argument(flag, action="store_true", default=None, help=f"no-op (older vLLM's flag): {why}")
    refused = {f: f"not supported: {why}" for f, why in REFUSED.items()}
    refused.update({f: f"{why}" for f, why in NOT_YET.items()})
    refused.update({"--no-" + f[2:]: f"not supported (the flag itself is a no-op: {NOOP[f]})"
                    for f in NOOP_BOOLEAN - NOOP_NO_FORM_OK})
    for names in short_aliases().items():
        long, shorts = names
        for s in shorts:
            if long in refused:
                refused[s] = refused[long]
    parser.refused_flags = refused  # type: ignore[attr-defined]


# vLLM's short aliases of refused flags (`-q`, `-pp`, ...), refused alike
_SHORT = {"--pipeline-parallel-size": ["-pp"], "--speculative-config": ["-sc"],
          "--compilation-config": ["-cc"], "--attention-config": ["-ac"],
          "--api-server-count": ["-asc"], "--data-parallel-address": ["-dpa"], "--data-parallel-backend": ["-dpb"],
          "--data-parallel-external-lb": ["-dpe"], "--data-parallel-hybrid-lb": ["-dph"],
          "--data-parallel-multi-port-external-lb": ["-dpm"], "--data-parallel-rank": ["-dpn"],
          "--data-parallel-rpc-port": ["-dpp"], "--data-parallel-size-local": ["-dpl"],
          "--data-parallel-start-rank": ["-dpr"], "--decode-context-parallel-size": ["-dcp"],
          "--prefill-context-parallel-size": ["-pcp"], "--diffusion-config": ["-dc"]}


def short_aliases() -> dict[str, list[str]]:
    return dict(_SHORT)


def refusal(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """`argument FLAG: WHY` for the first refused flag in argv (up to a `--`), else None."""
    refused = getattr(parser, "refused_flags", None)
    if not refused:
        return None
    for tok in argv:
        if tok == "--":
            break
        name = tok.split("=", 1)[0]
        base = "--" + name[len("--no-"):] if name.startswith("--no-") else name
        for flag in (name, base):
            if flag in refused:
                return f"argument {name}: {refused[flag]}"
    return None


def markdown_table() -> str:
    """The flag table of docs/from-vllm.md (a test keeps the page equal to this)."""
    rows = ["| vLLM flag | deepinfer serve |", "|---|---|"]
    for flag in sorted(SAME):
        rows.append(f"| `{flag}` | the same |")
    for flag in sorted(NOOP):
        rows.append(f"| `{flag}` | accepted, no effect: {NOOP[flag]} |")
    for flag in sorted(NOT_YET):
        rows.append(f"| `{flag}` | refused: {NOT_YET[flag]} |")
    for why, flags in _R.items():
        names = ", ".join(f"`{f}`" for f in flags.split())
        rows.append(f"| {names} | refused: {why} |")
    return "\n".join(rows) + "\n"


def old_flags_markdown() -> str:
    """The older vLLM flags' table of docs/from-vllm.md (a test keeps the page equal to this)."""
    rows = ["| older vLLM flag | deepinfer serve |", "|---|---|"]
    rows += [f"| `{flag}` | accepted, no effect: {why} |" for flag, why in sorted(OLD_NOOP.items())]
    return "\n".join(rows) + "\n"
