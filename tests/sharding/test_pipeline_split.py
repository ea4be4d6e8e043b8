"""Pipeline stages without devices: vLLM's layer split, each stage's share of the segments, of the weights
(`deepinfer plan`) and of the step's communication (sharding/comm.py), and the refusals."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.engine.plan import weight_bytes_per_device
from deepinfer_jax.models.params import Segment
from deepinfer_jax.models.pipeline import pipeline_stages, pp_layer_ranges, stage_segments
from deepinfer_jax.sharding import ParallelConfig
from deepinfer_jax.sharding.comm import step_bytes, step_collectives

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(preset: str, **kw) -> ModelConfig:
    with open(os.path.join(REPO, "configs", "models", f"{preset}.json")) as f:
        return dataclasses.replace(ModelConfig.from_hf_dict(json.load(f)), **kw)


# vLLM's get_pp_indices (vllm/distributed/utils.py): num_layers // pp each, the remainder one layer each to the
# stages just before the last.
@pytest.mark.parametrize("layers, pp, sizes", [
    (5, 2, [3, 2]), (5, 4, [1, 1, 2, 1]), (7, 4, [2, 2, 2, 1]), (8, 4, [2, 2, 2, 2]), (61, 4, [15, 15, 16, 15]),
    (61, 8, [7, 7, 8, 8, 8, 8, 8, 7]), (27, 1, [27]),
])
def test_layer_split_is_vllms(layers, pp, sizes):
    ranges = pp_layer_ranges(layers, pp)
    assert [b - a for a, b in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(ranges[i][1] == ranges[i + 1][0] for i in range(pp - 1))  # contiguous


def test_fewer_layers_than_stages_is_refused():
    with pytest.raises(ValueError, match=r"num_hidden_layers = 3 is below --pipeline-parallel-size 4"):
        pp_layer_ranges(3, 4)


def test_stage_segments_cut_the_stacked_segments():
    cfg = _cfg("tiny-deepseek-v3", num_hidden_layers=5)  # layer 0 dense, 1-4 MoE
    s0, s1 = pipeline_stages(cfg, 2)
    assert [(x.index, x.layers, x.local, x.offset) for x in stage_segments(cfg, s0)] == [
        (0, Segment("dense", 0, 1), Segment("dense", 0, 1), 0), (1, Segment("moe", 1, 3), Segment("moe", 1, 3), 0)]
    assert [(x.index, x.layers, x.local, x.offset) for x in stage_segments(cfg, s1)] == [
        (1, Segment("moe", 3, 5), Segment("moe", 0, 2), 2)]


def test_stage_weight_bytes_add_up_to_the_model():
    cfg = _cfg("deepseek-v3", num_nextn_predict_layers=0)
    for tp, dp, ep, pp in ((1, 1, False, 4), (8, 1, True, 2), (2, 4, True, 8)):
        pc = ParallelConfig(tp, dp, ep, pp)
        stages = [weight_bytes_per_device(cfg, "bfloat16", pc, stage=st) for st in pipeline_stages(cfg, pp)]
        assert sum(stages) == weight_bytes_per_device(cfg, "bfloat16", pc)


def test_pipeline_communication_per_stage():
    cfg = _cfg("deepseek-v3")
    one = step_collectives(cfg, ParallelConfig(4, 1), 64, 64)
    pc = ParallelConfig(4, 1, False, 4)
    per_stage = [step_collectives(cfg, pc, 64, 64, stage=st) for st in pipeline_stages(cfg, 4)]

    def count(rows, what):
        return sum(c.per_step for c in rows if c.what == what)

    for what in {c.what for c in one}:  # every collective of one model, each layer's on its stage only
        assert sum(count(rows, what) for rows in per_stage) == count(one, what), what
    hidden = [[c for c in rows if c.axis == "pipe" and "hidden" in c.what] for rows in per_stage]
    assert [[c.kind for c in h] for h in hidden] == [["send"], ["receive", "send"], ["receive", "send"], ["receive"]]
    assert all(c.bytes_per_device == 64 * cfg.hidden_size * 2 for h in hidden for c in h)
    assert step_bytes(cfg, pc, 64, 64) == max(sum(c.step_bytes for c in rows) for rows in per_stage)


def test_too_few_devices_is_refused():
    import jax

    from deepinfer_jax.sharding.pipeline import build_pipeline_sharding

    cfg = _cfg("tiny-deepseek-v3")
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 2 x --tensor-parallel-size 1 x "
                                         r"--data-parallel-size 1 needs 2 devices; 1 available"):
        build_pipeline_sharding(cfg, ParallelConfig(1, 1, False, 2), jax.devices()[:1])


# ---- micro-batches (runner/micro_batches.py) ----------------------------------------------------------------------
def test_micro_batch_split_places_every_row_once_and_restores_the_order():
    from types import SimpleNamespace

    import numpy as np

    from deepinfer_jax.runner.inputs import Shapes
    from deepinfer_jax.runner.micro_batches import choose, gather_index, split_balanced

    counts = [5, 1, 1, 6, 1, 3]
    parts = split_balanced(counts, 3)
    assert sorted(i for p in parts for i in p) == list(range(6))  # every row exactly once
    assert all(p == sorted(p) for p in parts)  # plan order kept inside a part
    assert sorted(sum(counts[i] for i in p) for p in parts) == [5, 6, 6]

    shapes = Shapes(buckets=(8, 16, 32), max_num_seqs=8, max_pages=4, page_size=8, max_model_len=32)
    ranks = [[SimpleNamespace(token_ids=[0] * n) for n in c] for c in (counts, [4, 4, 2])]  # DP 2
    split = choose(ranks, shapes, 32, stages=3)
    assert (split.count, split.bucket) == (3, 8)  # 6 x 8 token slots in the pipe, against 3 x 32 unsplit
    step_rows, micro_rows = shapes.seq_rows(32), shapes.seq_rows(8)
    index = gather_index(split, 2, step_rows, micro_rows)
    assert index.shape == (2, step_rows)
    # each rank's rows of the micro-batches' logits, one micro-batch after another, tagged (rank, its row in the step)
    rows = np.full((2, split.count * micro_rows, 2), -1)
    for k, per_rank in enumerate(split.parts):
        for r, idx in enumerate(per_rank):
            for j, i in enumerate(idx):
                rows[r, k * micro_rows + j] = (r, i)
    for r, group in enumerate(ranks):  # the step's rows back in order, each from its own rank
        assert rows[r][index[r, :len(group)]].tolist() == [[r, i] for i in range(len(group))]


def test_micro_batches_only_where_they_shorten_the_pipe():
    from types import SimpleNamespace

    from deepinfer_jax.runner.inputs import Shapes
    from deepinfer_jax.runner.micro_batches import candidates, choose

    shapes = Shapes(buckets=(8, 16, 32), max_num_seqs=4, max_pages=4, page_size=8, max_model_len=32)

    def seqs(*lens):
        return [[SimpleNamespace(token_ids=[0] * n) for n in lens]]

    assert choose(seqs(8, 8, 8, 8), shapes, 32, stages=2).bucket == 16  # 3 x 16 against 2 x 32
    assert choose(seqs(24, 4), shapes, 32, stages=2) is None  # a 24-token chunk needs the 32 bucket anyway
    assert choose(seqs(30), shapes, 32, stages=4) is None  # one sequence: nothing to split
    assert choose(seqs(8, 8, 8, 8), shapes, 32, stages=1) is None  # no pipeline
    assert candidates(shapes, 8, 2) == []  # the smallest bucket
    decode = Shapes(buckets=(16, 32), max_num_seqs=32, max_pages=4, page_size=8, max_model_len=32)
    assert choose([[SimpleNamespace(token_ids=[0])] * 20], decode, 32, stages=2) is None  # a decode bucket


def test_micro_batched_step_communication():
    """A step run as M micro-batches (sharding/comm.py `micro`): each stage program's collectives M times at the
    micro-batch's size, among them the hidden states between stages (M x b token rows in all); the sampled ids
    once, at the step's size."""
    cfg = _cfg("deepseek-v3")
    pc = ParallelConfig(4, 2, True, 2)
    for st in pipeline_stages(cfg, 2):
        whole = {c.what: c for c in step_collectives(cfg, pc, 256, 64, stage=st)}
        small = {c.what: c for c in step_collectives(cfg, pc, 128, 64, stage=st)}
        split = {c.what: c for c in step_collectives(cfg, pc, 256, 64, stage=st, micro=(2, 128, 64))}
        assert set(split) == set(whole)
        for what, c in split.items():
            want = whole[what] if "sampled ids" in what else dataclasses.replace(small[what],
                                                                                 per_step=2 * small[what].per_step)
            assert c == want, what
        hidden = [c for c in split.values() if c.axis == "pipe" and "hidden" in c.what]
        assert [c.step_bytes for c in hidden] == [2 * 128 * cfg.hidden_size * 2]
