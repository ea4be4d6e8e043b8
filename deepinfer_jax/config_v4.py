"""DeepSeek-V4 model configuration (V4-Flash, V4-Pro): `model_type` `deepseek_v4`. No JAX.

`V4Config.from_hf_dict` reads every field of HF transformers' `DeepseekV4Config`, including the legacy
names DeepSeek's own config.json ships (`compress_ratios` per layer, `compress_rate_csa` /
`compress_rate_hca`, `num_hash_layers`, `qk_rope_head_dim`, a flat YaRN `rope_scaling`), and resolves
them the way HF's `__post_init__` does, so a checkpoint saved by either reads the same.

V4's layer kinds:
  attention (`layer_types`): "sliding_attention" (raw K=V rows of the last `sliding_window` tokens),
    "compressed_sparse_attention" (CSA: plus one pooled row per `compress_rates[CSA]` tokens over
    overlapping windows, of which the lightning indexer picks `index_topk` per query),
    "heavily_compressed_attention" (HCA: plus one pooled row per `compress_rates[HCA]` tokens, all seen).
  mlp (`mlp_layer_types`): "hash_moe" (experts from a static token id -> expert table) or "moe"
    (scored top-k with a correction bias).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from deepinfer_jax.config_common import ConfigError, RopeScaling

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")  # HF documents softmax too, but its activation table has none
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # DeepSeek's legacy per-layer `compress_ratios`


@dataclass(frozen=True)
class V4Config:
    """Static V4 hyper-parameters; hashable so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # the single shared K = V head and every query head
    q_lora_rank: int
    qk_rope_head_dim: int  # trailing rotary slice of each head: int(head_dim * partial_rotary_factor)
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    rope_theta: float  # sliding layers ("main" rope)
    compress_rope_theta: float  # CSA / HCA layers, their compressors and the indexer ("compress" rope)
    compress_rope_scaling: RopeScaling | None  # YaRN on the compress rope only; attention factor 1.0
    layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]  # ((CSA, m), (HCA, m')) as a hashable dict
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    # the MTP layers' attention kinds: DeepSeek's `compress_ratios` lists them after the main layers (the
    # reference builds MTP layer j as layer num_hidden_layers + j); sliding where the config does not say
    mtp_layer_types: tuple[str, ...] = ()
    mtp_in_cache: int = 0  # MTP layers whose rows the paged cache holds (deepseek_mtp speculation)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    model_type: str = "deepseek_v4"

    # ---- derived -----------------------------------------------------------------------------
    def compress_rate(self, layer_type: str) -> int:
        """Source tokens per compressed row of `layer_type`; 0 for sliding layers."""
        return dict(self.compress_rates).get(layer_type, 0)

    def attn_type(self, i: int) -> str:
        """The attention kind of layer i: a main layer's `layer_types`, or MTP layer i - num_hidden_layers'."""
        n = self.num_hidden_layers
        return self.layer_types[i] if i < n else (self.mtp_layer_types[i - n:i - n + 1] or (SLIDING,))[0]

    def mlp_type(self, i: int) -> str:
        """The MLP kind of layer i; an MTP layer's is scored "moe" (the reference hashes only layers below
        n_hash_layers, and the MTP layer's index is num_hidden_layers + j)."""
        return self.mlp_layer_types[i] if i < self.num_hidden_layers else "moe"

    @property
    def cache_layers(self) -> int:
        """Layers whose rows the paged cache holds: the main ones and, with MTP speculation, the MTP layers."""
        return self.num_hidden_layers + self.mtp_in_cache

    @property
    def partial_rotary_factor(self) -> float:
        return self.qk_rope_head_dim / self.head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "V4Config":
        if d.get("model_type") != "deepseek_v4":
            raise ConfigError(f"V4Config reads model_type 'deepseek_v4', not {d.get('model_type')!r}")

        def get(key: str, default: Any) -> Any:
            v = d.get(key)
            return default if v is None else v

        n = int(get("num_hidden_layers", 43))
        head_dim = int(get("head_dim", 512))
        rates = dict(get("compress_rates", {CSA: 4, HCA: 128}))
        if d.get("compress_rate_csa") is not None:
            rates[CSA] = int(d["compress_rate_csa"])
        if d.get("compress_rate_hca") is not None:
            rates[HCA] = int(d["compress_rate_hca"])
        if set(rates) != {CSA, HCA} or min(rates.values()) < 1:
            raise ConfigError(f"compress_rates must give a positive rate for {CSA} and {HCA}; got {rates}")

        layer_types = d.get("layer_types")
        if layer_types is None and d.get("compress_ratios") is not None:
            bad = [r for r in d["compress_ratios"] if r not in _RATIO_TO_TYPE]
            if bad:
                raise ConfigError(f"compress_ratios entries must be one of {sorted(_RATIO_TO_TYPE)}; got {bad}")
            layer_types = [_RATIO_TO_TYPE[r] for r in d["compress_ratios"]]
        if layer_types is None:  # HF's default: 2 HCA, then HCA / CSA interleaved
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(get("num_hash_layers", 3))
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        n_mtp = int(get("num_nextn_predict_layers", 1))
        mtp_types = tuple((list(layer_types[n:]) + [SLIDING] * n_mtp)[:n_mtp])  # compress_ratios' entries past n
        layer_types, mlp_types = tuple(layer_types[:n]), tuple(mlp_types[:n])
        for name, types, allowed in (("layer_types", layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", mlp_types, MLP_LAYER_TYPES)):
            if len(types) != n:
                raise ConfigError(f"{name} has {len(types)} entries for num_hidden_layers {n}")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ConfigError(f"{name} entries must be one of {allowed}; got {bad}")

        prf = d.get("partial_rotary_factor")
        if prf is None:
            prf = d["qk_rope_head_dim"] / head_dim if d.get("qk_rope_head_dim") else 64 / 512
        rope_dim = int(head_dim * prf)
        if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
            raise ConfigError(f"partial_rotary_factor {prf} gives a rotary slice of {rope_dim} (needs even, 2..head_dim)")
        index_head_dim = int(get("index_head_dim", 128))
        if rope_dim > index_head_dim:
            raise ConfigError(f"index_head_dim {index_head_dim} is smaller than the rotary slice {rope_dim}")

        heads, groups = int(get("num_attention_heads", 64)), int(get("o_groups", 8))
        if (heads * head_dim) % groups:
            raise ConfigError(f"o_groups {groups} does not divide num_attention_heads * head_dim ({heads * head_dim})")
        scoring = get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func {scoring!r} is not one of {SCORING_FUNCS}")
        if int(get("num_key_value_heads", 1)) != 1:
            raise ConfigError(f"DeepSeek-V4 has one shared K = V head; num_key_value_heads is {d['num_key_value_heads']}")
        if int(get("n_shared_experts", 1)) != 1:
            raise ConfigError(f"n_shared_experts {d['n_shared_experts']}: V4's shared expert is one MLP of moe_intermediate_size")

        eos = d.get("eos_token_id", 1)
        return cls(
            vocab_size=int(get("vocab_size", 129280)),
            hidden_size=int(get("hidden_size", 4096)),
            moe_intermediate_size=int(get("moe_intermediate_size", 2048)),
            num_hidden_layers=n,
            num_attention_heads=heads,
            head_dim=head_dim,
            q_lora_rank=int(get("q_lora_rank", 1024)),
            qk_rope_head_dim=rope_dim,
            num_experts_per_tok=int(get("num_experts_per_tok", 6)),
            n_routed_experts=int(get("n_routed_experts", 256)),
            n_shared_experts=1,
            scoring_func=scoring,
            routed_scaling_factor=float(get("routed_scaling_factor", 1.5)),
            max_position_embeddings=int(get("max_position_embeddings", 1048576)),
            rope_theta=float(_nested(d, "main").get("rope_theta") or get("rope_theta", 10000.0)),
            compress_rope_theta=float(_nested(d, "compress").get("rope_theta") or get("compress_rope_theta", 160000.0)),
            compress_rope_scaling=_compress_yarn(d),
            layer_types=layer_types,
            compress_rates=((CSA, rates[CSA]), (HCA, rates[HCA])),
            hc_mult=int(get("hc_mult", 4)),
            hc_sinkhorn_iters=int(get("hc_sinkhorn_iters", 20)),
            hc_eps=float(get("hc_eps", 1e-6)),
            mlp_layer_types=mlp_types,
            swiglu_limit=float(get("swiglu_limit", 10.0)),
            sliding_window=int(get("sliding_window", 128)),
            o_groups=groups,
            o_lora_rank=int(get("o_lora_rank", 1024)),
            index_n_heads=int(get("index_n_heads", 64)),
            index_head_dim=index_head_dim,
            index_topk=int(get("index_topk", 512)),
            num_nextn_predict_layers=n_mtp,
            mtp_layer_types=mtp_types,
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "V4Config":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{model_dir} has no config.json")
        with open(path) as f:
            return cls.from_hf_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nested(d: dict[str, Any], label: str) -> dict[str, Any]:
    """HF's rope-type-keyed `rope_parameters[label]` ("main" / "compress"), {} when the dict is flat."""
    rp = d.get("rope_parameters") or {}
    return rp[label] if isinstance(rp.get(label), dict) else {}


def _compress_yarn(d: dict[str, Any]) -> RopeScaling | None:
    """YaRN of the compress rope: HF's nested `rope_parameters["compress"]`, else the flat
    `rope_parameters` / `rope_scaling` DeepSeek ships (which HF applies to the compress rope only)."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if isinstance(rp.get("compress"), dict):
        rp = rp["compress"]
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "yarn":
        raise ConfigError(f"DeepSeek-V4's compress rope type {rope_type!r} is not supported (default or yarn)")
    if rp.get("attention_factor", 1.0) != 1.0:
        raise ConfigError(f"compress rope attention_factor {rp['attention_factor']} (V4 uses 1.0)")
    return RopeScaling(
        factor=float(rp["factor"]),
        original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
        beta_fast=float(rp.get("beta_fast") or 32.0),
        beta_slow=float(rp.get("beta_slow") or 1.0),
    )


# ---- cache footprint ------------------------------------------------------------------------------


def v4_cache_bytes_per_token(cfg: V4Config, dtype_bytes: int = 2) -> dict[str, float]:
    """Device bytes per token of context of each cache group, summed over the layers, at long context.

    "sliding": the ring of raw K = V rows ([sliding_window, head_dim] per layer, every layer has one);
    it does not grow with the context, so per token it is 0 here (its fixed size is in
    `v4_cache_fixed_bytes`). "csa_rows" / "hca_rows": one compressed head_dim row per compress_rate
    tokens. "indexer_keys": one index_head_dim key per CSA compress_rate tokens. "total": their sum.
    """
    csa_layers = sum(t == CSA for t in cfg.layer_types)
    hca_layers = sum(t == HCA for t in cfg.layer_types)
    m_csa, m_hca = cfg.compress_rate(CSA), cfg.compress_rate(HCA)
    out = {
        "sliding": 0.0,
        "csa_rows": csa_layers * cfg.head_dim * dtype_bytes / m_csa,
        "hca_rows": hca_layers * cfg.head_dim * dtype_bytes / m_hca,
        "indexer_keys": csa_layers * cfg.index_head_dim * dtype_bytes / m_csa,
    }
    out["total"] = sum(out.values())
    return out


def v4_cache_fixed_bytes(cfg: V4Config, dtype_bytes: int = 2) -> int:
    """Bytes per sequence that do not grow with its length: the windowed groups of `v4_cache_groups`
    (every layer's ring of raw rows, and the compressors' projections of the still-open windows), each
    at its window's size."""
    return sum(g.window_tokens * g.row_bytes * len(g.layers) for g in v4_cache_groups(cfg, dtype_bytes)
               if g.window_tokens)


@dataclass(frozen=True)
class CacheGroup:
    """One group of the hybrid cache: layers that store rows of one width at one rate, paged alike.

    A row is written per `tokens_per_row` tokens (1: per token; m: when a compression window closes).
    `window_tokens` (None: keep everything) bounds what a next query can need: only rows of the last
    `window_tokens` tokens, so pages wholly before them may go back to the pool. `page_rows` (0: the cache's
    page_size): the rows a page of this group holds, a page size of its own for a group whose window is far below
    a page (the compressors' state, `page_rows_of`)."""

    name: str
    layers: tuple[int, ...]
    row_bytes: int  # one row of one layer
    tokens_per_row: int = 1
    window_tokens: int | None = None
    page_rows: int = 0

    def rows_per_page(self, page_size: int) -> int:
        """Rows of one page of this group in a cache of `page_size`: page_rows where it divides page_size (so a
        prefix hit, a multiple of page_size tokens, ends on this group's page boundary), else page_size."""
        return self.page_rows if self.page_rows and page_size % self.page_rows == 0 else page_size

    def rows(self, num_tokens: int) -> int:
        """Rows written once `num_tokens` tokens have been computed (compressed: closed windows only)."""
        return num_tokens // self.tokens_per_row

    def pages(self, num_tokens: int, page_size: int) -> int:
        """Page slots (per layer) covering every row of `num_tokens` tokens: a compressed group
        needs one page per page_size * tokens_per_row tokens."""
        return -(-self.rows(num_tokens) // self.rows_per_page(page_size))

    def first_live_page(self, num_computed: int, page_size: int) -> int:
        """The first page the next token still reads; pages before it can be freed (0: none)."""
        if self.window_tokens is None:
            return 0
        return max(0, num_computed - self.window_tokens + 1) // self.rows_per_page(page_size)

    def live_pages(self, num_tokens: int, page_size: int) -> int:
        """Pages that must stay allocated after `num_tokens` tokens (what the scheduler holds)."""
        return self.pages(num_tokens, page_size) - self.first_live_page(num_tokens, page_size)


def v4_cache_groups(cfg: V4Config, dtype_bytes: int = 2) -> tuple[CacheGroup, ...]:
    """The cache groups of a V4 model, as vLLM's hybrid KV cache manager would page them.

    "sliding": every layer's raw K = V row per token, window sliding_window.
    "csa": per CSA layer, one compressed row (head_dim) and its indexer key (index_head_dim) per m tokens.
    "hca": per HCA layer, one compressed row (head_dim) per m' tokens.
    "csa_state" / "hca_state": the compressors' per-token projections (kv and gate; the compressor's
    2 * head_dim and the indexer's 2 * index_head_dim for CSA, head_dim for HCA) of the last 2m (CSA:
    a row pools two windows) or m' (HCA) tokens: what a chunk or a decode step that closes a window
    needs from tokens computed before it. A chunk that ends mid-window leaves them here.
    """
    hd, di = cfg.head_dim, cfg.index_head_dim
    csa = tuple(i for i in range(cfg.cache_layers) if cfg.attn_type(i) == CSA)
    hca = tuple(i for i in range(cfg.cache_layers) if cfg.attn_type(i) == HCA)
    m, mh = cfg.compress_rate(CSA), cfg.compress_rate(HCA)
    groups = [CacheGroup("sliding", tuple(range(cfg.cache_layers)), hd * dtype_bytes, 1, cfg.sliding_window)]
    if csa:
        groups += [CacheGroup("csa", csa, (hd + di) * dtype_bytes, m),
                   CacheGroup("csa_state", csa, 2 * 2 * (hd + di) * dtype_bytes, 1, 2 * m, page_rows_of(2 * m))]
    if hca:
        groups += [CacheGroup("hca", hca, hd * dtype_bytes, mh),
                   CacheGroup("hca_state", hca, 2 * hd * dtype_bytes, 1, mh, page_rows_of(mh))]
    return tuple(groups)


def page_rows_of(window: int) -> int:
    """A state group's own page size: the largest power of two below its window of `window` tokens, so a sequence
    holds at most cdiv(window - 1, rows) + 2 pages of it, 2 to 3 windows of rows (at V4's CSA window of 8 tokens: 4
    pages of 4 rows, where pages of 64 tokens held 192 rows). Used where it divides the cache's page_size
    (`CacheGroup.rows_per_page`)."""
    return 1 << max(0, (window - 1).bit_length() - 1)


def with_mtp_cache(cfg: Any) -> Any:
    """A deepseek_v4 ModelConfig whose cache holds its first MTP layer's rows too (`deepseek_mtp` speculation, which
    drafts with MTP layer 0 alone): layer num_hidden_layers of every group its kind uses."""
    v4 = replace(cfg.v4, mtp_in_cache=min(1, cfg.num_nextn_predict_layers))
    return replace(cfg, v4=v4)


def mla_cache_bytes_per_token(cfg: Any, dtype_bytes: int = 2) -> int:
    """`cfg` a ModelConfig of V2 / V3 MLA: one latent row (kv_lora_rank + qk_rope_head_dim) per token per layer."""
    return cfg.num_hidden_layers * cfg.kv_cache_dim * dtype_bytes


def v4_group_page_bytes(group: CacheGroup, page_size: int) -> int:
    """Bytes of one page of `group`: its rows a page (`rows_per_page`) of each of its layers."""
    return len(group.layers) * group.rows_per_page(page_size) * group.row_bytes


def v4_max_live_pages(group: CacheGroup, page_size: int, max_model_len: int, max_chunk: int) -> int:
    """The most pages of `group` one sequence holds at once: a whole max_model_len for a compressed group; for
    a windowed one its window and a step's chunk of up to `max_chunk` tokens (pages behind the window are
    given back before each allocation)."""
    full = group.pages(max_model_len, page_size)
    if group.window_tokens is None:
        return full
    return min(full, -(-(group.window_tokens - 1 + max_chunk) // group.rows_per_page(page_size)) + 1)


def v4_table_pages(group: CacheGroup, page_size: int, max_model_len: int, max_step_tokens: int) -> int:
    """Columns of a step's page table of `group` (runner/inputs.py group_tables): a compressed group's pages of
    max_model_len; a windowed group's ring, which holds every page a step reads or writes (its window and a step of
    up to `max_step_tokens` tokens, drafts included) at column page % columns, so the table does not grow with
    max_model_len (a 1M-token sliding table was 16,384 columns a sequence at 64 rows a page)."""
    rows = group.rows_per_page(page_size)
    full = max(1, -(-(max_model_len // group.tokens_per_row) // rows))
    if group.window_tokens is None:
        return full
    return min(full, -(-(group.window_tokens - 1 + max_step_tokens) // rows) + 2)


@dataclass(frozen=True)
class CachePools:
    """The page pools of a per-group cache: `groups` (`v4_cache_groups`), the pool each group draws its pages
    from (`pool_of`) and each pool's pages (`pool_pages`, its null page 0 included). One pool when every group's
    page has the same bytes, else one per group. The scheduler's accounting and the runner's layout both read it."""

    groups: tuple[CacheGroup, ...]
    pool_of: tuple[int, ...]
    pool_pages: tuple[int, ...]
    page_size: int
    context_tokens: int = 0  # tokens of context the compressed groups hold besides a partly filled page a sequence
    # (at least max_model_len)


def v4_cache_pools(cfg: V4Config, page_size: int, context_pages: int, max_num_seqs: int, max_chunk: int,
                   max_model_len: int, dtype_bytes: int = 2) -> CachePools:
    """The pools of a cache that holds `context_pages` pages of page_size tokens of context (the null page
    included; at least max_model_len tokens, so one sequence always fits: the scheduler's progress guarantee): a
    compressed group one page per page_size * its rate of those tokens plus one partly filled page per sequence;
    a windowed group `max_num_seqs` windows and a step of `max_chunk` tokens."""
    groups = v4_cache_groups(cfg, dtype_bytes)
    tokens = max((context_pages - 1) * page_size, max_model_len)
    pages = []
    for g in groups:
        if g.window_tokens is None:
            n = g.pages(tokens, page_size) + max_num_seqs
        else:
            rows = g.rows_per_page(page_size)
            n = max_num_seqs * (-(-(g.window_tokens - 1) // rows) + 2) + -(-max_chunk // rows)
        pages.append(max(n, v4_max_live_pages(g, page_size, max_model_len, max_chunk)))
    if len({v4_group_page_bytes(g, page_size) for g in groups}) == 1:
        return CachePools(groups, (0,) * len(groups), (sum(pages) + 1,), page_size, tokens)
    return CachePools(groups, tuple(range(len(groups))), tuple(n + 1 for n in pages), page_size, tokens)


def v4_context_page_bytes(cfg: V4Config, page_size: int, dtype_bytes: int = 2) -> float:
    """Bytes one page of page_size tokens of context costs in the compressed groups (what grows with the context)."""
    return sum(v4_group_page_bytes(g, page_size) / g.tokens_per_row
               for g in v4_cache_groups(cfg, dtype_bytes) if g.window_tokens is None)


def v4_pool_bytes(pools: CachePools) -> tuple[int, ...]:
    """Bytes of each pool of `pools`: its pages times its groups' page bytes (equal within a shared pool)."""
    page = [0] * len(pools.pool_pages)
    for g, k in zip(pools.groups, pools.pool_of):
        page[k] = max(page[k], v4_group_page_bytes(g, pools.page_size))
    return tuple(n * b for n, b in zip(pools.pool_pages, page))


def v4_fit_pools(cfg: V4Config, page_size: int, budget_bytes: int, max_num_seqs: int, max_chunk: int,
                 max_model_len: int, dtype_bytes: int = 2) -> CachePools:
    """The pools (`v4_cache_pools`) of the most context pages whose bytes fit `budget_bytes`; those of one sequence
    of max_model_len when even they do not fit (`v4_pool_bytes` then exceeds the budget)."""
    def pools(n: int) -> CachePools:
        return v4_cache_pools(cfg, page_size, n, max_num_seqs, max_chunk, max_model_len, dtype_bytes)

    lo, hi = 1, max(1, int(budget_bytes // max(v4_context_page_bytes(cfg, page_size, dtype_bytes), 1)) + 1)
    while lo < hi:  # the bytes grow with the context pages: the largest count within the budget
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(v4_pool_bytes(pools(mid))) <= budget_bytes else (lo, mid - 1)
    return pools(lo)
