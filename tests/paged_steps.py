"""A paged forward step from per-sequence chunks, shared by the paged-forward tests (tests/model/)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.models.cache import StepMetadata
from deepinfer_jax.models.registry import family_of

PAGE = 8


def step(params, cfg, cache, ids, pages, chunks, pad_to=None, attn_impl="reference", fn=None, fwd=None,
         **kw):
    """chunks: per sequence (start, n). Flattens them into one ragged step, optionally padded. `fn`: the step
    function (default: the family's forward_paged, or a jitted form of it taking the same arguments); `fwd`: a jitted
    (params, cache, meta) -> (logits, cache) to run instead."""
    tid, pos, sid, slot, last = [], [], [], [], []
    for s, (start, n) in enumerate(chunks):
        for p in range(start, start + n):
            tid.append(ids[s][p])
            pos.append(p)
            sid.append(s)
            slot.append(pages[s][p // PAGE] * PAGE + p % PAGE)
        last.append(len(tid) - 1)
    while pad_to and len(tid) < pad_to:  # padding tokens write into the null page 0
        tid.append(0)
        pos.append(0)
        sid.append(0)
        slot.append(len(tid) % PAGE)
    table = np.zeros((len(pages), max(map(len, pages)) + 1), np.int32)
    for s, pg in enumerate(pages):
        table[s, : len(pg)] = pg
    arr = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    meta = StepMetadata(arr(tid), arr(pos), arr(sid), arr(slot), jnp.asarray(table), arr(last))
    if fwd is not None:
        return fwd(params, cache, meta)
    return (fn or family_of(cfg).forward_paged)(params, cfg, cache, meta, attn_impl=attn_impl, **kw)
