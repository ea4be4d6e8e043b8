"""benchmarks/kernel_resources.py's dump mode: every decode-step kernel lowered for sm_90 at V2-Lite's batch-32
shapes, with the launch parameters the kernel wrappers choose (its report mode needs the `triton` package,
scripts/ptx_tools.sh, and is not run here)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks import kernel_resources  # noqa: E402


def test_dump_writes_each_kernel_with_its_launch_parameters(tmp_path):
    kernel_resources.main(["dump", str(tmp_path)])
    kernels = {k["name"]: k for k in json.load(open(tmp_path / "kernels.json"))}
    assert len(kernels) == 8
    absorb = kernels["absorb + latents (merged q / kv_a read in place)"]
    assert absorb["grid"] == [160] and absorb["num_stages"] == 1
    assert kernels["routing + MoE single launch [1/2]"]["num_warps"] == 8  # the routing kernel
    for k in kernels.values():
        text = (tmp_path / k["ttir"]).read_text()
        assert text.startswith("module @") and "tt.func public" in text
