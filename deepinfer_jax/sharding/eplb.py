"""Expert-parallel load balancing (DeepSeek's EPLB): redundant copies of the hot experts and a placement of the
physical expert slots over the EP ranks that evens out their load, from observed routing counts. No JAX.

Physical slots P = E logical experts + R redundant ones, P / N of them on each of the N EP ranks (rank r holds
slots r P / N .. (r + 1) P / N - 1, as the "expert" axis splits any expert array). Per MoE layer:

1. `replicate`: every expert gets one slot; each of the R extra slots goes, one at a time, to the expert with the
   largest load per copy (DeepSeek's eplb.py `replicate_experts`).
2. `pack`: the copies (each carrying load / copies of its expert) are placed heaviest first on the rank with the
   least load among those with a free slot (DeepSeek's `balanced_packing`, with every copy an item).

The model applies a placement with models/eplb_map.py: a token copy routed to logical expert e goes to one of its
slots (`log_to_phys[e, j]`, j spread over the copies), and the physical expert weights are the logical ones
gathered by `phys_to_log`. Every copy of an expert holds the same weights, so a placement never changes the
output, only which device computes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ExpertPlacement:
    """Per MoE layer: phys_to_log [L, P] (the logical expert of each slot), log_to_phys [L, E, R_max] (the slots of
    each logical expert, -1 past its `replicas`), replicas [L, E] (its number of copies, >= 1)."""

    phys_to_log: np.ndarray
    log_to_phys: np.ndarray
    replicas: np.ndarray

    @property
    def num_physical(self) -> int:
        return self.phys_to_log.shape[1]


def check_slots(num_logical: int, num_redundant: int, num_ranks: int) -> int:
    """The physical slot count, or ValueError naming the flag when the EP ranks do not divide it."""
    if num_redundant < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant}")
    P = num_logical + num_redundant
    if P % num_ranks:
        raise ValueError(f"n_routed_experts {num_logical} + num_redundant_experts {num_redundant} = {P} physical "
                         f"experts is not divisible by the {num_ranks} expert-parallel ranks; change "
                         "num_redundant_experts (--eplb-config)")
    return P


def replicate(load: np.ndarray, num_physical: int) -> np.ndarray:
    """load [E] -> copies [E] (>= 1 each, summing to num_physical): each extra copy to the largest load per copy."""
    load = np.asarray(load, np.float64)
    copies = np.ones(load.shape[0], np.int64)
    for _ in range(num_physical - load.shape[0]):
        copies[np.argmax(load / copies)] += 1
    return copies


def pack(load: np.ndarray, copies: np.ndarray, num_ranks: int) -> np.ndarray:
    """The copies of each expert (load / copies each) placed over `num_ranks` ranks of equal slot counts, heaviest
    first on the least-loaded rank with a free slot -> phys_to_log [P], rank r's slots contiguous."""
    load = np.asarray(load, np.float64)
    P = int(copies.sum())
    per_rank = P // num_ranks
    items = np.repeat(np.arange(load.shape[0]), copies)  # one item per copy
    weight = (load / copies)[items]
    order = np.lexsort((items, -weight))  # heaviest first; ties by expert id, so placements are deterministic
    rank_load = np.zeros(num_ranks)
    slots: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in order:
        free = [r for r in range(num_ranks) if len(slots[r]) < per_rank]
        r = min(free, key=lambda r: (rank_load[r], r))
        slots[r].append(int(items[i]))
        rank_load[r] += weight[i]
    return np.array([e for s in slots for e in sorted(s)], np.int32)


def placement_from(phys_to_log: np.ndarray, num_logical: int) -> ExpertPlacement:
    """The ExpertPlacement of phys_to_log [L, P] (every logical expert in at least one slot of each layer).
    log_to_phys is P - E + 1 wide (the most copies one expert can have), so every placement of the same slot count
    has the same shapes and runs in the same compiled program."""
    phys_to_log = np.asarray(phys_to_log, np.int32)
    L, _ = phys_to_log.shape
    replicas = np.stack([np.bincount(row, minlength=num_logical) for row in phys_to_log]).astype(np.int32)
    if (replicas == 0).any():
        raise ValueError("an expert placement must give every logical expert a slot in every layer")
    log_to_phys = np.full((L, num_logical, phys_to_log.shape[1] - num_logical + 1), -1, np.int32)
    for layer, row in enumerate(phys_to_log):
        for e in range(num_logical):
            slots = np.flatnonzero(row == e)
            log_to_phys[layer, e, :len(slots)] = slots
    return ExpertPlacement(phys_to_log, log_to_phys, replicas)


def default_placement(num_layers: int, num_logical: int, num_redundant: int, num_ranks: int) -> ExpertPlacement:
    """Before any counts: the logical experts in order, then the redundant slots as copies of experts 0, 1, ...
    (the load is unknown, so any copies serve), placed by `pack` on a flat load."""
    P = check_slots(num_logical, num_redundant, num_ranks)
    return rebalance(np.ones((num_layers, num_logical)), P, num_ranks)


def rebalance(load: np.ndarray, num_physical: int, num_ranks: int) -> ExpertPlacement:
    """load [L, E] (routed token copies per logical expert and MoE layer) -> the placement `replicate` and `pack`
    make for each layer."""
    load = np.atleast_2d(np.asarray(load, np.float64))
    check_slots(load.shape[1], num_physical - load.shape[1], num_ranks)
    rows = [pack(row, replicate(row, num_physical), num_ranks) for row in load]
    return placement_from(np.stack(rows), load.shape[1])


def rank_loads(load: np.ndarray, placement: ExpertPlacement, num_ranks: int) -> np.ndarray:
    """load [L, E] -> [L, N]: each rank's share when an expert's copies split its load evenly."""
    load = np.atleast_2d(np.asarray(load, np.float64))
    per_copy = load / placement.replicas  # [L, E]
    slot_load = np.take_along_axis(per_copy, placement.phys_to_log.astype(np.int64), axis=1)  # [L, P]
    return slot_load.reshape(load.shape[0], num_ranks, -1).sum(-1)


def balancedness(load: np.ndarray, placement: ExpertPlacement, num_ranks: int) -> float:
    """Mean over max of the ranks' loads (1.0: perfectly even), averaged over layers: vLLM's EPLB
    `log_balancedness` figure."""
    r = rank_loads(load, placement, num_ranks)
    return float(np.mean(r.mean(1) / np.maximum(r.max(1), 1e-12)))


# vLLM's EPLBConfig keys that are not implemented here, each refused by name: the placement is computed once at
# start (from `expert_load`, or flat), not from a window of recent steps.
EPLB_REFUSED_KEYS = ("window_size", "step_interval", "log_balancedness", "use_async", "policy",
                     "num_wait_worker_iterations", "communicator")


@dataclass(frozen=True)
class EPLBConfig:
    """--eplb-config: num_redundant_experts (vLLM's key: extra physical slots, copies of the hot experts) and
    expert_load (ours: a JSON file of observed routing counts, [E] for every MoE layer or [L][E] one row a MoE
    layer, from which the start-up placement is computed; without it the placement is flat)."""

    num_redundant_experts: int = 0
    expert_load: str | None = None

    @classmethod
    def parse(cls, value: Any) -> "EPLBConfig":
        import json

        if value is None:
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--eplb-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--eplb-config must be a JSON object, got {value!r}")
        for key in value:
            if key in EPLB_REFUSED_KEYS:
                raise ValueError(f"--eplb-config key {key!r} is not supported: the placement is computed once at "
                                 "start, from \"expert_load\" counts or flat (docs/multi-gpu.md)")
            if key not in ("num_redundant_experts", "expert_load"):
                raise ValueError(f"--eplb-config key {key!r} is not one of num_redundant_experts, expert_load")
        n = value.get("num_redundant_experts", 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"--eplb-config num_redundant_experts must be an integer >= 0, got {n!r}")
        return cls(n, value.get("expert_load"))

    def placement(self, num_layers: int, num_logical: int, num_ranks: int) -> ExpertPlacement:
        """The start-up placement for `num_layers` MoE layers of `num_logical` experts over `num_ranks` EP ranks."""
        import json

        P = check_slots(num_logical, self.num_redundant_experts, num_ranks)
        if self.expert_load is None:
            return default_placement(num_layers, num_logical, self.num_redundant_experts, num_ranks)
        with open(self.expert_load) as f:
            load = np.asarray(json.load(f), np.float64)
        if load.ndim == 1:
            load = np.tile(load, (num_layers, 1))
        if load.shape != (num_layers, num_logical) or (load < 0).any():
            raise ValueError(f"--eplb-config expert_load {self.expert_load}: counts of shape {load.shape}, want "
                             f"[{num_logical}] or [{num_layers}, {num_logical}] (MoE layers x experts), none negative")
        return rebalance(load, P, num_ranks)
