"""Logical-axis rules: which mesh axes split each logical axis of the params, the cache and the step.

Changing a layout means editing these rules, never the model. A rule maps a logical axis name (from
models/params.py, plus "tokens", "seqs", "pages" for the step and the cache) to a tuple of mesh axes;
an axis not named, or named with (), is replicated. `default_rules` is vLLM's layout on the
("data", "tensor") mesh of mesh.py:

- attention: heads over "tensor" (TP); tokens, sequence rows and KV cache pages over "data" (DP
  attention: the latent cache is one head wide, so it is split by pages, never by heads);
- dense MLP and shared experts: intermediate dim ("mlp") over "tensor";
- routed experts: the "expert" axis over ("data", "tensor") with enable_expert_parallel (EP = TP x DP),
  otherwise their intermediate dim ("moe_mlp") over ("data", "tensor");
- vocab (embedding rows, lm_head columns) over "tensor"; everything else replicated.

DeepSeek-V4 has its own table (`v4_rules`: the routed experts split as above, the attention's query heads and
output groups over "tensor" where the degree divides its `o_groups`, the shared expert's intermediate dim over
"tensor" where the degree divides it into whole FP8 blocks, everything else replicated) and its own refusals
(`check_v4_layout`).

`check_rules` refuses, with a ValueError naming the model dimension, any mesh that does not divide a
split dimension (no padding: 5 heads on TP = 2 is refused, not padded).
"""

from __future__ import annotations

from typing import Any, Mapping

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.parallel import logical_to_spec
from deepinfer_jax.models.params import is_spec
from deepinfer_jax.models.registry import param_specs
from deepinfer_jax.sharding.mesh import DATA, TENSOR, ParallelConfig

Rules = tuple[tuple[str, tuple[str, ...]], ...]

# The cache [L, P, page_size, R + dr] in logical axes; the dense family's [L, P, page_size, 2, KVH, hd].
KV_CACHE_AXES = ("layers", "pages", None, "kv_latent")
DENSE_KV_CACHE_AXES = ("layers", "pages", None, None, "kv_heads", "head_dim")

# The model dimension behind each logical axis, for error messages.
DIMENSION_NAMES = {
    "vocab": "vocab_size", "embed": "hidden_size", "heads": "num_attention_heads",
    "mlp": "intermediate_size", "moe_mlp": "moe_intermediate_size", "expert": "n_routed_experts",
    "q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank", "kv_latent": "kv_lora_rank + qk_rope_head_dim",
    "qk_head": "qk_nope_head_dim + qk_rope_head_dim", "kv_head": "qk_nope_head_dim + v_head_dim",
    "v_head": "v_head_dim", "layers": "num_hidden_layers", "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "o_groups": "o_groups",
}


def default_rules(pc: ParallelConfig) -> Rules:
    moe = (DATA, TENSOR)
    return (
        ("vocab", (TENSOR,)),
        ("embed", ()),
        ("heads", (TENSOR,)),
        ("qk_head", ()), ("kv_head", ()), ("v_head", ()),
        ("q_lora", ()), ("kv_lora", ()), ("kv_latent", ()),
        ("kv_heads", (TENSOR,)), ("head_dim", ()),
        ("mlp", (TENSOR,)),
        ("expert", moe if pc.enable_expert_parallel else ()),
        ("moe_mlp", () if pc.enable_expert_parallel else moe),
        ("layers", ()),
        ("tokens", (DATA,)), ("seqs", (DATA,)), ("pages", (DATA,)),
    )


# DeepSeek-V4's per-group pools: one array [pool pages, page elements] per pool (models/v4_paged.py).
V4_KV_CACHE_AXES = ("pages", None)


def v4_rules(pc: ParallelConfig, cfg: ModelConfig | None = None, shared_block: tuple[int, int] | None = None) -> Rules:
    """DeepSeek-V4's layout: the routed experts over ("data", "tensor") with enable_expert_parallel, else their
    intermediate dim; with `cfg` and `v4_splits_attention`, the attention's query heads ("heads": q_b_proj's heads,
    the sinks) and its output groups ("o_groups": o_a_proj's groups, o_b_proj's rows) over "tensor"
    (models/v4_parallel.py v4_heads_sharded); with `cfg` and `v4_splits_shared` (`shared_block`: the FP8 block of a
    shared expert kept as released, or None), the shared expert's intermediate dim ("mlp") over "tensor", its
    partial sums added in the routed experts' reduction (v4_experts_sharded); everything else replicated: the KV,
    compressor and indexer paths (V4's one K = V head serves every query head, as in MQA), embedding and head, and
    every device keeps the whole per-group cache."""
    moe = (DATA, TENSOR)
    split = {"expert": moe if pc.enable_expert_parallel else (), "moe_mlp": () if pc.enable_expert_parallel else moe}
    if cfg is not None and v4_splits_attention(cfg, pc):
        split.update(heads=(TENSOR,), o_groups=(TENSOR,))
    if cfg is not None and v4_splits_shared(cfg, pc, shared_block):
        split.update(mlp=(TENSOR,))
    names = [name for name, _ in default_rules(pc)] + ["o_groups"]
    return tuple((name, split.get(name, ())) for name in names)


def v4_splits_attention(cfg: ModelConfig, pc: ParallelConfig) -> bool:
    """Whether DeepSeek-V4's attention splits over the tensor axis under `pc`: a tensor degree above 1 that divides
    `o_groups` (so each device holds whole output groups and their query heads, H / g heads a group). Otherwise the
    attention stays whole on every device (as layout.py replicates KV heads a degree does not divide)."""
    tp = pc.tensor_parallel_size
    return tp > 1 and cfg.v4.o_groups % tp == 0 and cfg.v4.num_attention_heads % tp == 0


def v4_splits_shared(cfg: ModelConfig, pc: ParallelConfig, block: tuple[int, int] | None = None) -> bool:
    """Whether DeepSeek-V4's shared expert splits its intermediate dim I (`moe_intermediate_size`: gate_up's columns,
    down's rows) over the tensor axis under `pc`: a tensor degree above 1 that divides I, and, for a shared expert
    kept in FP8 (`block`: its weight_block_size [rows, columns]), gives each device whole blocks of gate / up's rows
    and of down's columns (I / TP a multiple of both). Otherwise it stays whole on every device, as the attention
    does where the degree does not divide its groups (a split of every routed expert needs none of this)."""
    tp, width = pc.tensor_parallel_size, cfg.v4.moe_intermediate_size
    if tp <= 1 or width % tp:
        return False
    return block is None or (width // tp) % block[0] == 0 and (width // tp) % block[1] == 0


def check_v4_layout(pc: ParallelConfig) -> None:
    """A ValueError (one line naming the flag) where DeepSeek-V4 cannot run under `pc`."""
    problem = _v4_layout_problem(pc)
    if problem:
        raise ValueError(problem)


def _v4_layout_problem(pc: ParallelConfig) -> str | None:
    if pc.pipeline_parallel_size > 1:
        return ("--pipeline-parallel-size above 1 is not supported for deepseek_v4: its layers differ in kind and run "
                "as a Python loop, not the stacked segments pipeline stages cut")
    if pc.data_parallel_size > 1:
        return ("--data-parallel-size above 1 is not supported for deepseek_v4: data-parallel attention needs its "
                "per-group KV pools per rank, not built; --tensor-parallel-size (with --enable-expert-parallel) "
                "splits its routed experts")
    if pc.all2all_backend != "allgather_reducescatter":
        return (f"--all2all-backend {pc.all2all_backend} is not supported for deepseek_v4: every device runs the "
                "whole step's attention, so each already holds every token its experts need")
    return None


def v4_bytes_per_device(cfg: ModelConfig, pc: ParallelConfig, by_leaf: dict,
                        shared_block: tuple[int, int] | None = None) -> int:
    """DeepSeek-V4's weight bytes on each device under `pc` (`v4_rules`), from each leaf's whole bytes by path
    (engine/plan.py v4_weight_bytes, updated in place to the per-device bytes): a routed expert leaf (float, or FP4 /
    FP8 kept: q and scales alike) divided over the devices that split it, with `v4_splits_attention` the attention's
    head-indexed leaves (q_b_proj, sinks, o_a_proj, o_b_proj; not the indexer's) over the tensor degree, with
    `v4_splits_shared` (`shared_block` as for v4_rules) the shared expert's leaves over the tensor degree, the rest
    whole. A split the layout refuses is refused here (`check_rules`)."""
    check_rules(cfg, {DATA: pc.data_parallel_size, TENSOR: pc.tensor_parallel_size}, v4_rules(pc, cfg, shared_block))
    n = pc.data_parallel_size * pc.tensor_parallel_size
    heads = pc.tensor_parallel_size if v4_splits_attention(cfg, pc) else 1
    shared = pc.tensor_parallel_size if v4_splits_shared(cfg, pc, shared_block) else 1
    for path, b in by_leaf.items():
        if "experts" in path:  # (..., "moe", "experts", "gate_up" | "down"): E or I over every device
            by_leaf[path] = b // n
        elif path[-2:-1] == ("attn",) and path[-1] in V4_HEAD_LEAVES:  # (..., "attn", leaf): H or g over TP
            by_leaf[path] = b // heads
        elif path[-2:-1] == ("shared",):  # (..., "moe", "shared", "gate_up" | "down"): I over TP
            by_leaf[path] = b // shared
    return sum(by_leaf.values())


# DeepSeek-V4's attention leaves indexed by query head or output group (v4_params.py), split with the heads.
V4_HEAD_LEAVES = ("q_b_proj", "sinks", "o_a_proj", "o_b_proj")


def _size(axes: tuple[str, ...], mesh_shape: Mapping[str, int]) -> int:
    n = 1
    for a in axes:
        n *= mesh_shape[a]
    return n


def dimension_name(logical: str, path: str) -> str:
    if logical == "mlp" and "shared" in path:
        return "moe_intermediate_size x n_shared_experts"
    return DIMENSION_NAMES.get(logical, logical)


# The launch flag behind each mesh axis, for refusals.
AXIS_FLAGS = {DATA: "--data-parallel-size", TENSOR: "--tensor-parallel-size"}


def split_flags(logical: str, axes: tuple[str, ...]) -> str:
    flags = " or ".join(AXIS_FLAGS.get(a, f"the {a!r} mesh axis") for a in axes)
    if logical == "expert":
        return flags + " (expert parallelism spans them), or drop --enable-expert-parallel"
    if logical == "moe_mlp":
        return flags + " (the experts' intermediate dim spans them), or set --enable-expert-parallel"
    return flags


def check_rules(cfg: ModelConfig, mesh_shape: Mapping[str, int], rules: Rules) -> None:
    """Raise ValueError unless `rules` on a mesh of `mesh_shape` ({axis: size}) splits every param
    evenly and keeps the data-parallel attention consistent."""
    import jax

    table = dict(rules)
    for logical, axes in rules:
        for a in axes:
            if a not in mesh_shape:
                raise ValueError(f"rule {logical!r} -> {axes} names mesh axis {a!r}, not one of {tuple(mesh_shape)}")
    tok, seqs, pages = table.get("tokens", ()), table.get("seqs", ()), table.get("pages", ())
    if not (tok == seqs == pages):
        raise ValueError(f"'tokens' {tok}, 'seqs' {seqs} and 'pages' {pages} must be split over the same mesh "
                         "axes (each data-parallel rank owns its requests and their cache pages)")
    for logical in ("kv_latent", "kv_lora"):
        if _size(table.get(logical, ()), mesh_shape) > 1:
            raise ValueError(f"{logical!r} must stay replicated: the MLA latent cache is one head wide")
    if set(table.get("heads", ())) & set(tok):
        raise ValueError(f"'heads' {table.get('heads')} and 'tokens' {tok} share a mesh axis")

    def check(path, spec) -> None:
        name = jax.tree_util.keystr(path)
        used: list[str] = []
        for dim, logical in zip(spec.shape, spec.axes):
            axes = table.get(logical, ()) if logical else ()
            n = _size(axes, mesh_shape)
            if set(axes) & set(used):
                raise ValueError(f"param {name}: mesh axes {axes} split two of its dimensions")
            used.extend(axes)
            if n > 1 and dim % n:
                raise ValueError(
                    f"{dimension_name(logical, name)} = {dim} is not divisible by {n} (logical axis "
                    f"{logical!r} split over mesh axes {axes}, param {name}); change {split_flags(logical, axes)}")

    jax.tree_util.tree_map_with_path(check, param_specs(cfg), is_leaf=is_spec)


def param_partition_specs(cfg: ModelConfig, rules: Rules) -> Any:
    """Pytree of PartitionSpec with the structure of param_specs(cfg)."""
    import jax

    return jax.tree.map(lambda s: logical_to_spec(s.axes, rules), param_specs(cfg), is_leaf=is_spec)


def param_shardings(cfg: ModelConfig, mesh, rules: Rules) -> Any:
    """Pytree of NamedSharding matching param_specs(cfg) (checked with check_rules first)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    check_rules(cfg, dict(mesh.shape), rules)
    return jax.tree.map(lambda p: NamedSharding(mesh, p), param_partition_specs(cfg, rules),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def kv_cache_sharding(mesh, rules: Rules, axes: tuple = KV_CACHE_AXES):
    """NamedSharding of the paged cache (`axes`: its logical axes; the latent cache [L, P, page_size, R + dr] by
    default): pages over the data axes, the dense family's KV heads as the rules split them."""
    from jax.sharding import NamedSharding

    return NamedSharding(mesh, logical_to_spec(axes, rules))
