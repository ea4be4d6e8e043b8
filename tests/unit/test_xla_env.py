"""The XLA defaults deepinfer puts into XLA_FLAGS before JAX starts."""

import os
import subprocess
import sys

import pytest

from deepinfer_jax.xla_env import (DEFAULT_FLAGS, SINGLE_GPU_FLAGS, apply_default_xla_flags, use_host_memory,
                                 with_default_flags)

MODE = "xla_gpu_command_buffer_update_mode"
REMAT = "--xla_disable_hlo_passes=rematerialization"
ALL = f"{REMAT} --{MODE}=SKIP_TEMP"


def test_defaults_are_added_once_and_never_override_the_user():
    flags = {**DEFAULT_FLAGS, **SINGLE_GPU_FLAGS}
    assert with_default_flags("", flags) == ALL
    assert with_default_flags("--xla_dump_to=/tmp/x", flags) == f"--xla_dump_to=/tmp/x {ALL}"
    assert with_default_flags(f"--{MODE}=ALWAYS_UPDATE", flags) == f"--{MODE}=ALWAYS_UPDATE {REMAT}"
    assert with_default_flags("--xla_disable_hlo_passes=foo", flags) == f"--xla_disable_hlo_passes=foo --{MODE}=SKIP_TEMP"
    assert with_default_flags(with_default_flags("", flags), flags) == ALL


def test_apply_respects_the_opt_out_and_keeps_the_graph_mode_to_one_gpu():
    env = {"DEEPINFER_XLA_DEFAULTS": "0", "XLA_FLAGS": "--a=1"}
    apply_default_xla_flags(env, num_gpus=1)
    assert env == {"DEEPINFER_XLA_DEFAULTS": "0", "XLA_FLAGS": "--a=1"}
    for n in (0, 1):
        env = {}
        apply_default_xla_flags(env, num_gpus=n)
        assert env["XLA_FLAGS"] == ALL
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.92"
    env = {"XLA_FLAGS": "--a=1"}
    apply_default_xla_flags(env, num_gpus=2)  # the command-buffer mode is not measured with collectives yet
    assert env["XLA_FLAGS"] == f"--a=1 {REMAT}"


def test_the_allocator_share_is_set_where_the_user_set_none():
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    apply_default_xla_flags(env, num_gpus=1)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"


def _flags_after_import(env_flags):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DEEPINFER_XLA_DEFAULTS")}
    if env_flags is not None:
        env["XLA_FLAGS"] = env_flags
    code = "import os, deepinfer_jax, jax; jax.numpy.ones(2).block_until_ready(); print(os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_the_package_sets_the_flags_before_jax_starts():
    # XLA parses the flags when the backend starts: an unknown or malformed flag would abort here.
    assert _flags_after_import(None) == ALL
    assert _flags_after_import(f"--{MODE}=ALWAYS_UPDATE") == f"--{MODE}=ALWAYS_UPDATE {REMAT}"


def test_host_memory_takes_the_vmm_mode_out_before_the_backend_starts():
    env = {"XLA_FLAGS": ALL}
    use_host_memory(0.0, 0.0, env, started=False)  # nothing in host memory: the graph mode stays
    assert env["XLA_FLAGS"] == ALL
    use_host_memory(2.0, 0.0, env, started=False)
    assert env["XLA_FLAGS"] == REMAT
    env = {"XLA_FLAGS": f"--{MODE}=ALWAYS_UPDATE"}  # the default mode needs no VMM allocator
    use_host_memory(0.0, 4.0, env, started=True, platform="gpu")
    assert env["XLA_FLAGS"] == f"--{MODE}=ALWAYS_UPDATE"
    env = {"XLA_FLAGS": ALL}
    use_host_memory(0.0, 4.0, env, started=True, platform="cpu")  # CPU ignores the mode
    assert env["XLA_FLAGS"] == ALL
    with pytest.raises(ValueError, match=r"--kv-offloading-size keeps arrays in pinned host memory.*SKIP_TEMP"):
        use_host_memory(0.0, 4.0, env, started=True, platform="gpu")


def test_host_memory_reads_jax_own_state_in_a_fresh_process():
    code = ("import os, deepinfer_jax; from deepinfer_jax.xla_env import use_host_memory; "
            "use_host_memory(1.0, 0.0); print(os.environ['XLA_FLAGS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DEEPINFER_XLA_DEFAULTS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert MODE not in out.stdout and REMAT in out.stdout
