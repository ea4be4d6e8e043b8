"""Prompt logprobs (vLLM's `prompt_logprobs`, OpenAI completions' `echo` with `logprobs`): the model's log
probability of each prompt token given the ones before it, with its vocabulary rank and the top k alternatives.

A request asks for them once, at admission; the paged step programs only produce the logits of each sequence's
last token, so the prompt is scored by its own program: the model's dense forward (`models.deepseek.forward`,
causal attention over the prompt alone, no KV cache) on the prompt padded to a length bucket (a power of two,
at least 16), then log-softmax over the vocabulary at every position. One program per length bucket, made on
the first prompt of that bucket and kept (compiled outside warm-up: each bucket's first prompt pays one
compile, logged). `k` is always the runner's `max_logprobs` so a bucket has one program; callers slice.

Invariants: for a prompt p[0..L) the result row i (i in [0, L-1)) holds log P(p[i+1] | p[..i]), its rank
1 + #{tokens with a larger logprob}, and the top k (token ids, logprobs) in decreasing order; the first prompt
token has no entry (the caller reports None, as vLLM does). The logits are the model's own: no temperature,
penalties or logit_bias.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.runner.weight_offload import stream

log = logging.getLogger(__name__)

MIN_BUCKET = 16


def length_bucket(n: int) -> int:
    """The padded length of an n-token prompt: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


class PromptScorer:
    """Scores prompts with the runner's params; holds one jitted program per length bucket."""

    def __init__(self, cfg: ModelConfig, k: int, moe_impl: str):
        self.cfg, self.k, self.moe_impl = cfg, k, moe_impl
        self._fns: dict[int, Any] = {}

    def _fn(self, bucket: int):
        if bucket not in self._fns:
            cfg, k, moe_impl = self.cfg, self.k, self.moe_impl

            def score(params, token_ids, length):  # token_ids [1, bucket] int32, length: int32 scalar
                params, fetch = stream(params, "deepseek")  # weights in host memory (--cpu-offload-gb)
                valid = jnp.arange(bucket) < length
                logits = forward(params, cfg, token_ids, moe_impl=moe_impl, attention_mask=valid[None],
                                 layer_fetch=fetch)[0]
                logp = jax.nn.log_softmax(logits[:-1], axis=-1)  # [bucket - 1, V]: position i predicts i + 1
                nxt = token_ids[0, 1:]
                lp = jnp.take_along_axis(logp, nxt[:, None], axis=-1)[:, 0]
                rank = 1 + jnp.sum(logp > lp[:, None], axis=-1, dtype=jnp.int32)
                top_lps, top_ids = jax.lax.top_k(logp, max(k, 1))
                return lp, rank, top_ids, top_lps

            log.info("prompt logprobs: compiling the scoring program of length bucket %d", bucket)
            self._fns[bucket] = jax.jit(score)
        return self._fns[bucket]

    def score(self, params, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(logprob [L-1] fp32, rank [L-1] int32, top ids [L-1, k], top logprobs [L-1, k]) for an L-token prompt."""
        n = len(token_ids)
        bucket = length_bucket(n)
        ids = np.zeros((1, bucket), np.int32)
        ids[0, :n] = token_ids
        out = self._fn(bucket)(params, ids, np.int32(n))
        lp, rank, top_ids, top_lps = (np.asarray(a)[: n - 1] for a in jax.device_get(out))
        return lp, rank, top_ids[:, : self.k], top_lps[:, : self.k]
