"""Structured output through the offline `LLM` (SamplingParams.structured_outputs) on the embedded default model:
constrained and free requests in the same steps, every constrained output valid, the free ones the same tokens as
when they run alone (an all-ones mask row changes nothing), no compile after warm-up, every page and page row
returned."""

from __future__ import annotations

import json
import os
import re

import jsonschema

from deepinfer_jax import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_jax.runner.step_io import packed
from deepinfer_jax.runner.step_programs import program_kind

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer_jax", "assets", "default-model")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def test_llm_structured_outputs_beside_free_requests():
    llm = LLM(ASSET, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
              progress=False)
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)]
    alone = llm.generate(["the quick brown fox"] * 2, free)
    so = StructuredOutputsParams
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=so(json=SCHEMA))
                   for i in range(6)]
    constrained += [SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=so(choice=["yes", "no"])),
                    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=30,
                                   structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2,4}"))]
    outs = llm.generate(["the quick brown fox"] * 2 + ["hello there"] * len(constrained), free + constrained)
    for a, b in zip(alone, outs[:2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for o in outs[2:8]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert outs[8].outputs[0].text in ("yes", "no")
    assert len(outs[9].outputs) == 2 and all(re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", c.text) for c in outs[9].outputs)
    eng = llm.engine
    # Those constrained steps ran their forward before their masks were filled (ModelRunner.dispatch's
    # before_sampling): every full-variant step, decode-sized ones included, is a forward and a sampler.
    progs = eng.runner.programs
    for bucket in eng.shapes.buckets:
        key = packed(eng.runner.padding_step(bucket, True))[0]
        assert [kind for kind, _ in map(program_kind, progs.programs_of(key))] == ["forward", "sampler"]
    assert eng.runner.compiles_after_warmup == 0
    assert eng.scheduler.kv_cache_manager.usage == 0.0
    assert len(eng.runner.page_rows) == 0
