"""EPLB's placement (sharding/eplb.py): redundant copies of the hot experts and their packing over the EP ranks
lower the most loaded rank's share of a skewed routing count, and the placement's maps agree with each other."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.sharding.eplb import (balancedness, check_slots, default_placement, placement_from, rank_loads,
                                         rebalance, replicate)

E, N = 16, 4  # logical experts, EP ranks


def skewed(layers: int = 2, seed: int = 0) -> np.ndarray:
    """Zipf-like counts: a few hot experts take most tokens, hot ones at different ids in each layer."""
    rng = np.random.default_rng(seed)
    base = 1000.0 / np.arange(1, E + 1) ** 1.2
    return np.stack([rng.permutation(base) for _ in range(layers)])


def contiguous(layers: int) -> object:
    """No EPLB: expert e on rank e // (E / N)."""
    return placement_from(np.tile(np.arange(E), (layers, 1)), E)


@pytest.mark.parametrize("redundant", [0, 4, 8])
def test_placement_lowers_the_max_rank_load(redundant):
    load = skewed()
    before = rank_loads(load, contiguous(2), N).max(1)
    pl = rebalance(load, E + redundant, N)
    after = rank_loads(load, pl, N)
    assert np.allclose(after.sum(1), load.sum(1))  # every token copy still lands somewhere
    assert (after.max(1) < before).all(), (after.max(1), before)
    assert balancedness(load, pl, N) > balancedness(load, contiguous(2), N)
    if redundant:  # copies help beyond packing alone
        assert (after.max(1) < rank_loads(load, rebalance(load, E, N), N).max(1)).all()


def test_hottest_expert_gets_the_copies():
    load = np.array([100.0, 1, 1, 1, 1, 1, 1, 1])
    assert replicate(load, 12).tolist() == [5, 1, 1, 1, 1, 1, 1, 1]
    assert replicate(load, 8).tolist() == [1] * 8


def test_maps_agree():
    pl = rebalance(skewed(3, seed=1), E + 8, N)
    assert pl.phys_to_log.shape == (3, E + 8) and pl.num_physical == E + 8
    for layer in range(3):
        assert sorted(set(pl.phys_to_log[layer].tolist())) == list(range(E))  # every expert has a slot
        for e in range(E):
            slots = pl.log_to_phys[layer, e, :pl.replicas[layer, e]]
            assert (pl.phys_to_log[layer, slots] == e).all()
            assert (pl.log_to_phys[layer, e, pl.replicas[layer, e]:] == -1).all()
    flat = default_placement(2, E, 4, N)
    assert flat.replicas.sum() == 2 * (E + 4) and (flat.replicas >= 1).all()


def test_refusals_name_the_knob():
    with pytest.raises(ValueError, match="num_redundant_experts"):
        check_slots(E, 3, N)
    with pytest.raises(ValueError, match="num_redundant_experts"):
        check_slots(E, -1, N)
    with pytest.raises(ValueError, match="every logical expert"):
        placement_from(np.zeros((1, E), np.int32), E)


def test_eplb_config_parse_and_placement(tmp_path):
    import json

    from deepinfer_jax.sharding.eplb import EPLBConfig

    assert EPLBConfig.parse(None) == EPLBConfig()
    counts = tmp_path / "load.json"
    counts.write_text(json.dumps(skewed(2).tolist()))
    c = EPLBConfig.parse(json.dumps({"num_redundant_experts": 4, "expert_load": str(counts)}))
    pl = c.placement(2, E, N)
    assert pl.num_physical == E + 4 and (rank_loads(skewed(2), pl, N).max(1)
                                         < rank_loads(skewed(2), contiguous(2), N).max(1)).all()
    for bad, match in [({"window_size": 10}, "'window_size' is not supported"), ({"foo": 1}, "'foo' is not one of"),
                       ({"num_redundant_experts": -2}, "integer >= 0"), ("{", "not JSON")]:
        with pytest.raises(ValueError, match=match):
            EPLBConfig.parse(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(ValueError, match="expert_load"):
        EPLBConfig(4, str(counts)).placement(3, E, N)  # counts for 2 MoE layers, the model has 3
