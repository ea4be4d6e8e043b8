"""The XLA defaults deepinfer puts into XLA_FLAGS before JAX starts."""

import os
import subprocess
import sys

from deepinfer_jax.xla_env import DEFAULT_FLAGS, SINGLE_GPU_FLAGS, apply_default_xla_flags, with_default_flags

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
    assert env["XLA_FLAGS"] == "--a=1"
    for n in (0, 1):
        env = {}
        apply_default_xla_flags(env, num_gpus=n)
        assert env["XLA_FLAGS"] == ALL
    env = {"XLA_FLAGS": "--a=1"}
    apply_default_xla_flags(env, num_gpus=2)  # the command-buffer mode is not measured with collectives yet
    assert env["XLA_FLAGS"] == f"--a=1 {REMAT}"


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
