"""The host picks a step's variant (runner/inputs.py: needs_full_variant): the base variant leaves
penalties, the top-k / top-p sort and logprobs out of the compiled step, so it must only be chosen
when no request of the step uses them."""

from __future__ import annotations

import pytest

from deepinfer_jax.runner.inputs import needs_full_variant
from deepinfer_jax.types import Request, SamplingParams


@pytest.mark.parametrize("kw, full", [
    ({}, False),
    ({"temperature": 0.0}, False),
    ({"temperature": 1.0, "min_p": 0.1}, False),  # min-p needs no sort: in the base variant
    ({"temperature": 0.7, "top_p": 0.9}, True),
    ({"temperature": 1.0, "top_k": 20}, True),
    ({"temperature": 1.0, "top_k": -1}, False),  # -1 = off
    ({"temperature": 0.0, "top_p": 0.5}, False),  # greedy ignores truncation
    ({"presence_penalty": 0.5}, True),
    ({"frequency_penalty": -0.2}, True),
    ({"repetition_penalty": 1.1}, True),
    ({"logprobs": 0}, True),
])
def test_needs_full_variant(kw, full):
    assert needs_full_variant(Request("r", [1, 2], SamplingParams(**kw))) is full
