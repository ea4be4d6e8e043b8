"""DeepSeek-V4 through the engine: the per-group paged cache and the forward over one ragged step.

The cache holds what each group of `v4_cache_groups` (config_v4.py) needs, paged per group as the scheduler
accounts it (scheduler/hybrid_cache_manager.py), one array per pool of the engine's CachePools: [pool pages,
page elements], group g's page p that pool's row p seen as [layers of g, rows a page of g, row width of g] (rows:
page_size, or the state groups' own smaller page, CacheGroup.rows_per_page):
  sliding    every layer    `raw`, the roped K = V row [hd] of each token (window sliding_window);
  csa_state  CSA layers     the compressor's `kv`, `gate` [2hd] and the indexer's `idx_kv`, `idx_gate` [2di] of
                            each token (window 2m: a CSA row pools two windows);
  csa        CSA layers     per m tokens, the pooled row [hd] and the pooled indexer key [di];
  hca_state  HCA layers     the compressor's `kv`, `gate` [hd] of each token (window m');
  hca        HCA layers     per m' tokens, the pooled row [hd].
Page 0 of every pool is the null page (padding and tokens that close no window write there; freed window pages
read from it, masked). A group's page table and slot mapping come in StepMetadata.groups.

A step, per layer: its tokens' raw rows and projections are written at their slots; a token that closes a
compression window (pos + 1 a multiple of the rate) pools the window's projections from the state pages (CSA:
series a of the previous window and series b of its own) and writes the row, once; each token then attends over
the raw rows of its window and its sequence's closed compressed rows (CSA: the lightning indexer's top-k of the
cached keys), with the sink, in one softmax (the concatenation is the log-sum-exp merge of the two parts). So
chunks may end anywhere inside a window: the open window's projections wait in the state pages. The queries attend
a block of TOKEN_BLOCK at a time, each gathering only the rows it sees (window, top-k CSA rows, HCA rows), so a long
context's temporaries grow with the block, not the step. `attn_impl` "pallas" scores the CSA index keys in V3.2's
paged indexer kernel (kernels/dsa_indexer.py, through a layout shim) and attends over each token's window and
chosen (CSA) or closed (HCA) rows, gathered by slot from the pages, with the sink, in kernels/v4_sparse_attention.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.config_v4 import CSA, SLIDING, CachePools, V4Config, v4_cache_groups
from deepinfer_jax.models.cache import StepMetadata
from deepinfer_jax.models.deepseek import holds_host
from deepinfer_jax.models.deepseek_v4 import hc_merge, hc_mix, hyper_head, v4_forward, v4_moe
from deepinfer_jax.models.layers import linear, rms_norm
from deepinfer_jax.models.v4_attention import (attend, attend_output, attention_inputs, closed_rows, indexer_queries,
                                               indexer_scores, queries, rope_tail, v4_cos_sin)
from deepinfer_jax.models.v4_parallel import splits_heads, v4_heads_sharded
from deepinfer_jax.models.v4_params import v4_param_specs

ATTN_IMPLS = ("reference", "pallas", "pallas_interpret")
TOKEN_BLOCK = 128  # queries attended a block at a time (`_layer_attention`)


def kv_cache_shape(cfg: ModelConfig, num_pages: Any, page_size: int) -> tuple:
    """A CachePools -> one (pool pages, page elements) per pool. An int (sizing, registry.kv_cache_bytes_per_page):
    (num_pages, the elements one page of page_size tokens of context costs in the compressed groups, rounded up)."""
    groups = v4_cache_groups(cfg.v4, 1)  # row_bytes at one byte an element: row widths
    if isinstance(num_pages, CachePools):
        elems = [0] * len(num_pages.pool_pages)
        for g, k in zip(groups, num_pages.pool_of):
            elems[k] = max(elems[k], len(g.layers) * g.rows_per_page(page_size) * g.row_bytes)
        return tuple((n, e) for n, e in zip(num_pages.pool_pages, elems))
    per_page = sum(len(g.layers) * page_size * g.row_bytes / g.tokens_per_row for g in groups if not g.window_tokens)
    return (num_pages, max(1, math.ceil(per_page)))  # a model of sliding layers only grows nothing: one element


def param_specs(cfg: ModelConfig) -> Any:
    """The params' specs; MTP layers as ModelConfig.num_nextn_predict_layers says (those the checkpoint holds)."""
    return v4_param_specs(dataclasses.replace(cfg.v4, num_nextn_predict_layers=cfg.num_nextn_predict_layers))


def forward(params: Any, cfg: ModelConfig, token_ids: jax.Array, *,
            attention_mask: jax.Array | None = None) -> jax.Array:
    """token_ids [B, S] -> logits [B, S, V] (fp32), each row from position 0, no cache (`v4_forward`). With right
    padding (attention_mask), a padded slot changes no earlier position (attention is causal)."""
    del attention_mask
    return jax.vmap(lambda t: v4_forward(cfg.v4, params, t))(token_ids)


class GroupCache:
    """The step's view of the per-pool arrays: read and write one group's rows of one layer. Group g's page holds
    `rows[g]` rows (`CacheGroup.rows_per_page`: the state groups' own page size). A windowed group's page table is
    a ring (runner/inputs.py group_tables): page i of a sequence at column i % its width, which holds every page a
    step can read (a window and a chunk); a compressed group's holds page i at column i."""

    def __init__(self, cfg: V4Config, arrays: tuple, page_size: int):
        self.groups = v4_cache_groups(cfg, 1)
        self.index = {g.name: gi for gi, g in enumerate(self.groups)}
        self.arrays, self.ps = list(arrays), page_size
        self.rows = tuple(g.rows_per_page(page_size) for g in self.groups)
        self.pool_of = (0,) * len(self.groups) if len(arrays) == 1 else tuple(range(len(self.groups)))

    def layer(self, name: str, i: int) -> tuple[int, int]:
        """(group index, the layer's index within the group) of global layer i."""
        gi = self.index[name]
        return gi, self.groups[gi].layers.index(i)

    def view(self, gi: int) -> jax.Array:
        """[pages, layers, rows a page, width] of group gi."""
        g, a = self.groups[gi], self.arrays[self.pool_of[gi]]
        return a.reshape(a.shape[0], len(g.layers), self.rows[gi], g.row_bytes)

    def write(self, gi: int, layer: int, slots: jax.Array, rows: jax.Array) -> None:
        """Rows [T, width] at flat slots [T] (page * rows a page + offset) of one layer of group gi."""
        k, a, r = self.pool_of[gi], self.arrays[self.pool_of[gi]], self.rows[gi]
        v = self.view(gi).at[slots // r, layer, slots % r].set(rows.astype(a.dtype))
        self.arrays[k] = v.reshape(a.shape)

    def pages(self, gi: int, table: jax.Array, seq_ids: jax.Array, pos: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(page ids, offsets in them) [T, n] of row indices pos [T, n]: a windowed group's ring column (pos // rows)
        % width; a compressed group's column pos // rows, an index past the table clamped (callers mask it)."""
        r = self.rows[gi]
        if self.groups[gi].window_tokens is not None:
            pos = jnp.maximum(pos, 0)
            return table[seq_ids[:, None], (pos // r) % table.shape[1]], pos % r
        pos = jnp.clip(pos, 0, table.shape[1] * r - 1)
        return table[seq_ids[:, None], pos // r], pos % r

    def rows_at(self, gi: int, layer: int, table: jax.Array, seq_ids: jax.Array, pos: jax.Array,
                cols: slice = slice(None)) -> jax.Array:
        """The rows [T, n, width] (their columns `cols`) at row indices pos [T, n] of each token's sequence (seq_ids
        [T]), gathered from the pages (`pages`: a position outside what the table holds reads some row, masked)."""
        pages, off = self.pages(gi, table, seq_ids, pos)
        return self.view(gi)[pages, layer, off, cols]

    def flat(self, gi: int) -> jax.Array:
        """Group gi's pool as rows [pages * layers * page_size, width] (a free reshape), for `slots`."""
        v = self.view(gi)
        return v.reshape(-1, v.shape[-1])

    def slots(self, gi: int, layer: int, table: jax.Array, seq_ids: jax.Array, pos: jax.Array) -> jax.Array:
        """`rows_at`'s rows as indices [T, n] into `flat(gi)`."""
        pages, off = self.pages(gi, table, seq_ids, pos)
        return (pages * len(self.groups[gi].layers) + layer) * self.rows[gi] + off


def _pool_closing(cfg: V4Config, p: dict, kv: jax.Array, gate: jax.Array, valid: jax.Array, width: int,
                  rate: int, overlap: bool, start: jax.Array) -> jax.Array:
    """The compressed row each token would close: `pool_rows`' arithmetic over one window per token. kv, gate
    [T, n, c*width] are the projections at positions pos + 1 - n .. pos (n = 2 * rate with `overlap`, CSA: the
    previous window's series a, then this window's series b; else rate), `valid` [T, n] marks positions >= 0;
    start [T] the window's first position (its rope). -> [T, width]."""
    n = kv.shape[1]
    g = gate.astype(jnp.float32) + jnp.tile(p["position_bias"].astype(jnp.float32), (n // rate, 1))
    if overlap:
        kv = jnp.concatenate([kv[:, :rate, :width], kv[:, rate:, width:]], axis=1)  # [T, 2m, width]
        g = jnp.concatenate([g[:, :rate, :width], g[:, rate:, width:]], axis=1)
    # a position before 0 gets no weight (finite, so a row of no valid position pools to 0, never NaN)
    g = jnp.where(valid[..., None], g, jnp.finfo(jnp.float32).min)
    kv = jnp.where(valid[..., None], kv, 0)
    w = jax.nn.softmax(g, axis=1).astype(kv.dtype)
    pooled = rms_norm(jnp.sum(kv * w, axis=1), p["kv_norm"], cfg.rms_norm_eps)
    cos, sin = v4_cos_sin(cfg, "compress", start)
    return rope_tail(pooled, cos, sin)


def _csa_pallas_topk(cfg: V4Config, p: dict, x: jax.Array, q_res: jax.Array, cache: GroupCache, ci: int, cl: int,
                     table: jax.Array, meta: StepMetadata, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """The indexer's top-k of one CSA layer through V3.2's paged-scores kernel (kernels/dsa_indexer.py) -> (idx,
    valid [T, k]) row indices. Layout shim: the csa group's view [pages, layers, ps, hd + di] is the kernel's
    [1, pages * layers, ps, width] cache with page p of layer l at p * layers + l; a row is visible to a query once
    its window closed, row <= (pos + 1) // m - 1, the kernel's "key position <= position"."""
    from deepinfer_jax.kernels import dsa_indexer

    view = cache.view(ci)  # [P, Lg, ps, W]
    P, Lg, ps, W = view.shape
    q, w = indexer_queries(cfg, p, x, q_res, meta.positions)
    last = (meta.positions + 1) // cfg.compress_rate(CSA) - 1  # [T] the last closed row (-1: none)
    scores = dsa_indexer.paged_index_scores(
        q.astype(view.dtype), w * cfg.index_head_dim**-0.5, view.reshape(1, P * Lg, ps, W), 0, meta.seq_ids,
        last, table * Lg + cl, key_start=cfg.head_dim, interpret=interpret)  # [T, R]
    return dsa_indexer.select_topk(scores, last, cfg.index_topk)


def _blocks(fn, args: tuple, T: int, block: int):
    """fn over args (arrays [T, ...]) `block` tokens at a time (lax.map; the last block padded with zeros: token 0
    of sequence 0, results dropped) -> fn's [T, ...] result. One call when T <= block."""
    if T <= block:
        return fn(args)
    nb = -(-T // block)
    def split(a):  # [T, ...] -> [nb, block, ...]
        return jnp.pad(a, [(0, nb * block - T)] + [(0, 0)] * (a.ndim - 1)).reshape(nb, block, *a.shape[1:])

    out = jax.lax.map(fn, tuple(split(a) for a in args))
    return out.reshape(nb * block, *out.shape[2:])[:T]


def _layer_attention(cfg: V4Config, i: int, p: dict, x: jax.Array, cache: GroupCache, meta: StepMetadata,
                     attn_impl: str = "reference", token_block: int = TOKEN_BLOCK, mesh_rules: Any = None) -> jax.Array:
    """Layer i's attention for the step's tokens x [T, D] -> [T, D], its rows written into `cache`.

    The step's rows are written first; then its queries attend `token_block` at a time, each gathering only
    what it sees: its window's raw rows [W], CSA: the indexer's top-k compressed rows (scores over the
    sequence's index keys, [R]), HCA: its sequence's compressed rows [context / m']. Temporaries are
    O(block x (W + topk + context / m + context / m')) and never O(T x context) (the indexer's key rows are the
    `context / m` term). "pallas": the indexer's scores [T, context / m] from the pages in a kernel, then one
    kernel over the rows' slots [T, W + topk or context / m'], nothing gathered in XLA.

    `mesh_rules` splitting the query heads (sharding/rules.py v4_rules): the rows, the compressors and the indexer
    are computed whole on every device (V4's one K = V head serves every query head, as in MQA); each device
    computes its heads' queries, attends with them and applies its output groups; the partial outputs are summed
    over the tensor axis once (models/v4_parallel.py v4_heads_sharded)."""
    lt, hd = cfg.attn_type(i), cfg.head_dim
    pos, seq = meta.positions, meta.seq_ids
    q_res, new, cos, sin = attention_inputs(cfg, lt, p, x, pos)  # the queries: `heads`, from q_res

    gi, li = cache.layer("sliding", i)
    table, slots = meta.groups[gi]
    cache.write(gi, li, slots, new["raw"])
    W = cfg.sliding_window
    csa, ci, c_table, pick = lt == CSA, None, None, ()
    if lt != SLIDING:
        rate = cfg.compress_rate(lt)
        name = "csa" if csa else "hca"
        si, sl = cache.layer(name + "_state", i)
        s_table, s_slots = meta.groups[si]
        fields = ("kv", "gate", "idx_kv", "idx_gate") if csa else ("kv", "gate")
        cache.write(si, sl, s_slots, jnp.concatenate([new[f] for f in fields], axis=-1))
        n = 2 * rate if csa else rate
        at = pos[:, None] + 1 - n + jnp.arange(n)[None, :]  # [T, n]
        state = cache.rows_at(si, sl, s_table, seq, at)  # [T, n, state width]
        c = 2 if csa else 1
        kv, gate = state[..., : c * hd], state[..., c * hd : 2 * c * hd]
        start = pos + 1 - rate
        row = _pool_closing(cfg, p["compressor"], kv, gate, at >= 0, hd, rate, csa, start)
        if csa:
            di = cfg.index_head_dim
            ikv, igate = state[..., 4 * hd : 4 * hd + 2 * di], state[..., 4 * hd + 2 * di :]
            key = _pool_closing(cfg, p["indexer"], ikv, igate, at >= 0, di, rate, True, start)
            row = jnp.concatenate([row, key], axis=-1)
        ci, cl = cache.layer(name, i)
        c_table, c_slots = meta.groups[ci]
        cache.write(ci, cl, c_slots, row)  # only a token closing its window has a slot off the null page
        R = c_table.shape[1] * cache.rows[ci]  # row indices of a sequence's compressed history
        if csa and attn_impl != "reference":
            pick = _csa_pallas_topk(cfg, p["indexer"], x, q_res, cache, ci, cl, c_table, meta,
                                    attn_impl == "pallas_interpret")

    if attn_impl != "reference":
        from deepinfer_jax.kernels.v4_sparse_attention import pad_slots, v4_sparse_attention

        win = pos[:, None] - W + 1 + jnp.arange(W)[None, :]
        a = pad_slots(cache.slots(gi, li, table, seq, win), win >= 0)
        if lt == SLIDING:  # one block of no row
            bi, b = gi, pad_slots(jnp.zeros((x.shape[0], 1), jnp.int32), jnp.zeros((x.shape[0], 1), bool))
        elif csa:
            bi, b = ci, pad_slots(cache.slots(ci, cl, c_table, seq, pick[0]), pick[1])
        else:
            every = jnp.broadcast_to(jnp.arange(R), (x.shape[0], R))
            bi, b = ci, pad_slots(cache.slots(ci, cl, c_table, seq, every), closed_rows(pos, R, rate))

    # What the heads read besides their own weights, the same on every device (passed to shard_map whole).
    rep = dict(cache=tuple(cache.arrays), table=table, c_table=c_table, x=x, q_res=q_res, pos=pos, seq=seq, cos=cos,
               sin=sin, pick=tuple(pick), indexer=p.get("indexer"))
    if attn_impl != "reference":
        rep.update(a=a, b=b)

    def heads(ph: dict, r: dict) -> jax.Array:
        """The query heads' part: their queries [T, H', hd] through ph's q_b_proj, over the rows each token sees,
        then the output projection with ph's sinks [H'], o_a_proj, o_b_proj -> [T, D] (under v4_heads_sharded:
        this device's heads, its partial sum)."""
        q = queries(cfg, ph["q_b_proj"], r["q_res"], r["cos"], r["sin"], x.dtype)
        c = GroupCache(cfg, r["cache"], cache.ps)
        if attn_impl != "reference":
            rows_a, rows_b = c.flat(gi), c.flat(bi)
            out = v4_sparse_attention(q.astype(rows_a.dtype), rows_a, *r["a"], rows_b, *r["b"], ph["sinks"],
                                      hd**-0.5, interpret=attn_impl == "pallas_interpret")
            return attend_output(cfg, ph, out.astype(x.dtype), r["cos"], r["sin"], x.dtype)

        def block(args):
            xb, qb, rb, pb, sb, cb, nb = args[:7]
            win = pb[:, None] - W + 1 + jnp.arange(W)[None, :]  # [B, W] the window's positions
            keys, allowed = c.rows_at(gi, li, r["table"], sb, win), win >= 0
            if lt != SLIDING:
                ct = r["c_table"]
                if csa:
                    if pick:
                        idx, valid = args[7:]
                    else:  # the indexer over the block's sequences' index keys [B, R, di]
                        every = jnp.broadcast_to(jnp.arange(R), (pb.shape[0], R))
                        ik = c.rows_at(ci, cl, ct, sb, every, slice(hd, None))  # [B, R, di]
                        scores = jax.vmap(lambda k, xt, qt, pt: indexer_scores(cfg, r["indexer"], k, xt[None],
                                                                               qt[None], pt[None])[0])(ik, xb, rb, pb)
                        _, idx = jax.lax.top_k(scores, min(cfg.index_topk, R))  # [B, k]
                        valid = jnp.take_along_axis(closed_rows(pb, R, rate), idx, axis=1)
                    rows, see = c.rows_at(ci, cl, ct, sb, idx, slice(0, hd)), valid
                else:
                    rows = c.rows_at(ci, cl, ct, sb, jnp.broadcast_to(jnp.arange(R), (pb.shape[0], R)))
                    see = closed_rows(pb, R, rate)
                keys = jnp.concatenate([keys, rows.astype(keys.dtype)], axis=1)
                allowed = jnp.concatenate([allowed, see], axis=1)
            return attend(cfg, ph, qb, keys, allowed, cb, nb, x.dtype)

        args = (r["x"], q, r["q_res"], r["pos"], r["seq"], r["cos"], r["sin"]) + r["pick"]
        return _blocks(block, args, x.shape[0], token_block)

    if splits_heads(mesh_rules):
        return v4_heads_sharded(mesh_rules, heads, p, rep, check_vma=attn_impl == "reference")
    return heads(p, rep)


def paged_block(v4: V4Config, i: int, lp: dict, streams: jax.Array, cache: GroupCache, meta: StepMetadata,
                attn_impl: str, moe_impl: str, mesh_rules: Any = None) -> jax.Array:
    """Layer i (a main layer, or an MTP layer's block at i = num_hidden_layers + j) over the step's streams
    [T, n, D] -> [T, n, D], its rows written into `cache`. `mesh_rules`: the routed experts split over the mesh
    (`check_layout`)."""
    post, comb, collapsed = hc_mix(v4, lp["attn_hc"], streams)
    a = _layer_attention(v4, i, lp["attn"], rms_norm(collapsed, lp["input_layernorm"], v4.rms_norm_eps), cache,
                         meta, attn_impl, TOKEN_BLOCK, mesh_rules)
    streams = hc_merge(post, comb, a, streams)
    post, comb, collapsed = hc_mix(v4, lp["ffn_hc"], streams)
    m = v4_moe(v4, i, lp["moe"], rms_norm(collapsed, lp["post_attention_layernorm"], v4.rms_norm_eps),
               meta.token_ids, impl=moe_impl, mesh_rules=mesh_rules)
    return hc_merge(post, comb, m, streams)


def check_layout(mesh_rules: Any) -> None:
    """V4's parallel layout: the routed experts (or their intermediate dim) over the mesh, the attention's query heads
    and output groups over one axis (both or neither), the shared expert's intermediate dim over the tensor axis (or
    not), everything else replicated, every device running the step's rows, compressors and indexer on its own copy
    of the per-group pools. A rule splitting anything else is refused (per-rank pools are not built)."""
    if mesh_rules is None:
        return
    split = [a for a in ("tokens", "seqs", "pages", "vocab", "embed") if mesh_rules.size(a) > 1]
    if split:
        raise ValueError(f"deepseek_v4 splits only its experts and attention heads over the mesh; these rules "
                         f"also split {split} (sharding/rules.py v4_rules is its layout)")
    if mesh_rules.mesh_axes("heads") != mesh_rules.mesh_axes("o_groups"):
        raise ValueError("deepseek_v4 splits its query heads and output groups over the same mesh axes (rules "
                         f"'heads' {mesh_rules.mesh_axes('heads')}, 'o_groups' {mesh_rules.mesh_axes('o_groups')})")


def step_cache(cfg: ModelConfig, kv_cache: tuple, meta: StepMetadata) -> GroupCache:
    """The step's view of the pools (page size from the sliding pool: [cache layers, page_size, head_dim] a page)."""
    v4 = cfg.v4
    if meta.groups is None:
        raise ValueError("deepseek_v4's paged forward needs the step's per-group page tables (StepMetadata.groups)")
    page_size = kv_cache[0].shape[1] // (v4.cache_layers * v4.head_dim)
    return GroupCache(v4, tuple(kv_cache), page_size)


def _streamed_block(v4: V4Config, i: int, lp: dict, streams: jax.Array, cache: GroupCache, meta: StepMetadata,
                    attn_impl: str, moe_impl: str, mesh_rules: Any, layer_fetch: Callable) -> jax.Array:
    """`paged_block` of a layer with weights in host memory (--cpu-offload-gb): its weights copied in by
    `layer_fetch` inside a call of their own, so the copies belong to the layer (weight_offload.copy_in_bytes counts
    one layer's at a time) and each is read only by it; `cache`'s arrays go through the call and come back."""

    def block(lp, streams, arrays, meta):
        c = GroupCache(v4, arrays, cache.ps)
        out = paged_block(v4, i, layer_fetch(lp), streams, c, meta, attn_impl, moe_impl, mesh_rules)
        return out, tuple(c.arrays)

    streams, arrays = jax.jit(block)(lp, streams, tuple(cache.arrays), meta)
    cache.arrays = list(arrays)
    return streams


def forward_paged(params: Any, cfg: ModelConfig, kv_cache: tuple, meta: StepMetadata, *,
                  moe_impl: str = "ragged", attn_impl: str = "reference", return_routing: bool = False,
                  unroll: Any = 1, mesh_rules: Any = None, return_hidden: bool = False,
                  layer_fetch: Callable | None = None):
    """-> (logits [S, V] fp32, updated kv_cache: one array per pool) for one ragged step; prefill, chunked prefill
    and decode alike. `return_hidden`: also every slot's last streams [T, n, D] before the hyper head (the MTP
    layer's input, models/v4_mtp.py), as the last output.
    `moe_impl` "pallas" / "pallas_interpret" runs FP4 / FP8 routed experts through the quantized grouped GEMMs;
    other experts run as routed copies in XLA's grouped GEMM, or every expert densely with "dense" (`v4_moe`). `unroll` does not
    apply (V4's layers differ in kind and run as a Python loop). `mesh_rules`: the routed experts over the mesh
    (`check_layout`; models/v4_parallel.py). `layer_fetch`: where a layer's weights live in host memory
    (--cpu-offload-gb, runner/weight_offload.py `stream`), the function that copies them to the device, applied to
    one layer at a time (`_streamed_block`); the other params arrive on the device."""
    del unroll
    if attn_impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl {attn_impl!r} is not available for deepseek_v4; expected one of {ATTN_IMPLS}")
    check_layout(mesh_rules)
    v4 = cfg.v4
    cache = step_cache(cfg, kv_cache, meta)
    x = params["embed"][meta.token_ids]  # [T, D]
    streams = jnp.broadcast_to(x[:, None, :], (x.shape[0], v4.hc_mult, x.shape[-1]))
    for i, lp in enumerate(params["layers"]):
        if layer_fetch is not None and holds_host(lp):
            streams = _streamed_block(v4, i, lp, streams, cache, meta, attn_impl, moe_impl, mesh_rules, layer_fetch)
        else:
            # The layer's weights pass a barrier with the previous layer's streams, so what XLA derives from them
            # (dequantized copies on the XLA paths) is made in turn, one layer's at a time, not all up front.
            lp, streams = jax.lax.optimization_barrier((lp, streams))
            streams = paged_block(v4, i, lp, streams, cache, meta, attn_impl, moe_impl, mesh_rules)
    h = hyper_head(v4, params["hc_head"], streams[meta.logits_indices])
    logits = linear(rms_norm(h, params["final_norm"], v4.rms_norm_eps), params["lm_head"]).astype(jnp.float32)
    out = (logits, tuple(cache.arrays))
    if return_routing:
        out += (jnp.zeros((0, x.shape[0], 0), jnp.int32),)
    return out + (streams,) if return_hidden else out
