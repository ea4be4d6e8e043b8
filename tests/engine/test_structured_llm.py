"""Structured output through the offline `LLM` (SamplingParams.structured_outputs) on the embedded default model
(one engine for the module): constrained and free requests in the same steps, every constrained output valid, the
free ones the same tokens as when they run alone (an all-ones mask row changes nothing); the mask variant (the plain
sampler and the bitmask) chosen for constrained steps that need nothing else of the full variant, the same tokens
as the full variant, and warmed up for every bucket; no compile after warm-up, every page and page row returned."""

from __future__ import annotations

import json
import os
import re
from collections import Counter

import jsonschema
import pytest

from deepinfer_jax import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_jax.runner.step_io import packed
from deepinfer_jax.runner.step_programs import program_kind

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer_jax", "assets", "default-model")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    return LLM(ASSET, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
               progress=False)


def _generate(llm, prompts, params):
    """(the outputs, the steps they ran by sampling variant)."""
    runner = llm.engine.runner
    before = Counter(runner.steps_by_variant)
    outs = llm.generate(prompts, params)
    return outs, runner.steps_by_variant - before


def test_llm_structured_outputs_beside_free_requests(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)]
    alone = llm.generate(["the quick brown fox"] * 2, free)
    so = StructuredOutputsParams
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=so(json=SCHEMA))
                   for i in range(6)]
    constrained += [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so(choice=["yes", "no"])),
                    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30,
                                   structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2,4}"))]
    outs, ran = _generate(llm, ["the quick brown fox"] * 2 + ["hello there"] * len(constrained), free + constrained)
    assert ran["mask"] > 0 and ran["full"] == 0
    for a, b in zip(alone, outs[:2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for o in outs[2:8]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert outs[8].outputs[0].text in ("yes", "no")
    assert len(outs[9].outputs) == 2 and all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text) for c in outs[9].outputs)
    eng = llm.engine
    # Those constrained steps ran their forward before their masks were filled (ModelRunner.dispatch's
    # before_sampling): every full- and mask-variant step, decode-sized ones included, is a forward and a sampler,
    # the variants sharing the bucket's forward, each compiled at warm-up.
    progs = eng.runner.programs
    assert eng.runner.mask_fills > 0 and eng.runner.mask_fill_rows >= eng.runner.mask_fills
    for bucket in eng.shapes.buckets:
        full, mask = (progs.programs_of(packed(eng.runner.padding_step(bucket, not m, masked=m))[0])
                      for m in (False, True))
        assert [kind for kind, _ in map(program_kind, full)] == ["forward", "sampler"]
        assert mask[0] == full[0] and mask[1] != full[1] and set(mask) <= set(progs.executables)
    assert eng.runner.compiles_after_warmup == 0
    assert eng.scheduler.kv_cache_manager.usage == 0.0
    assert len(eng.runner.page_rows) == 0


def test_mask_variant_gives_the_full_variants_tokens(llm):
    """Constrained rows (seeded draws and greedy, JSON and regex) beside free ones (greedy, a seeded draw with min-p):
    run in the mask variant, then forced into the full one (logprobs on the constrained requests), every request
    gets the same tokens."""
    so = StructuredOutputsParams
    free = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=5, min_p=0.05, max_tokens=20, ignore_eos=True)]

    def constrained(logprobs):
        lp = {"logprobs": logprobs}
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=so(json=SCHEMA), **lp)
                for i in range(3)] + [
            SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so(json=SCHEMA), **lp),
            SamplingParams(temperature=0.8, seed=9, max_tokens=12, structured_outputs=so(regex=r"[a-z]{3}-[0-9]{4}"),
                           **lp)]

    prompts = ["the quick brown fox", "a b c"] + ["hello there"] * 5
    lean, ran_lean = _generate(llm, prompts, free + constrained(None))
    full, ran_full = _generate(llm, prompts, free + constrained(0))
    assert ran_lean["mask"] > 0 and ran_lean["full"] == 0
    assert ran_full["full"] > 0 and ran_full["mask"] == 0
    assert [o.outputs[0].token_ids for o in lean] == [o.outputs[0].token_ids for o in full]
    assert lean[6].outputs[0].logprobs is None and len(full[6].outputs[0].logprobs) == len(full[6].outputs[0].token_ids)
    assert len({tuple(o.outputs[0].token_ids) for o in lean[2:5]}) == 3  # the seeded draws differ
    assert re.fullmatch(r"[a-z]{3}-[0-9]{4}", lean[6].outputs[0].text)
    assert llm.engine.runner.compiles_after_warmup == 0


@pytest.mark.parametrize("extra, variant", [
    ({}, "mask"),  # greedy constrained rows too: the mask variant, not the greedy one
    ({"temperature": 1.0, "seed": 1, "min_p": 0.1}, "mask"),  # min-p is in the plain sampler
    ({"logprobs": 2}, "full"),
    ({"temperature": 1.0, "seed": 1, "top_p": 0.9}, "full"),
    ({"temperature": 1.0, "seed": 1, "top_k": 5}, "full"),
    ({"logit_bias": {7: 1.0}}, "full"),
    ({"presence_penalty": 0.5}, "full"),
])
def test_constrained_steps_take_the_mask_variant_unless_a_row_needs_the_full_one(llm, extra, variant):
    """Every step of a constrained request (its prefill too) beside a free request, each decoding the same number
    of tokens: the mask variant, or the full one where either request's parameters need it."""
    so = StructuredOutputsParams(regex=r"[a-z]{80}")  # longer than 4 tokens
    params = [SamplingParams(max_tokens=4, **{"temperature": 0.0, **extra}, structured_outputs=so),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)]
    outs, ran = _generate(llm, ["hello there", "a b c"], params)
    assert set(ran) == {variant}
    assert re.fullmatch(r"[a-z]+", outs[0].outputs[0].text) and len(outs[0].outputs[0].token_ids) == 4
    # the same parameters on the free request instead
    params = [SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=so),
              SamplingParams(max_tokens=4, ignore_eos=True, **{"temperature": 0.0, **extra})]
    assert set(_generate(llm, ["hello there", "a b c"], params)[1]) == {variant}
    assert llm.engine.runner.compiles_after_warmup == 0
