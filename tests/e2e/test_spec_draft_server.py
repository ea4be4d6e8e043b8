"""Speculative decoding with a draft model through the server and the official OpenAI client: the scripted checkpoint
as its own draft (every draft accepted) answers with its script, as the engine does offline."""

from __future__ import annotations

import pytest

from e2e_helpers import API_KEY, MODEL, SERVER_FLAGS, ServerThread
from scripted import SCRIPT


class _SharedServer(ServerThread):
    """A ServerThread over an engine already built (start_server's `build`)."""

    def __init__(self, argv, llm):
        super().__init__(argv)
        self.llm = llm

    def _run(self) -> None:
        import asyncio

        from deepinfer_jax.server.app import start_server

        asyncio.set_event_loop(self.loop)
        try:
            self.server = self.loop.run_until_complete(
                start_server(self.ns, build=lambda: self.llm.engine, tokenizer=self.llm.tokenizer))
        except BaseException as e:  # noqa: BLE001
            self.error = e
        self._started.set()
        if self.error is None:
            self.loop.run_forever()


@pytest.fixture(scope="module")
def llm(scripted_model, xla_cache_dir):
    from deepinfer_jax import LLM

    path = scripted_model[0]
    return LLM(path, dtype="float32", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=64, page_size=8,
               progress=False, compilation_cache_dir=xla_cache_dir, token_buckets=(16, 64), greedy_variant=False,
               prefill_context_variant=False,
               speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 3})


def test_completions_through_the_client_with_a_draft_model(llm, scripted_model):
    from openai import OpenAI

    from deepinfer_jax import SamplingParams

    _, ids = scripted_model
    prompt = "Weather?<｜Assistant｜>"
    want = [ids[t] for t in SCRIPT[1:-1]]  # after <｜Assistant｜>, up to and including EOS
    offline = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert offline.token_ids == want and offline.finish_reason == "stop"
    stats = llm.engine.spec_stats
    drafted = stats.num_draft_tokens
    assert drafted > 0 and stats.num_accepted_tokens == drafted
    st = _SharedServer(["--model", scripted_model[0], "--port", "0", *SERVER_FLAGS], llm).start()
    try:
        with OpenAI(base_url=st.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0.0)
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=40, temperature=0.0, stream=True) if c.choices)
    finally:
        st.stop()
    assert out.choices[0].text == offline.text == streamed and out.choices[0].finish_reason == "stop"
    assert stats.num_draft_tokens > drafted and stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.runner.compiles_after_warmup == 0 and llm.engine.drafter.runner.compiles_after_warmup == 0
