"""On-device token sampler (vLLM semantics), meant to run inside the model's jitted step.

Pipeline, per row b (everything vectorised over the padded batch B, vocab V):
  1. logits -> f32; returned logprobs are the raw ``log_softmax(logits)``'s (formed per element asked).
  2. ``apply_logit_bias`` (the request's logit_bias), then ``apply_penalties``: repetition (tokens in
     prompt or output: positive logits / rp, negative * rp), then frequency (- freq * output_count), then
     presence (- pres * [output_count > 0]).
  3. suppressed ids -> -inf, and ids outside the row's allowed-token bitmask (structured output) -> -inf.
  4. greedy rows (temperature < 1e-5): exact argmax of the result of 3.
  5. other rows: / temperature, ``apply_truncation`` (top-k, then top-p over the top-k
     renormalised distribution, then min-p), then a Gumbel-max draw keyed by the row's key data
     (`categorical_rows`: the argmax of logits + `gumbel_noise`, taken in chunks).
  6. with `draft_token_ids` (speculative decoding), each row verifies its draft instead of drawing freely:
     sampling/rejection.py.

Invariants:
  * Rows are independent: the output of a row depends only on that row's logits and
    tensors, never on padding rows (which may hold any values) nor on the row's position.
  * The random draw depends only on ``rng_key_data[b]`` and the row's masked logits, so
    equal keys give equal tokens in any batch.
  * Ids < 0 (padding, -1) or >= V in the id tensors are ignored (never counted/suppressed).
  * With all knobs off (T>0, top_k<=0, top_p=1, min_p=0, pres=freq=0, rp=1) the sampled
    distribution is exactly softmax(logits / T), and the penalty and sort stages are identities.
  * No data-dependent control flow: a ``lax.cond`` on a device value makes the GPU runtime read the
    predicate on the host, which stalls the host until the whole forward before it has run (the
    engine then cannot queue the next step while this one runs). Instead ``sample(full=False)``
    (the runner's base variant, chosen on the host when no row uses penalties, top-k or top-p)
    leaves those stages out statically; ``full=True`` always runs them.
  * Ties at a top-k / top-p cutoff value are all kept (thresholding by value).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.sampling.draw import ARGMAX_CHUNK, categorical_rows, gumbel_noise, noise_bits  # noqa: F401
from deepinfer_jax.sampling.rejection import rejection_sample

GREEDY_EPS = 1e-5  # temperature below this => greedy (vLLM's _SAMPLING_EPS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters; B = padded batch rows (padding rows: any values)."""
    temperature: jax.Array         # f32[B]    < 1e-5 => greedy
    top_k: jax.Array               # i32[B]    <= 0 or >= V => off
    top_p: jax.Array               # f32[B]    >= 1.0 => off
    min_p: jax.Array               # f32[B]    0.0 => off
    presence_penalty: jax.Array    # f32[B]    0.0 => off
    frequency_penalty: jax.Array   # f32[B]    0.0 => off
    repetition_penalty: jax.Array  # f32[B]    1.0 => off
    prompt_token_ids: jax.Array    # i32[B, Lp] padded with -1 (repetition only)
    output_token_ids: jax.Array    # i32[B, Lo] padded with -1 (all three penalties)
    suppress_token_ids: jax.Array  # i32[B, S]  padded with -1 (logit -> -inf)
    rng_key_data: jax.Array        # u32[B, 2]  key data (keys.make_key_data; the draw's noise_bits)
    # i32[B, W] packed allowed-token bits (structured output: bit t % 32 of word t // 32 allows token t), all ones
    # for a free row; W = 0 (or None) leaves the stage out (statically).
    allowed_token_bits: jax.Array | None = None
    # logit_bias: i32[B, K] token ids (-1 padding) and f32[B, K] their biases, added to the logits first; K = 0 (or
    # None) leaves the stage out (statically).
    logit_bias_ids: jax.Array | None = None
    logit_bias_values: jax.Array | None = None
    # Speculative decoding: i32[B] the draft token each row verifies (-1: none; sampling/rejection.py), or None
    # for no verification stage (statically).
    draft_token_ids: jax.Array | None = None

    @classmethod
    def defaults(cls, batch: int, prompt_len: int = 0, output_len: int = 0,
                 suppress_len: int = 0, mask_words: int = 0, bias_len: int = 0) -> "SamplingTensors":
        """Host (numpy) tensors with every knob off, temperature 1, keys zero, ids -1, every token allowed."""
        f = lambda v: np.full((batch,), v, np.float32)
        ids = lambda n: np.full((batch, n), -1, np.int32)
        return cls(temperature=f(1.0), top_k=np.zeros((batch,), np.int32), top_p=f(1.0),
                   min_p=f(0.0), presence_penalty=f(0.0), frequency_penalty=f(0.0),
                   repetition_penalty=f(1.0), prompt_token_ids=ids(prompt_len),
                   output_token_ids=ids(output_len), suppress_token_ids=ids(suppress_len),
                   rng_key_data=np.zeros((batch, 2), np.uint32),
                   allowed_token_bits=np.full((batch, mask_words), -1, np.int32),
                   logit_bias_ids=ids(bias_len), logit_bias_values=np.zeros((batch, bias_len), np.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    token_ids: jax.Array        # i32[B]
    logprob: jax.Array          # f32[B]     raw log_softmax(logits)[token]
    top_logprob_ids: jax.Array  # i32[B, K]  K = max_logprobs (may be 0)
    top_logprobs: jax.Array     # f32[B, K]  raw log-softmax top-K, sorted descending
    accepted: jax.Array | None = None  # i32[B] 1 where the row's draft was accepted (only with draft_token_ids)
    drafts: jax.Array | None = None  # i32[S, K] the MTP's drafts a sequence row (`deepseek_mtp`: models/mtp.py)


def _id_mask_scatter(ids: jax.Array, vocab: int, dtype) -> jax.Array:
    """ids i32[B, L] -> [B, V] counts (int32) or presence (bool); ids outside [0, V) dropped."""
    b, l = ids.shape
    valid = (ids >= 0) & (ids < vocab)
    col = jnp.where(valid, ids, vocab)                     # vocab => out of bounds => dropped
    row = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, l))
    out = jnp.zeros((b, vocab), dtype)
    if dtype == jnp.bool_:
        return out.at[row, col].set(True, mode="drop")
    return out.at[row, col].add(valid.astype(dtype), mode="drop")


def token_counts(ids: jax.Array, vocab: int) -> jax.Array:
    """i32[B, L] (-1 padded) -> i32[B, V] occurrence counts, via an on-device scatter-add."""
    return _id_mask_scatter(ids, vocab, jnp.int32)


def apply_penalties(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """f32[B, V] -> f32[B, V]: repetition, then frequency, then presence (vLLM formulas)."""
    vocab = logits.shape[-1]
    out_counts = token_counts(st.output_token_ids, vocab)              # i32[B, V]
    out_seen = out_counts > 0                                          # bool[B, V]
    seen = out_seen | _id_mask_scatter(st.prompt_token_ids, vocab, jnp.bool_)
    rp = st.repetition_penalty.astype(jnp.float32)[:, None]            # f32[B, 1]
    penalised = jnp.where(logits > 0, logits / rp, logits * rp)
    logits = jnp.where(seen, penalised, logits)
    logits = logits - st.frequency_penalty.astype(jnp.float32)[:, None] * out_counts
    return logits - st.presence_penalty.astype(jnp.float32)[:, None] * out_seen


def apply_suppression(logits: jax.Array, suppress_ids: jax.Array) -> jax.Array:
    """f32[B, V], i32[B, S] -> f32[B, V] with listed ids set to -inf.

    Each id compared with the S (few) listed ids, OR-ed, instead of a [B, V] mask scattered from them: on an
    H200 at B = 32, V = 102,400, S = 8 one elementwise kernel and the select (5.1 + 1.2 us a step), where the
    scatter took three (a broadcast 4.4, the scatter 1.2, the select 1.3; benchmarks/RESULTS.md)."""
    col = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)  # i32[B, V]
    hit = jnp.zeros(logits.shape, jnp.bool_)
    for j in range(suppress_ids.shape[-1]):  # -1 padding matches no id
        hit = hit | (col == suppress_ids[:, j : j + 1])
    return jnp.where(hit, -jnp.inf, logits)


def apply_logit_bias(logits: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """f32[B, V], i32[B, K] ids (-1 or >= V: ignored), f32[B, K] -> f32[B, V] with values[b, k] added to
    logits[b, ids[b, k]] (a repeated id adds twice)."""
    batch, vocab = logits.shape
    col = jnp.where((ids >= 0) & (ids < vocab), ids, vocab)               # vocab => dropped
    row = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], ids.shape)
    return logits.at[row, col].add(values.astype(logits.dtype), mode="drop")


def apply_token_bitmask(logits: jax.Array, bits: jax.Array) -> jax.Array:
    """f32[B, V], i32[B, W] packed bits (W * 32 >= V) -> f32[B, V] with the ids whose bit is 0 at -inf.
    Elementwise (a broadcast shift and a mask an id, no gather), so XLA fuses it into the passes over the
    logits that follow."""
    batch, vocab = logits.shape
    shift = jnp.arange(32, dtype=jnp.int32)                                 # i32[32]
    bit = (bits.astype(jnp.int32)[:, :, None] >> shift) & 1                 # i32[B, W, 32] (arithmetic >>)
    allowed = bit.reshape(batch, -1)[:, :vocab] != 0                        # bool[B, V]: id w * 32 + j
    return jnp.where(allowed, logits, -jnp.inf)


def _sorted_cutoff(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """f32[B, V] -> f32[B, 1]: smallest logit kept by top-k then top-p (one sort per row)."""
    vocab = logits.shape[-1]
    srt = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)                 # f32[B, V] descending
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    k = jnp.clip(k, 1, vocab).astype(jnp.int32)[:, None]               # i32[B, 1]
    pos = jnp.arange(vocab, dtype=jnp.int32)[None, :]                  # i32[1, V]
    probs = jax.nn.softmax(jnp.where(pos < k, srt, -jnp.inf), axis=-1)  # top-k renormalised
    cum = jnp.cumsum(probs, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=-1)
    # Keep position i iff the mass strictly above it is < p: the smallest prefix whose
    # cumulative prob >= p (always >= 1 token). Equals vLLM's ascending "cumsum <= 1-p".
    n_p = jnp.sum(mass_before < top_p[:, None], axis=-1, keepdims=True, dtype=jnp.int32)
    n_p = jnp.where(top_p[:, None] >= 1.0, vocab, n_p)
    n_keep = jnp.clip(jnp.minimum(k, n_p), 1, vocab)                   # i32[B, 1]
    return jnp.take_along_axis(srt, n_keep - 1, axis=-1)


def apply_truncation(logits: jax.Array, top_k: jax.Array, top_p: jax.Array,
                     min_p: jax.Array, sort: bool = True) -> jax.Array:
    """f32[B, V] (already temperature-scaled) -> f32[B, V] with dropped ids at -inf.

    top-k, then top-p over the top-k renormalised distribution, then min-p (drop ids with
    prob < min_p * max_prob; ratio-based, so independent of renormalisation). The argmax
    is always kept. Rows with all three off are returned unchanged. `sort=False` (static) skips
    top-k / top-p: only valid when no row uses them.
    """
    if sort:
        cutoff = _sorted_cutoff(logits, top_k.astype(jnp.int32), top_p.astype(jnp.float32))
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    ratio = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # p_i / p_max
    return jnp.where(ratio < min_p.astype(jnp.float32)[:, None], -jnp.inf, logits)


def sample(logits: jax.Array, st: SamplingTensors, *, max_logprobs: int, full: bool = True,
           draw: bool = True) -> SampleOutput:
    """logits f32|bf16[B, V] -> SampleOutput. Jittable; ``max_logprobs``, ``full`` and ``draw`` must be static.
    ``full=False`` leaves out penalties and top-k / top-p (module docstring): the caller guarantees
    that no row uses them. ``draw=False`` leaves out the temperature, min-p and the random draw (the
    greedy variant, vLLM's all-greedy path): the caller guarantees that every row is greedy."""
    logits = logits.astype(jnp.float32)                                # f32[B, V]
    batch, vocab = logits.shape
    k = min(max(max_logprobs, 0), vocab)
    # log_softmax's arithmetic (x - max) - log(sum(exp(x - max))), its [B, V] result formed only where the
    # top-k logprobs need it: the sampled token's logprob takes one element of each row.
    row_max = jnp.max(logits, axis=-1, keepdims=True)                  # f32[B, 1]
    log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))  # f32[B, 1]

    x = logits
    if st.logit_bias_ids is not None and st.logit_bias_ids.shape[-1] > 0:
        x = apply_logit_bias(x, st.logit_bias_ids, st.logit_bias_values)
    x = apply_penalties(x, st) if full else x
    if st.suppress_token_ids.shape[-1] > 0:
        x = apply_suppression(x, st.suppress_token_ids)
    if st.allowed_token_bits is not None and st.allowed_token_bits.shape[-1] > 0:
        x = apply_token_bitmask(x, st.allowed_token_bits)
    greedy_ids = jnp.argmax(x, axis=-1).astype(jnp.int32)              # i32[B]

    draft = st.draft_token_ids
    accepted = None
    if draw:
        temp = st.temperature.astype(jnp.float32)
        is_greedy = temp < GREEDY_EPS                                  # bool[B]
        scaled = x / jnp.where(is_greedy, 1.0, temp)[:, None]
        masked = apply_truncation(scaled, st.top_k, st.top_p, st.min_p, sort=full)
        if draft is not None:  # verification: the draft or the residual's draw (a plain draw where no draft)
            token_ids, accepted = rejection_sample(masked, draft, st.rng_key_data, is_greedy, greedy_ids)
        else:
            drawn = categorical_rows(st.rng_key_data, masked)
            token_ids = jnp.where(is_greedy, greedy_ids, drawn)
    else:
        token_ids = greedy_ids
        if draft is not None:
            accepted = (draft >= 0) & (greedy_ids == draft)

    picked = jnp.take_along_axis(logits, token_ids[:, None], axis=-1)  # f32[B, 1]
    logprob = ((picked - row_max) - log_norm)[:, 0]
    if k > 0:
        top_lp, top_ids = jax.lax.top_k((logits - row_max) - log_norm, k)
    else:
        top_lp, top_ids = jnp.zeros((batch, 0), jnp.float32), jnp.zeros((batch, 0), jnp.int32)
    if max_logprobs > k:                                               # pad: -inf, id -1
        top_lp = jnp.pad(top_lp, ((0, 0), (0, max_logprobs - k)), constant_values=-jnp.inf)
        top_ids = jnp.pad(top_ids, ((0, 0), (0, max_logprobs - k)), constant_values=-1)
    return SampleOutput(token_ids=token_ids, logprob=logprob,
                        top_logprob_ids=top_ids.astype(jnp.int32), top_logprobs=top_lp,
                        accepted=None if accepted is None else accepted.astype(jnp.int32))
