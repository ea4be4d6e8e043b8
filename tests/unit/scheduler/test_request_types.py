"""SamplingParams validation and Request bookkeeping (types.py)."""

import pytest

from deepinfer_jax.types import (
    CompletionOutput,
    Request,
    RequestOutput,
    RequestOutputKind,
    RequestStatus,
    SamplingParams,
)


def test_defaults_follow_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.max_tokens, sp.min_tokens, sp.logprobs, sp.seed) == (16, 0, None, None)
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.skip_special_tokens and not sp.ignore_eos and not sp.include_stop_str_in_output
    assert not sp.is_greedy()
    assert SamplingParams(temperature=0).is_greedy()


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**31}, "top_k"),  # the step takes top_k as int32
        ({"min_p": 1.1}, "min_p"),
        ({"seed": "x"}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"output_kind": 3}, "output_kind"),
        ({"output_kind": "delta"}, "output_kind"),
        ({"output_kind": True}, "output_kind"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(field + " must")


def test_temperature_message():
    with pytest.raises(ValueError, match=r"^temperature must be non-negative, got -1$"):
        SamplingParams(temperature=-1)


def test_valid_edges():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=20)
    SamplingParams(logprobs=0, min_tokens=4, max_tokens=4, top_k=1)


def test_frozen():
    with pytest.raises(Exception):
        SamplingParams().temperature = 0.5


def test_request_token_views():
    r = Request("r", [1, 2, 3], SamplingParams(), eos_token_ids=[9])
    assert r.eos_token_ids == (9,)
    r.output_token_ids += [4, 5]
    assert r.num_tokens == 5 and r.num_prompt_tokens == 3 and r.num_output_tokens == 2
    assert r.all_token_ids == [1, 2, 3, 4, 5]
    for a in range(6):
        for b in range(a, 6):
            assert r.token_ids_slice(a, b) == r.all_token_ids[a:b]
    assert r.status is RequestStatus.WAITING and r.finish_reason is None and not r.is_finished
    r.status = RequestStatus.FINISHED_LENGTH
    assert r.is_finished and r.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert not RequestStatus.PREEMPTED.is_finished


def test_outputs():
    c = CompletionOutput(0, "hi", [1, 2])
    assert not c.finished()
    c.finish_reason = "stop"
    out = RequestOutput("r", "p", [7], 0, [c], True)
    assert out.outputs[0].finished() and out.finished
