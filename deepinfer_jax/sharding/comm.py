"""The communication a step costs under a layout: every collective, its mesh axes and its bytes per device.

A prediction for the multi-GPU runs to check, from the model's config and the layout alone (no JAX). It
follows the layout of rules.py and the sharded code paths of the model:

- embedding lookup with the vocab split over "tensor": each device looks up the ids in its rows, then an
  all-reduce of [T_r, D] over "tensor" (T_r: the step's tokens of one data rank);
- attention: heads over "tensor", o_proj's partial sums all-reduced, [T_r, D] over "tensor", per layer; the
  latent cache is split by pages over "data" and each rank attends to its own tokens (nothing moves);
- dense MLP and shared experts: intermediate dim over "tensor", [T_r, D] all-reduced over "tensor";
- routed experts (models/moe.py experts_sharded, experts or their width over "data" x "tensor"): x [T_r, D]
  and the routing (weights f32 and ids int32, [T_r, k]) all-gathered over "data", the fp32 partial outputs
  [T, D] reduce-scattered over "data" and [T_r, D] fp32 summed over "tensor";
- or, with all2all_backend "all_to_all" (models/moe_a2a.py), over the EP group ("data" x "tensor", axis
  "expert" below): the largest send count (an int32 pmax), then all-to-alls of C rows for each device: x
  [C, D], the routing (weights f32, ids int32, [C, k]) and the fp32 outputs [C, D] back (XLA splits each into a
  tuple of one [1, C, ...] piece a device), then the T_s-token slices of a data rank all-gathered over "tensor"
  (T_s = ceil(T_r / TP)). C is a branch of the capacity ladder (moe_a2a.capacity_ladder): T_s in the worst
  case, the default here; `a2a_capacity` predicts a balanced step's smaller branch;
- the last token of each sequence: its hidden state [S_r, D] taken from the data-split tokens (an all-reduce
  over "data"; S_r: the sequence rows of one data rank);
- logits: lm_head's vocab columns over "tensor", each device's [S_r, V / TP] slice gathered, [S_r, V] fp32
  over "tensor" (models/deepseek.py _logits constrains them, or XLA would gather the lm_head weight instead);
- the sampled ids [S] (int32) gathered over "data", so every device holds the step's results;
- DeepSeek-V4 (rules.py v4_rules; its data-parallel attention and pipeline stages refused): every device runs the
  step's tokens whole, so a layer all-reduces [T, D] over "tensor" once for the attention where its query heads
  split (the partial outputs of the output groups, in the engine dtype) and once for the MoE (fp32: the routed
  experts' partial sums with the shared expert's, whether its width is split or whole); the vocab is whole, so the
  embedding and the logits move nothing;
- pipeline parallelism (runner/pipeline.py): a device runs its stage's layers only, so the per-layer collectives
  above count that stage's layers, the embedding's only on the first stage and the last tokens', the logits' and
  the sampled ids' only on the last; between stages the hidden states [T_r, D] go point to point from each device
  of a stage to the devices of the next holding the same data rank (one "send" on the stage before, one "receive"
  on the stage after), and the sampled ids [dp x S] (int32) go from the last stage back to the first, whose
  embedding reads them as the next step's tokens. `step_collectives(..., stage=)` gives one stage's list;
  `step_bytes` the busiest stage's total. A step run as M micro-batches (runner/micro_batches.py; `micro=`) runs
  every stage program once a micro-batch, at the micro-batch's size, so their collectives and the hidden states
  between stages come M times at that size; the sampled ids' once a step, at the step's.

Bytes are per device and per occurrence, as a ring algorithm moves them: an all-reduce of B bytes over n
devices sends 2 (n - 1) / n B, an all-gather of a result of B bytes receives (n - 1) / n B, a reduce-scatter
of an input of B bytes (n times its result) sends (n - 1) / n B, an all-to-all of a buffer of B bytes (n pieces,
one a device) sends the (n - 1) / n B of the other devices' pieces. XLA may fuse neighbouring all-reduces into
one (the routed experts' sum over "tensor" with the shared experts'), which changes the count of collectives,
not the bytes. Small metadata moves (collective-permutes of the step's int32 inputs) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.pipeline import PipelineStage, pipeline_stages
from deepinfer_jax.sharding.mesh import ParallelConfig


@dataclass(frozen=True)
class Collective:
    what: str  # "attention o_proj", "routed experts: gather x", ...
    kind: str  # "all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all" | "send" | "receive" (point to point)
    axis: str  # "tensor" | "data" | "expert" (the EP group: "data" x "tensor") | "pipe" (between pipeline stages)
    shape: tuple[int, ...]  # the collective's result on one device, as the compiled HLO shows it
    dtype_bytes: int
    per_step: int  # occurrences per step (layers)
    bytes_per_device: int  # per occurrence

    @property
    def step_bytes(self) -> int:
        return self.per_step * self.bytes_per_device


def _ring(kind: str, nbytes: int, n: int) -> int:
    if n <= 1:
        return 0
    if kind in ("send", "receive"):
        return nbytes
    factor = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return int(round(factor * nbytes))


def step_collectives(cfg: ModelConfig, pc: ParallelConfig, tokens: int, seqs: int, dtype_bytes: int = 2,
                     stage: PipelineStage | None = None, a2a_capacity: int | None = None,
                     micro: tuple[int, int, int] | None = None) -> list[Collective]:
    """The collectives of one step of `tokens` token slots and `seqs` sequence rows per data-parallel rank
    (a padded bucket: token_buckets and seq_rows), in the engine dtype of `dtype_bytes` bytes. With pipeline
    parallelism, those of a device of `stage` (models/pipeline.py; None: the first). `a2a_capacity`: the rows a
    device for the all-to-all dispatch (None: the worst case, T_s). `micro`: (M, b, S_b), the step run as M
    micro-batches of b token slots and S_b sequence rows a data rank (module docstring)."""
    if micro is not None:
        m, b, sb = micro
        whole = {c.what: c for c in step_collectives(cfg, pc, tokens, seqs, dtype_bytes, stage, a2a_capacity)
                 if "sampled ids" in c.what}  # the sampler's, once a step
        return [whole[c.what] if c.what in whole else replace(c, per_step=c.per_step * m)
                for c in step_collectives(cfg, pc, b, sb, dtype_bytes, stage, a2a_capacity)]
    if cfg.family == "deepseek_v4":
        return _v4_collectives(cfg, pc, tokens, dtype_bytes)
    tp, dp = pc.tensor_parallel_size, pc.data_parallel_size
    D, k = cfg.hidden_size, cfg.num_experts_per_tok
    if stage is None:
        stage = pipeline_stages(cfg, pc.pipeline_parallel_size)[0]
    layers = range(stage.start, stage.stop)
    n_moe = sum(1 for i in layers if cfg.is_moe_layer(i))
    n_dense = len(layers) - n_moe
    first, last = stage.first, stage.last
    out: list[Collective] = []

    def add(what, kind, axis, shape, nbytes_each, per_step):
        n = {"tensor": tp, "data": dp, "expert": tp * dp, "pipe": pc.pipeline_parallel_size}[axis]
        size = nbytes_each * (n if kind in ("reduce-scatter", "all-to-all") else 1)  # n results, n pieces
        for s in shape:
            size *= s
        b = _ring(kind, size, n)
        if b and per_step:
            out.append(Collective(what, kind, axis, tuple(shape), nbytes_each, per_step, b))

    add("embedding lookup (vocab split)", "all-reduce", "tensor", (tokens, D), dtype_bytes, int(first))
    add("pipeline: sampled ids in (from last stage)", "receive", "pipe", (dp * seqs,), 4, int(first and not last))
    add("pipeline: hidden states in (stage before)", "receive", "pipe", (tokens, D), dtype_bytes, int(not first))
    add("attention o_proj", "all-reduce", "tensor", (tokens, D), dtype_bytes, len(layers))
    add("dense MLP down", "all-reduce", "tensor", (tokens, D), dtype_bytes, n_dense)
    if cfg.n_shared_experts:
        add("shared experts down", "all-reduce", "tensor", (tokens, D), dtype_bytes, n_moe)
    if n_moe and pc.all2all_backend == "all_to_all" and pc.expert_parallel_size > 1:
        Ts = -(-tokens // tp)
        C = Ts if a2a_capacity is None else a2a_capacity
        add("routed experts: largest send count", "all-reduce", "expert", (), 4, n_moe)
        add("routed experts: all-to-all x", "all-to-all", "expert", (1, C, D), dtype_bytes, n_moe)
        add("routed experts: all-to-all routing weights", "all-to-all", "expert", (1, C, k), 4, n_moe)
        add("routed experts: all-to-all routing ids", "all-to-all", "expert", (1, C, k), 4, n_moe)
        add("routed experts: all-to-all y back (fp32)", "all-to-all", "expert", (1, C, D), 4, n_moe)
        add("routed experts: gather y slices over tensor", "all-gather", "tensor", (Ts * tp, D), dtype_bytes, n_moe)
    elif n_moe and (dp > 1 or tp > 1):
        add("routed experts: gather x", "all-gather", "data", (dp * tokens, D), dtype_bytes, n_moe)
        add("routed experts: gather routing", "all-gather", "data", (dp * tokens, k), 8, n_moe)  # f32 + int32
        add("routed experts: reduce-scatter y (fp32)", "reduce-scatter", "data", (tokens, D), 4, n_moe)
        add("routed experts: sum y over tensor (fp32)", "all-reduce", "tensor", (tokens, D), 4, n_moe)
    add("pipeline: hidden states out (next stage)", "send", "pipe", (tokens, D), dtype_bytes, int(not last))
    add("last tokens' hidden states", "all-reduce", "data", (seqs, D), dtype_bytes, int(last))
    # The padding columns go before the gather: XLA gathers the vocab_size columns, rounded up to a multiple of TP.
    add("logits (vocab gathered, fp32)", "all-gather", "tensor", (seqs, -(-cfg.vocab_size // tp) * tp), 4, int(last))
    add("sampled ids", "all-gather", "data", (dp * seqs,), 4, int(last))
    add("pipeline: sampled ids out (to stage 0)", "send", "pipe", (dp * seqs,), 4, int(last and not first))
    return out


def _v4_collectives(cfg: ModelConfig, pc: ParallelConfig, tokens: int, dtype_bytes: int) -> list[Collective]:
    """DeepSeek-V4's collectives of one step of the main model's layers (module docstring)."""
    from deepinfer_jax.sharding.rules import v4_splits_attention

    tp, L, D = pc.tensor_parallel_size, cfg.num_hidden_layers, cfg.hidden_size
    out = []
    for what, nbytes, per_step in (("attention output groups (heads split)", dtype_bytes,
                                    L if v4_splits_attention(cfg, pc) else 0),
                                   ("MoE: routed + shared experts (fp32)", 4, L)):
        b = _ring("all-reduce", nbytes * tokens * D, tp)
        if b and per_step:
            out.append(Collective(what, "all-reduce", "tensor", (tokens, D), nbytes, per_step, b))
    return out


def step_bytes(cfg: ModelConfig, pc: ParallelConfig, tokens: int, seqs: int, dtype_bytes: int = 2,
               a2a_capacity: int | None = None, micro: tuple[int, int, int] | None = None) -> int:
    """Bytes one device sends or receives in collectives during one step (step_collectives summed); with
    pipeline parallelism, a device of the busiest stage."""
    return max(sum(c.step_bytes for c in step_collectives(cfg, pc, tokens, seqs, dtype_bytes, st, a2a_capacity,
                                                          micro))
               for st in pipeline_stages(cfg, pc.pipeline_parallel_size))


def format_table(cfg: ModelConfig, pc: ParallelConfig, tokens: int, seqs: int, dtype_bytes: int = 2,
                 a2a_capacity: int | None = None) -> str:
    """step_collectives as a text table, with the total per device (a table a pipeline stage)."""
    pp = pc.pipeline_parallel_size
    lines = []
    for st in pipeline_stages(cfg, pp):
        rows = step_collectives(cfg, pc, tokens, seqs, dtype_bytes, st, a2a_capacity)
        head = (f"TP={pc.tensor_parallel_size} DP={pc.data_parallel_size} EP={pc.expert_parallel_size}"
                f"{' all_to_all' if pc.all2all_backend == 'all_to_all' and pc.expert_parallel_size > 1 else ''}"
                f"{'' if a2a_capacity is None else f' (C={a2a_capacity})'}"
                + (f" PP={pp}, stage {st.rank} (layers {st.start}-{st.stop - 1})" if pp > 1 else "")
                + f": {tokens} tokens, {seqs} rows a data rank")
        lines += [head, f"  {'collective':44s} {'kind':15s} {'axis':6s} {'per step':>8s} {'MiB/device':>11s}"]
        for c in rows:
            lines.append(f"  {c.what:44s} {c.kind:15s} {c.axis:6s} {c.per_step:8d} {c.step_bytes / 2**20:11.3f}")
        lines.append(f"  {'total':44s} {'':15s} {'':6s} {'':8s} {sum(c.step_bytes for c in rows) / 2**20:11.3f}")
    return "\n".join(lines)
