#!/usr/bin/env bash
# The wheels vLLM 0.26.0's OpenAI server imports beyond ../shared/peers/vllm_bundle.sh's bundle (which covers
# its offline LLM) and the GPU machine's image: its ASGI server, event loop, metrics and the SageMaker router
# its app module imports at the top, and compressed-tensors + loguru, which its quantization registry imports for
# any quantized checkpoint (Protocol F's FP8). About 6.5 MB, pure Python but uvloop; carried with the bundle's last part.
#
#   bash benchmarks/vllm_serve_deps.sh .peers/serve_deps
#   then, in the call that carries the bundle's last part, with [.peers/partN, .peers/serve_deps] carried:
#   cp .peers/partN/* /tmp/vllm/ && mkdir -p /tmp/vllm/serve_deps && cp .peers/serve_deps/* /tmp/vllm/serve_deps/ &&
#   PARTS="vllm_serve protocol_b" bash benchmarks/gpu.sh OUT
set -euo pipefail
out=${1:?usage: vllm_serve_deps.sh OUTDIR}
mkdir -p "$out"
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$out" uvloop==0.23.0 uvicorn==0.55.0 h11==0.16.0 click==8.5.1 prometheus-client==0.26.0 \
  prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 python-multipart==0.0.34 \
  jmespath==1.1.0 supervisor==4.3.0 httpx==0.29.0 httpcore==1.0.9 anyio==4.16.0 certifi==2026.10.19.post1 \
  idna==3.20 watchfiles==1.1.1 compressed-tensors==0.20.1 loguru==0.7.3
ls -la "$out"
