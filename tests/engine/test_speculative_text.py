"""Speculative decoding (n-gram drafts) on the embedded default model, with its tokenizer: stop strings met inside
a step's accepted tokens, streamed deltas, and structured-output requests (which do not speculate) in the same
steps as speculating ones."""

from __future__ import annotations

import os

from deepinfer_jax import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_jax.types import RequestOutputKind

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer_jax", "assets", "default-model")
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


def test_stop_strings_streaming_and_grammars_with_speculation():
    llm = LLM(ASSET, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
              progress=False, token_buckets=(16, 64),
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    eng = llm.engine
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert eng.spec_stats.num_accepted_tokens > 0
    text = free.text
    # A prompt that holds the output's loop: from the first decode on, steps emit several tokens. A stop string that
    # starts in the output's third token ends inside such a step: the tokens after it are dropped, as if the
    # tokens had come one a step.
    looped = PROMPT + text
    ref = llm.generate([looped], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    tok = llm.tokenizer
    start = len(tok.decode(ref.token_ids[:2]))
    stop = ref.text[start: start + 3]
    n = next(m for m in range(1, 13) if stop in tok.decode(ref.token_ids[:m]))
    accepted = eng.spec_stats.num_accepted_tokens
    out = llm.generate([looped], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert eng.spec_stats.num_accepted_tokens > accepted
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == ref.text[: ref.text.find(stop)]
    assert out.token_ids == ref.token_ids[:n]
    # streamed deltas add up to the whole output
    eng.add_request("s", llm.tokenizer.encode(PROMPT),
                    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    texts, ids = [], []
    while eng.has_unfinished_requests():
        for o in eng.step():
            texts.append(o.outputs[0].text if o.outputs else "")
            ids += o.outputs[0].token_ids if o.outputs else []
    assert "".join(texts) == text and ids == free.token_ids
    # a grammar request beside speculating ones
    so = StructuredOutputsParams(choice=["yes", "no"])
    outs = llm.generate([PROMPT, "hello", PROMPT], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                                                     SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=so),
                                                     SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)])
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == free.token_ids
    assert outs[1].outputs[0].text in ("yes", "no")
    assert eng.runner.compiles_after_warmup == 0 and eng.scheduler.kv_cache_manager.usage == 0.0


def test_bad_speculative_configs_fail_before_loading():
    import pytest

    for cfg, message in (({"method": "deepseek_mtp", "num_speculative_tokens": 1}, "not supported yet"),
                         ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, r"unknown keys \['draft'\]")):
        with pytest.raises(ValueError, match=message):
            LLM(ASSET, speculative_config=cfg, progress=False)
