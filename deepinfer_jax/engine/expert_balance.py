"""EPLB's observed expert load, and a rebalance on command (docs/multi-gpu.md "EPLB").

With enable_eplb the runner counts the token copies routed to each logical expert of each MoE layer on the device
(RunnerConfig.count_expert_load; ModelRunner.expert_load reads them). `ExpertBalance.report` reads the counts when
asked (/metrics, LLM.expert_load): per expert summed over the MoE layers, and the current placement's balancedness
on them (mean over max of the EP ranks' loads, averaged over the layers; 1.0 is even: vLLM's `log_balancedness`
figure). `rebalance` computes a new placement from the counts (sharding/eplb.py `rebalance`) and applies it between
steps, when it lowers the largest rank load on those counts: the physical expert slots are gathered anew from the
current ones and the map replaced (weights/eplb_load.py `replace_placement`). Slot count and shapes stay, so the
compiled step programs run the new placement, and every copy of an expert holds its weights, so outputs stay the
same. The counts are kept (from warm-up on, never reset), so the figures are cumulative.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deepinfer_jax.sharding.eplb import ExpertPlacement, balancedness, rank_loads, rebalance


class ExpertBalance:
    def __init__(self, runner: Any, placement: ExpertPlacement, num_ranks: int, mesh: Any):
        self.runner, self.placement, self.num_ranks, self.mesh = runner, placement, num_ranks, mesh

    def load(self) -> np.ndarray:
        """The counts [num_moe_layers, E] since warm-up (int64)."""
        return self.runner.expert_load()

    def report(self) -> dict[str, Any]:
        """{"per_expert": [E] token copies routed to each logical expert over all MoE layers, "balancedness": the
        placement's on the counts (1.0 before any), "max_rank_load": the largest rank load summed over layers}."""
        load = self.load()
        return {"per_expert": load.sum(0), "balancedness": self._balancedness(load, self.placement),
                "max_rank_load": self._max_rank_load(load, self.placement)}

    def rebalance(self) -> dict[str, Any]:
        """A placement from the observed counts, applied where it lowers the largest rank load (summed over the MoE
        layers); -> {"applied", "max_rank_load_before", "max_rank_load_after", "balancedness_before",
        "balancedness_after"} (the "after" figures the new placement's on the same counts)."""
        from deepinfer_jax.weights.eplb_load import replace_placement

        load = self.load()
        if not load.any():
            raise ValueError("no expert load observed yet: serve requests before rebalancing the experts")
        new = rebalance(load, self.placement.num_physical, self.num_ranks)
        before, after = self._max_rank_load(load, self.placement), self._max_rank_load(load, new)
        out = {"applied": after < before, "max_rank_load_before": before, "max_rank_load_after": after,
               "balancedness_before": self._balancedness(load, self.placement),
               "balancedness_after": self._balancedness(load, new)}
        if out["applied"]:  # between steps: the next step runs on the new slots (queued ones keep the old arrays)
            self.runner.params = replace_placement(self.runner.params, self.placement, new, self.mesh)
            self.placement = new
        return out

    def _max_rank_load(self, load: np.ndarray, placement: ExpertPlacement) -> float:
        return float(rank_loads(load, placement, self.num_ranks).max(1).sum())

    def _balancedness(self, load: np.ndarray, placement: ExpertPlacement) -> float:
        return balancedness(load, placement, self.num_ranks) if load.any() else 1.0
