"""--all2all-backend / all2all_backend: honoured with expert parallelism, refused with a line naming the flag
otherwise, and an unknown backend refused naming the choices."""

from __future__ import annotations

import pytest

from deepinfer_jax.sharding import ParallelConfig


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="--all2all-backend 'pplx' is not one of allgather_reducescatter, all_to_all"):
        ParallelConfig(2, 2, True, "pplx")


def test_all_to_all_without_expert_parallel_is_refused(tmp_path):
    from deepinfer_jax import LLM

    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        LLM(str(tmp_path), data_parallel_size=2, all2all_backend="all_to_all")


def test_cli_takes_the_flag():
    from deepinfer_jax.cli import _serve_parser
    from deepinfer_jax.server.args import engine_kwargs, parse_with_config

    ns = parse_with_config(_serve_parser(), ["-dp", "2", "-ep", "--all2all-backend", "all_to_all"])
    assert engine_kwargs(ns, platform="cpu")[0]["all2all_backend"] == "all_to_all"
    assert parse_with_config(_serve_parser(), []).all2all_backend == "allgather_reducescatter"
