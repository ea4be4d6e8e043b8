"""benchmarks/sampler_sweep.py and lm_head_sweep.py on the CPU (kernels in interpret mode, tiny shapes): each kernel
row's tokens equal XLA's, so a GPU call spends its time on timing, not on a broken script."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks import lm_head_sweep, sampler_sweep  # noqa: E402

TINY = ["--interpret", "--batch", "4", "--hidden", "64", "--vocab", "2048", "--repeat", "1", "--iters", "1"]


def _table(out: str) -> dict[str, list[str]]:
    rows = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    return {r[0]: r[1:] for r in rows[1:]}


def test_sampler_sweep_kernel_tokens_equal_the_hash_draw(capsys):
    assert sampler_sweep.main(TINY + ["--configs", "512x8,256x4"]) == 0
    rows = _table(capsys.readouterr().out)
    assert list(rows) == ["gemm", "greedy", "hash", "threefry", "kernel 512x8", "kernel 256x4", "kgreedy 512x8",
                          "kgreedy 256x4"]  # no TOKENS DIFFER
    assert all(float(r[0]) > 0 for r in rows.values())


def test_lm_head_sweep_kernel_tokens_equal_xla(capsys):
    assert lm_head_sweep.main(TINY + ["--configs", "128x64x4x4"]) == 0
    rows = _table(capsys.readouterr().out)
    assert rows["kernel 128x64x4x4"][1] == "yes"
