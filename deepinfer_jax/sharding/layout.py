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
from deepinfer_jax.sharding.rules import (DENSE_KV_CACHE_AXES, KV_CACHE_AXES, Rules, check_rules, default_rules,
                                          kv_cache_sharding, param_shardings)


@dataclass(frozen=True)
class ModelSharding:
    parallel: ParallelConfig
    mesh: Any  # jax.sharding.Mesh
    rules: Rules
    kv_cache_axes: tuple = KV_CACHE_AXES  # the cache's logical axes (the model family's layout)

    @property
    def mesh_rules(self) -> MeshRules:
        return MeshRules(self.mesh, self.rules)

    @property
    def num_ranks(self) -> int:
        """Data-parallel attention ranks: each owns its requests and a contiguous range of cache pages."""
        return self.mesh_rules.size("pages")

    def param_shardings(self, cfg: ModelConfig) -> Any:
        return param_shardings(cfg, self.mesh, self.rules)

    def fit_param_shardings(self, cfg: ModelConfig, params: Any) -> Any:
        """param_shardings with the exact structure of `params`: a quantized leaf gets its sharding for
        `q` and for `scale`, with length-1 axes (an int8 scale shared along a contracted axis) unsplit."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        def fit(s: NamedSharding, sub: Any) -> Any:
            def one(a):
                spec = tuple(s.spec) + (None,) * (a.ndim - len(s.spec))
                return NamedSharding(s.mesh, PartitionSpec(*[None if n == 1 else x for x, n in zip(spec, a.shape)]))

            return jax.tree.map(one, sub)

        return jax.tree.map(fit, self.param_shardings(cfg), params, is_leaf=lambda x: isinstance(x, NamedSharding))

    @property
    def kv_cache(self) -> Any:
        return kv_cache_sharding(self.mesh, self.rules, self.kv_cache_axes)

    def _named(self, *axes):
        from jax.sharding import NamedSharding

        return NamedSharding(self.mesh, self.mesh_rules.spec(axes))

    def step_shardings(self, meta: Any, sampling: Any) -> tuple[Any, Any]:
        """Shardings of the step's StepMetadata (token arrays over "tokens", page_table and
        logits_indices over "seqs") and SamplingTensors (rows over "seqs"); either may be None."""
        import dataclasses

        import jax

        tok = self._named("tokens")
        meta_sh = None if meta is None else dataclasses.replace(
            meta, token_ids=tok, positions=tok, seq_ids=tok, slot_mapping=tok,
            page_table=self._named("seqs", None), logits_indices=self._named("seqs"))
        st_sh = jax.tree.map(lambda a: self._named("seqs", *([None] * (a.ndim - 1))), sampling)
        return meta_sh, st_sh

    @property
    def logits(self) -> Any:
        """[S, V] logits go to sampling with the vocab gathered, so sampling is the single-device code."""
        return self._named("seqs", None)


def build_sharding(cfg: ModelConfig, parallel: ParallelConfig, devices=None, rules: Rules | None = None
                   ) -> ModelSharding:
    """Mesh + rules for `parallel`, checked against the model (ValueError naming the dimension).

    The dense family: tensor parallelism only (data-parallel attention is the MLA path's); its KV heads split
    over the tensor axis where the degree divides them, else replicated, each device then computing and caching
    every KV head (vLLM replicates them too when TP exceeds them)."""
    if cfg.family == "dense":
        if parallel.data_parallel_size > 1 or parallel.enable_expert_parallel:
            raise ValueError("data_parallel_size > 1 and enable_expert_parallel are not supported for the dense "
                             f"family ({cfg.model_type}); use tensor_parallel_size")
        if rules is None and cfg.num_key_value_heads % parallel.tensor_parallel_size:
            rules = tuple((k, ()) if k == "kv_heads" else (k, v) for k, v in default_rules(parallel))
    rules = default_rules(parallel) if rules is None else rules
    check_rules(cfg, {"data": parallel.data_parallel_size, "tensor": parallel.tensor_parallel_size}, rules)
    axes = DENSE_KV_CACHE_AXES if cfg.family == "dense" else KV_CACHE_AXES
    return ModelSharding(parallel, make_mesh(parallel, devices), rules, axes)
