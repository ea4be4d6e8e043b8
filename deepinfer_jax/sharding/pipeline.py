"""Pipeline parallelism's layout: one ModelSharding a stage, each on its own run of TP x DP devices.

Stage r (models/pipeline.py: its decoder layers, vLLM's split) takes devices [r * TP * DP, (r + 1) * TP * DP) and
lays its params and its KV cache out on a ("data", "tensor") mesh of them exactly as one whole model is laid out
without pipeline parallelism (rules.py): tensor parallelism, data-parallel attention and expert parallelism all run
inside a stage. Between stages only the hidden states [T, D] move (runner/pipeline.py); every stage sees the same
step metadata, so each data-parallel rank owns the same requests and pages on every stage.

Loading: a leaf that one stage alone holds (the embedding, the final norm and lm_head, a segment of layers inside
one stage) loads straight onto that stage's devices; a segment of stacked layers that two stages share loads on
the host and the runner cuts it and places each stage's part (`load_shardings`). An MTP head is not kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.pipeline import PipelineStage, param_segments, pipeline_stages, stage_tree
from deepinfer_jax.sharding.layout import ModelSharding, build_sharding
from deepinfer_jax.sharding.mesh import ParallelConfig


@dataclass(frozen=True)
class PipelineSharding:
    parallel: ParallelConfig
    stages: tuple[PipelineStage, ...]
    shardings: tuple[ModelSharding, ...]  # stage r's layout, on its own devices

    @property
    def pipeline_parallel_size(self) -> int:
        return len(self.stages)

    @property
    def num_ranks(self) -> int:
        """Data-parallel attention ranks (the same on every stage)."""
        return self.shardings[0].num_ranks

    @property
    def vocab_multiple(self) -> int:
        return self.shardings[0].vocab_multiple

    def fit_config(self, cfg: ModelConfig) -> ModelConfig:
        return self.shardings[0].fit_config(cfg)

    def load_shardings(self, cfg: ModelConfig) -> Any:
        """A params-shaped tree of shardings to load the checkpoint onto (module docstring): each leaf on the
        one stage that holds it, a segment shared by two stages on the host (the CPU backend's first device,
        else stage 0's first device), an MTP head on the last stage (loaded, never run)."""
        import jax

        per_stage = [sh.param_shardings(cfg) for sh in self.shardings]
        try:
            host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
        except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
            host = jax.sharding.SingleDeviceSharding(self.shardings[0].mesh.devices.flat[0])
        out = {"embed": per_stage[0]["embed"], "final_norm": per_stage[-1]["final_norm"],
               "lm_head": per_stage[-1]["lm_head"], "segments": []}
        for i, seg in enumerate(param_segments(cfg)):
            owners = [st.rank for st in self.stages if max(seg.start, st.start) < min(seg.stop, st.stop)]
            sub = per_stage[owners[0]]["segments"][i]
            out["segments"].append(sub if len(owners) == 1 else jax.tree.map(lambda _: host, sub))
        if "mtp" in per_stage[-1]:  # never run with pipeline parallelism: on the host, dropped once loaded
            out["mtp"] = jax.tree.map(lambda _: host, per_stage[-1]["mtp"])
        return out

    def stage_param_shardings(self, cfg: ModelConfig, params: Any, rank: int) -> Any:
        """Stage `rank`'s share of the params (models/pipeline.py stage_tree) -> its shardings, quantized leaves
        included (ModelSharding.fit_param_shardings)."""
        return stage_tree(self.shardings[rank].fit_param_shardings(cfg, params), cfg, self.stages[rank])


def build_pipeline_sharding(cfg: ModelConfig, parallel: ParallelConfig, devices=None) -> PipelineSharding:
    """The stages of `parallel` (pipeline_parallel_size of them, checked against the model's layers) and a
    ModelSharding a stage over the next TP x DP of `devices` (default: jax.devices())."""
    import jax

    pp = parallel.pipeline_parallel_size
    if cfg.family not in ("deepseek", "dense"):
        raise ValueError(f"--pipeline-parallel-size {pp} is not supported for the {cfg.family} family "
                         f"({cfg.model_type}) yet; leave it 1")
    stages = tuple(pipeline_stages(cfg, pp))  # refuses fewer layers than stages
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < parallel.num_devices:
        raise ValueError(f"--pipeline-parallel-size {pp} x --tensor-parallel-size {parallel.tensor_parallel_size} x "
                         f"--data-parallel-size {parallel.data_parallel_size} needs {parallel.num_devices} devices; "
                         f"{len(devices)} available")
    n = parallel.world_size
    shardings = tuple(build_sharding(cfg, parallel, devices[r * n:(r + 1) * n]) for r in range(pp))
    return PipelineSharding(parallel, stages, shardings)
