"""benchmarks/v32_offline.py --smoke runs end to end on the CPU (the tests' tiny DeepSeek-V3.2 as an FP8 release,
drawn by the dummy load): the sparse phase (Protocol A, then long context in an engine of its own) and the dense MLA
phase, each in a process of its own, then the table of the two. The XLA impls keep it cheap; the kernels' interpret
mode and the correctness phase run in the full `--smoke` (minutes on a CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_runs_both_phases_and_compares_them(xla_cache_dir):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "v32_offline.py"), "--smoke",
                          "--skip-check", "--attn-impl", "reference", "--moe-impl", "ragged"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    # 3 layers, each a latent of kv_lora_rank 32 + rope 8 and an indexer key of 20, in bf16
    assert "KV cache bytes per token of context (3 layers, bf16): 360 (latent 240, indexer keys 120)" in text
    assert "FP8 blocks [8, 12], index_topk 11; 3 of 3 layers (1 dense, 2 MoE)" in text
    assert re.search(r"Protocol A: batch 2 x 16 in, 8 out, greedy: .* output tok/s", text)
    assert "long context, dense MLA (the same 3 layers as deepseek_v3, no indexer)" in text
    # Protocol A's engine, then the sparse and the dense long-context engines: every program compiled at start-up
    assert text.count("compiles after warm-up: 0") == 3
    table = text[text.index("decode at long context, 2 sequences, 3 layers"):]
    row = r"^\s+(\d+) \|\s+([\d.]+)\s+[\d,.]+ \|\s+([\d.]+)\s+[\d,.]+ \|\s+[\d.]+x \| 360 / 240$"
    rows = re.findall(row, table, re.M)
    assert [r[0] for r in rows] == ["24", "40"] and all(float(x) > 0 for r in rows for x in r[1:])
