"""--all2all-backend / all2all_backend and --enable-eplb / --eplb-config: taken with expert parallelism, refused
with a line naming the flag otherwise; an unknown backend or EPLB key refused by name."""

from __future__ import annotations

import pytest

from deepinfer_jax.sharding import ParallelConfig


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="--all2all-backend 'pplx' is not one of allgather_reducescatter, all_to_all"):
        ParallelConfig(2, 2, True, all2all_backend="pplx")


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


def test_eplb_refusals(tmp_path):
    from deepinfer_jax import LLM

    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        LLM(str(tmp_path), data_parallel_size=2, enable_eplb=True)
    with pytest.raises(ValueError, match="--enable-eplb"):
        LLM(str(tmp_path), data_parallel_size=2, enable_expert_parallel=True, eplb_config={"num_redundant_experts": 2})
    with pytest.raises(ValueError, match="'step_interval' is not supported"):
        LLM(str(tmp_path), data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
            eplb_config='{"step_interval": 100}')
