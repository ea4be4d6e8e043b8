"""On-device token sampling (vLLM semantics). Imports nothing else from deepinfer_jax.

Public API:
  SamplingTensors, SampleOutput, sample(logits, st, *, max_logprobs)  -- jittable
  apply_penalties, apply_suppression, apply_truncation, token_counts  -- stages (testing)
  apply_token_bitmask(logits, bits)                                   -- a structured-output mask (packed bits)
  apply_logit_bias(logits, ids, values)                               -- a request's logit_bias
  gumbel_noise(k0, k1, col)                                           -- the draw's noise
  make_key_data(seed, step), make_key_data_batch(seeds, steps)        -- host key helpers
  rejection_sample(...)                                               -- speculative decoding's verification
"""

from deepinfer_jax.sampling.keys import make_key_data, make_key_data_batch, threefry2x32
from deepinfer_jax.sampling.rejection import rejection_sample
from deepinfer_jax.sampling.sampler import (
    GREEDY_EPS,
    SampleOutput,
    SamplingTensors,
    apply_logit_bias,
    apply_penalties,
    apply_suppression,
    apply_token_bitmask,
    apply_truncation,
    gumbel_noise,
    sample,
    token_counts,
)

__all__ = [
    "GREEDY_EPS", "SampleOutput", "SamplingTensors", "apply_logit_bias", "apply_penalties", "apply_suppression",
    "apply_token_bitmask", "apply_truncation", "gumbel_noise", "make_key_data", "make_key_data_batch", "rejection_sample", "sample",
    "threefry2x32", "token_counts",
]
