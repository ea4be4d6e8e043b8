"""The XLA defaults deepinfer puts into XLA_FLAGS before JAX starts."""

import os
import subprocess
import sys

from deepinfer_jax.xla_env import DEFAULT_FLAGS, apply_default_xla_flags, with_default_flags

MODE = "xla_gpu_command_buffer_update_mode"


def test_defaults_are_added_once_and_never_override_the_user():
    assert with_default_flags("") == f"--{MODE}=SKIP_PROFILED"
    assert with_default_flags("--xla_dump_to=/tmp/x") == f"--xla_dump_to=/tmp/x --{MODE}=SKIP_PROFILED"
    assert with_default_flags(f"--{MODE}=ALWAYS_UPDATE") == f"--{MODE}=ALWAYS_UPDATE"
    twice = with_default_flags(with_default_flags(""))
    assert twice == f"--{MODE}=SKIP_PROFILED"


def test_apply_respects_the_opt_out_and_skips_several_gpus():
    env = {"DEEPINFER_XLA_DEFAULTS": "0", "XLA_FLAGS": "--a=1"}
    apply_default_xla_flags(env, num_gpus=1)
    assert env["XLA_FLAGS"] == "--a=1"
    for n in (0, 1):
        env = {}
        apply_default_xla_flags(env, num_gpus=n)
        assert env["XLA_FLAGS"] == " ".join(f"--{k}={v}" for k, v in DEFAULT_FLAGS.items())
    env = {"XLA_FLAGS": "--a=1"}
    apply_default_xla_flags(env, num_gpus=2)  # not measured with collectives yet
    assert env["XLA_FLAGS"] == "--a=1"


def _flags_after_import(env_flags):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "DEEPINFER_XLA_DEFAULTS")}
    if env_flags is not None:
        env["XLA_FLAGS"] = env_flags
    code = "import os, deepinfer_jax, jax; jax.numpy.ones(2).block_until_ready(); print(os.environ['XLA_FLAGS'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_importing_the_package_sets_the_flags_before_jax_starts():
    # XLA parses the flags when the backend starts: an unknown or malformed flag would abort here.
    assert _flags_after_import(None) == f"--{MODE}=SKIP_PROFILED"
    assert _flags_after_import(f"--{MODE}=ALWAYS_UPDATE") == f"--{MODE}=ALWAYS_UPDATE"
