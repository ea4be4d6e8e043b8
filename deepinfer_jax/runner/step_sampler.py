"""The sampler half of a step program: each sequence's last-token output -> the step's SampleOutput.

Three forms, fixed per runner (`lm_head_in_sampler`, `logits_stats_sampler`):

- the forward returns the fp32 logits [S, V] and `sampling.sample` reads them (every variant);
- the same, with RunnerConfig.sampler_kernel (one device, the Pallas path): the base and greedy variants read
  the logits in one kernel pass (kernels/lm_head_sample.py logits_sample_stats; the greedy one without the
  noise) and `sampling.sample_from_tile_stats` merges its tiles, the same tokens as `sample`'s and, as in the
  next form, no min-p in the base variant;
- with RunnerConfig.lm_head_sampler, on the Pallas path of one device with a float lm_head the kernel
  tiles, the forward returns the final-normed hidden states [S, D] instead. The base variant then runs
  the lm_head and the sampler's reductions over the vocabulary in one kernel (kernels/lm_head_sample.py),
  so the logits never reach device memory, and `sampling.sample_from_tile_stats` merges the tiles: the
  same tokens as `sample`'s base variant. That variant takes no min-p (the host sends those steps to
  the full variant: inputs.needs_full_variant(min_p_full=True)). The full variant applies the lm_head
  itself (models/deepseek.py lm_head_logits) and samples as in the first form.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig, RunnerConfig
from deepinfer_jax.models.deepseek import lm_head_logits
from deepinfer_jax.sampling import SampleOutput, SamplingTensors, gumbel_noise, sample, sample_from_tile_stats


def lm_head_in_sampler(cfg: ModelConfig, runner_cfg: RunnerConfig, lm_head: Any, sharding: Any) -> bool:
    """Whether this runner's step programs sample inside the lm_head (module docstring)."""
    from deepinfer_jax.kernels import lm_head_sample

    return (runner_cfg.lm_head_sampler and sharding is None and runner_cfg.attn_impl.startswith("pallas")
            and isinstance(lm_head, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(lm_head.dtype, jnp.floating)
            and lm_head_sample.supported(cfg.vocab_size, cfg.hidden_size))


def logits_stats_sampler(cfg: ModelConfig, runner_cfg: RunnerConfig, sharding: Any) -> bool:
    """Whether this runner's base variant samples from the logits through the kernel (module docstring)."""
    from deepinfer_jax.kernels import lm_head_sample

    return (runner_cfg.sampler_kernel and sharding is None and runner_cfg.attn_impl.startswith("pallas")
            and lm_head_sample.logits_supported(cfg.vocab_size))


def sample_step_outputs(out: jax.Array, lm_head: Any, st: SamplingTensors, *, max_logprobs: int, full: bool,
                        in_lm_head: bool, interpret: bool, draw: bool = True,
                        logits_kernel: bool = False) -> SampleOutput:
    """out: the forward's per-sequence output (logits [S, V] fp32, or with `in_lm_head` the final-normed
    hidden states [S, D]) -> the step's SampleOutput (`sampling.sample` semantics; `draw=False`: every row
    greedy, the greedy variant; `logits_kernel`: the base and greedy variants through the logits kernel)."""
    if not in_lm_head:
        if logits_kernel and not full:
            from deepinfer_jax.kernels import lm_head_sample

            stats = lm_head_sample.logits_sample_stats(out, st.temperature, st.rng_key_data, st.suppress_token_ids,
                                                       noise=gumbel_noise if draw else None, interpret=interpret)
            return sample_from_tile_stats(stats, st, max_logprobs=max_logprobs)
        return sample(out, st, max_logprobs=max_logprobs, full=full, draw=draw)
    if full:
        return sample(lm_head_logits(lm_head, out), st, max_logprobs=max_logprobs, full=True)
    from deepinfer_jax.kernels import lm_head_sample

    stats = lm_head_sample.lm_head_sample_stats(out, lm_head, st.temperature, st.rng_key_data,
                                                st.suppress_token_ids, noise=gumbel_noise, interpret=interpret)
    return sample_from_tile_stats(stats, st, max_logprobs=max_logprobs)
