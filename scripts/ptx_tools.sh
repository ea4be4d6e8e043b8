#!/usr/bin/env bash
# Create .ptx-venv: the `triton` package (its compiler and ptxas), which benchmarks/kernel_resources.py's report
# mode uses to compile our kernels' Triton IR for sm_90a on a machine without a GPU. Kept apart from .venv: jax's
# Pallas lowering does not use the `triton` package, and nothing in .venv should change because of this tool.
#   bash scripts/ptx_tools.sh
#   .venv/bin/python benchmarks/kernel_resources.py dump /tmp/kr && .ptx-venv/bin/python benchmarks/kernel_resources.py report /tmp/kr
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || { echo "ptx_tools: run bash scripts/setup.sh first" >&2; exit 1; }
py="$(.venv/bin/python -c 'import sys; print(sys._base_executable)')"
[[ -x .ptx-venv/bin/python ]] || "$py" -m venv .ptx-venv
.ptx-venv/bin/python -m pip install -q triton==3.9.0
echo "ptx_tools: ready ($(.ptx-venv/bin/python -c 'import triton; print("triton", triton.__version__)'))"
