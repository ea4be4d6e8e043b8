"""Speculative decoding (n-gram drafts) on the embedded default model, with its tokenizer: stop strings met inside
a step's accepted tokens, streamed deltas, and structured-output requests (which do not speculate) in the same
steps as speculating ones."""

from __future__ import annotations

import os

from deepinfer_jax import LLM, SamplingParams, StructuredOutputsParams
from deepinfer_jax.types import RequestOutputKind

ASSET = os.path.join(os.path.dirname(__file__), "..", "..", "deepinfer_jax", "assets", "default-model")
# A chat turn whose answer repeats its reasoning: the n-gram drafts of the answer's tokens are accepted.
QUESTION = [{"role": "user", "content": "What is 4 times 7?"}]


def test_stop_strings_streaming_and_grammars_with_speculation():
    llm = LLM(ASSET, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, page_size=8,
              progress=False, token_buckets=(16, 64),
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})
    eng = llm.engine
    PROMPT = llm.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    assert eng.spec_stats.num_accepted_tokens > 0
    text = free.text
    # The answer after </think> copies the reasoning line, so its tokens come several a step (accepted drafts). A stop
    # string that starts at the answer and ends inside such a step: the tokens after it are dropped, as if the
    # tokens had come one a step.
    ref = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True))[0].outputs[0]
    tok = llm.tokenizer
    j = ref.text.index("</think>") + len("</think>")
    stop = ref.text[j: j + 9]  # "\n\n" and the answer's first 7 characters: nowhere earlier in the text
    n = next(m for m in range(1, 29) if stop in tok.decode(ref.token_ids[:m]))
    accepted = eng.spec_stats.num_accepted_tokens
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True,
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
    # a step's text and outputs are made after the next step is queued (engine/speculative.py), so the host's text
    # pass overlaps the device: each step dispatches, then emits the step before (nothing after the first), and a
    # last step with nothing to plan emits the final tokens
    calls = []
    dispatch, emit = eng.runner.dispatch, eng._emit
    eng.runner.dispatch = lambda *a, **kw: calls.append("dispatch") or dispatch(*a, **kw)
    eng._emit = lambda fetched: calls.append("emit" if fetched else "none") or emit(fetched)
    try:
        again = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    finally:
        del eng.runner.dispatch, eng._emit
    assert again.token_ids == free.token_ids
    n = calls.count("dispatch")
    assert calls == ["dispatch", "none"] + ["dispatch", "emit"] * (n - 1) + ["emit"], calls
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

    for cfg, message in (({"method": "draft_model", "num_speculative_tokens": 1, "model": "/nowhere/d"},
                          r"model '/nowhere/d' \(the draft\) is not a directory"),
                         ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
                         ({"method": "ngram", "num_speculative_tokens": 2, "draft": "x"}, r"unknown keys \['draft'\]")):
        with pytest.raises(ValueError, match=message):
            LLM(ASSET, speculative_config=cfg, progress=False)
