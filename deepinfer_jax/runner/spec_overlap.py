"""The device side of the overlapped speculating loop (RunnerConfig.spec_overlap, `deepseek_mtp` only;
engine/spec_overlap.py is the host side, docs/speculative.md "Overlap").

The engine plans step N + 1 before step N's results come back, as if every sequence of N accepted all its drafts,
so the host never waits for N before queueing N + 1. What N + 1 needs from N stays on the device: after each step
the program leaves, in its `prev_tokens` buffer (int32 [M * (2 + K)], M = the runner's max_rows):

    [0, M)            each sequence row's last emitted token (the bonus, or the target's token at its first rejection)
    [M, 2M)           its accepted drafts a_r (0..K)
    [2M, 2M + M * K)  the MTP's K drafts after its last accepted position

and the next step's placeholders read them: `bonus_placeholder(r, nd)` (the token after row r's step, which planned
nd drafts for it) and `draft_placeholder(r, i)`. A sequence row whose first token is a bonus placeholder was planned
nd - a_r positions too far: `resolve` moves its tokens' positions back by that much and recomputes their slots from
the page table (the host allocated pages for the optimistic positions, so every corrected slot is in them). Its
rejected drafts' slots of step N are then written again, as without the overlap."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from deepinfer_jax.models.cache import NULL_PAGE


def prev_size(max_rows: int, num_drafts: int) -> int:
    """Entries of the overlapped loop's prev_tokens buffer."""
    return max_rows * (2 + num_drafts)


def bonus_placeholder(row: int, num_drafts: int, max_rows: int) -> int:
    """The id standing for the last token step N emits at sequence row `row`, N having planned `num_drafts`
    drafts for it (<= -2, distinct from draft placeholders)."""
    return -(num_drafts * max_rows + row) - 2


def draft_placeholder(row: int, i: int, num_drafts: int, max_rows: int) -> int:
    """The id standing for the MTP's draft i (0-based) of step N's sequence row `row`; `num_drafts`: K."""
    return -(max_rows * (num_drafts + 1) + row * num_drafts + i) - 2


def next_prev(token_ids, accepted, drafts, max_rows: int):
    """A step's sampler rows (token_ids, accepted [S * W]) and MTP drafts [S, K] -> the prev_tokens buffer above."""
    S, K = drafts.shape
    W = K + 1
    acc = accepted.reshape(S, W).astype(jnp.int32)
    a = jnp.minimum(jnp.sum(jnp.cumprod(acc, axis=1), axis=1), W - 1)  # [S] leading accepted drafts
    last = jnp.take_along_axis(token_ids.reshape(S, W), a[:, None], axis=1)[:, 0]
    out = jnp.zeros((prev_size(max_rows, K),), jnp.int32)
    out = out.at[:S].set(last.astype(jnp.int32)).at[max_rows:max_rows + S].set(a)
    return out.at[2 * max_rows:2 * max_rows + S * K].set(drafts.reshape(-1).astype(jnp.int32))


def _lookup(ids, prev, max_rows: int, num_drafts: int):
    """ids -> (resolved ids, each bonus placeholder's position shift nd - a_r or 0)."""
    M, K = max_rows, num_drafts
    idx = -ids - 2
    ph = ids <= -2
    bonus = ph & (idx < M * (K + 1))
    row, nd = idx % M, idx // M
    b_tok = prev[jnp.clip(row, 0, M - 1)]
    shift = jnp.where(bonus, nd - prev[M + jnp.clip(row, 0, M - 1)], 0)
    d_tok = prev[2 * M + jnp.clip(idx - M * (K + 1), 0, M * K - 1)]
    return jnp.where(bonus, b_tok, jnp.where(ph, d_tok, ids)), shift


def resolve(meta, st, prev, max_rows: int, num_drafts: int, page_size: int):
    """The overlapped loop's placeholders in the metadata's token ids (with positions and slots corrected) and
    the sampling tensors' drafts; either may be None."""
    if meta is not None:
        ids, shift = _lookup(meta.token_ids, prev, max_rows, num_drafts)
        S, ps = meta.page_table.shape[0], page_size
        seq_shift = jnp.zeros((S,), jnp.int32).at[meta.seq_ids].max(shift)  # [S] (placeholders: first tokens only)
        slot = meta.slot_mapping
        real = slot // ps != NULL_PAGE  # padding tokens write the null page
        pos = meta.positions - jnp.where(real, seq_shift[meta.seq_ids], 0)
        page = meta.page_table[meta.seq_ids, pos // ps]
        slot = jnp.where(real, page * ps + pos % ps, slot)
        meta = dataclasses.replace(meta, token_ids=ids, positions=pos, slot_mapping=slot)
    if st is not None:
        st = dataclasses.replace(st, draft_token_ids=_lookup(st.draft_token_ids, prev, max_rows, num_drafts)[0])
    return meta, st
