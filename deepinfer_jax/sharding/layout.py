"""ModelSharding: one object carrying the mesh, the rules and every sharding the runner needs.

Built once from a ModelConfig and a ParallelConfig (`build_sharding`); the runner places the params
and the KV cache with it and constrains the step's inputs and outputs with it, and the model receives
its `mesh_rules` for the shard_map'd attention and experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.parallel import MeshRules
from deepinfer_jax.sharding.mesh import ParallelConfig, make_mesh
from deepinfer_jax.sharding.rules import (DENSE_KV_CACHE_AXES, KV_CACHE_AXES, V4_KV_CACHE_AXES, Rules, check_rules,
                                          check_v4_layout, default_rules, kv_cache_sharding, param_shardings, v4_rules)

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE: a padded vocab is a multiple of 64 x its devices


@dataclass(frozen=True)
class ModelSharding:
    parallel: ParallelConfig
    mesh: Any  # jax.sharding.Mesh
    rules: Rules
    _vocab_multiple: int = 1
    kv_cache_axes: tuple = KV_CACHE_AXES  # the cache's logical axes (the model family's layout)

    @property
    def mesh_rules(self) -> MeshRules:
        return MeshRules(self.mesh, self.rules, self.parallel.all2all_backend)

    @property
    def vocab_multiple(self) -> int:
        """What the params' vocab is padded to a multiple of: 1 where the devices splitting the vocab divide
        `vocab_size`; else 64 x those devices (vLLM's padding of its parallel embedding and lm_head)."""
        return self._vocab_multiple

    def fit_config(self, cfg: ModelConfig) -> ModelConfig:
        """`cfg` with its params' vocab padded as this layout needs (ModelConfig.with_vocab_multiple)."""
        return cfg.with_vocab_multiple(self.vocab_multiple)

    @property
    def num_ranks(self) -> int:
        """Data-parallel attention ranks: each owns its requests and a contiguous range of cache pages."""
        return self.mesh_rules.size("pages")

    def param_shardings(self, cfg: ModelConfig) -> Any:
        """The params' shardings, for `cfg` with its vocab padded as this layout needs (fit_config)."""
        return param_shardings(self.fit_config(cfg), self.mesh, self.rules)

    def fit_param_shardings(self, cfg: ModelConfig, params: Any) -> Any:
        """param_shardings with the exact structure of `params`: a quantized leaf gets its sharding for
        `q` and for `scale`, with length-1 axes (an int8 scale shared along a contracted axis) unsplit, an FP8 / FP4
        leaf kept as its checkpoint stores it the partition of its layout (sharding/packed.py); an EPLB
        placement's maps (a MoE segment's `eplb`) are replicated, its physical experts split as the logical ones."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from deepinfer_jax.models.quant_fp4 import PackedShape
        from deepinfer_jax.models.registry import param_specs
        from deepinfer_jax.sharding.packed import packed_sharding

        specs = param_specs(self.fit_config(cfg))

        def fit(path, s: NamedSharding, sub: Any) -> Any:
            if isinstance(sub, PackedShape):
                keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
                spec = _spec_at(specs, keys)
                return packed_sharding(sub, s, spec.axes if spec is not None else None, ".".join(map(str, keys)))

            def one(a):
                spec = tuple(s.spec) + (None,) * (a.ndim - len(s.spec))
                return NamedSharding(s.mesh, PartitionSpec(*[None if n == 1 else x for x, n in zip(spec, a.shape)]))

            return jax.tree.map(one, sub)

        shardings = self.param_shardings(cfg)
        if isinstance(params, dict) and "segments" in params:  # an EPLB placement's maps (weights/eplb_load.py)
            segs = list(shardings["segments"])
            for i, seg in enumerate(params["segments"]):
                if "eplb" in seg.get("moe", {}):
                    eplb = jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec()), seg["moe"]["eplb"])
                    segs[i] = {**segs[i], "moe": {**segs[i]["moe"], "eplb": eplb}}
            shardings = {**shardings, "segments": segs}
        return jax.tree_util.tree_map_with_path(fit, shardings, params, is_leaf=lambda x: isinstance(x, NamedSharding))

    @property
    def kv_cache(self) -> Any:
        return kv_cache_sharding(self.mesh, self.rules, self.kv_cache_axes)

    def _named(self, *axes):
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, self.mesh_rules.spec(axes))

    def step_shardings(self, meta: Any, sampling: Any) -> tuple[Any, Any]:
        """Shardings of the step's StepMetadata (token arrays over "tokens", page_table, logits_indices and the
        MTP's next_token_ids over "seqs", a per-group cache's tables and slots replicated) and SamplingTensors (rows
        over "seqs"); either may be None."""
        import dataclasses

        import jax

        tok = self._named("tokens")
        meta_sh = None if meta is None else dataclasses.replace(
            meta, token_ids=tok, positions=tok, seq_ids=tok, slot_mapping=tok,
            page_table=self._named("seqs", None), logits_indices=self._named("seqs"),
            next_token_ids=None if meta.next_token_ids is None else self._named("seqs"),
            groups=None if meta.groups is None else jax.tree.map(lambda _: self._named(), meta.groups))
        st_sh = jax.tree.map(lambda a: self._named("seqs", *([None] * (a.ndim - 1))), sampling)
        return meta_sh, st_sh

    @property
    def logits(self) -> Any:
        """[S, V] logits go to sampling with the vocab gathered, so sampling is the single-device code."""
        return self._named("seqs", None)


def _spec_at(specs: Any, keys: tuple) -> Any:
    """The ParamSpec at `keys` in a param specs tree, or None where there is none (an EPLB placement's maps)."""
    from deepinfer_jax.models.params import is_spec

    try:
        for k in keys:
            specs = specs[k]
    except (KeyError, IndexError, TypeError):
        return None
    return specs if is_spec(specs) else None


def build_sharding(cfg: ModelConfig, parallel: ParallelConfig, devices=None, rules: Rules | None = None
                   ) -> ModelSharding:
    """Mesh + rules for `parallel`, checked against the model (ValueError naming the dimension). A vocab that
    the devices splitting it do not divide is padded (ModelSharding.vocab_multiple), never refused.

    The dense family: tensor parallelism only (data-parallel attention is the MLA path's); its KV heads split
    over the tensor axis where the degree divides them, else replicated, each device then computing and caching
    every KV head (vLLM replicates them too when TP exceeds them)."""
    if cfg.family == "dense":
        if parallel.data_parallel_size > 1 or parallel.enable_expert_parallel:
            raise ValueError("data_parallel_size > 1 and enable_expert_parallel are not supported for the dense "
                             f"family ({cfg.model_type}); use tensor_parallel_size")
        if rules is None and cfg.num_key_value_heads % parallel.tensor_parallel_size:
            rules = tuple((k, ()) if k == "kv_heads" else (k, v) for k, v in default_rules(parallel))
    if cfg.family == "deepseek_v4":
        check_v4_layout(parallel)
        rules = v4_rules(parallel, cfg) if rules is None else rules
    rules = default_rules(parallel) if rules is None else rules
    shape = {"data": parallel.data_parallel_size, "tensor": parallel.tensor_parallel_size}
    vocab_devices = 1
    for a in dict(rules).get("vocab", ()):
        vocab_devices *= shape.get(a, 1)
    multiple = 1 if cfg.vocab_size % vocab_devices == 0 else VOCAB_PADDING * vocab_devices
    check_rules(cfg.with_vocab_multiple(multiple), shape, rules)
    axes = {"dense": DENSE_KV_CACHE_AXES, "deepseek_v4": V4_KV_CACHE_AXES}.get(cfg.family, KV_CACHE_AXES)
    return ModelSharding(parallel, make_mesh(parallel, devices), rules, multiple, axes)
