"""A step program's host-side packing and resident buffers (runner/model_runner.py runs the programs).

A step's inputs travel as one int32 buffer (`packed`: meta ints, meta floats, sampling ints, sampling floats,
floats bit-cast; runner/packing.py) into a program's resident inbox (`Resident`), which the program splits again
(`split_inbox`); its results come back packed in its resident outbox, copied out for the host (`extract_results`,
`StepOut`). Placeholder token ids name the previous step's samples on the device (`resolve_placeholders`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.runner.inputs import HostStep
from deepinfer_jax.runner.packing import Layout, bits_size, pack, unpack_bits


def resolve_placeholders(meta, st, prev_tokens):
    """Replace placeholder ids (<= -2, see ModelRunner.dispatch) with the previous step's samples, in
    the metadata's token ids and the sampling penalty histories (either may be None)."""
    def sub(ids):
        return jnp.where(ids <= -2, prev_tokens[jnp.maximum(-ids - 2, 0)], ids)

    if meta is not None:
        meta = dataclasses.replace(meta, token_ids=sub(meta.token_ids))
    if st is not None:
        st = dataclasses.replace(st, output_token_ids=sub(st.output_token_ids))
    return meta, st


def packed(host: HostStep):
    """(the step program's key: (meta layout, sampling variant, sampling layout), the packed host inputs as
    one int32 array: meta ints, meta floats, sampling ints, sampling floats, floats bit-cast)."""
    (mi, mf, ml), (si, sf, sl) = pack(host.meta), pack(host.sampling)
    return (ml, host.variant, sl), np.concatenate([mi, mf.view(np.int32), si, sf.view(np.int32)])


def meta_struct(meta_layout: Layout):
    """The StepMetadata of a meta layout, its leaves jax.ShapeDtypeStructs."""
    return jax.tree.unflatten(meta_layout.treedef, [jax.ShapeDtypeStruct(shape, dtype)
                                                    for _, shape, dtype, _ in meta_layout.leaves])


def split_inbox(inbox, parts):
    """int32 [sum(parts)] -> (meta ints, meta floats, sampling ints, sampling floats); floats bit-cast."""
    out, off = [], 0
    for i, n in enumerate(parts):
        a = jax.lax.slice(inbox, (off,), (off + n,))
        out.append(jax.lax.bitcast_convert_type(a, jnp.float32) if i % 2 else a)
        off += n
    return out


def extract_results(outbox, n_sampled: int, routing_shape: tuple[int, ...] | None,
                    load_shape: tuple[int, ...] | None = None, load=None):
    """Copies of the packed sampled tokens (for the host) and of the routed expert ids (when collected:
    int32 [num_moe_layers, T, k]), so that the next step can overwrite the outbox; with `load_shape` (the step
    counts the expert load: RunnerConfig.count_expert_load) also `load` [num_moe_layers, E] plus the step's
    counts, which the outbox holds last."""
    n_routing = 0 if routing_shape is None else math.prod(routing_shape)
    routing = None if routing_shape is None else outbox[n_sampled:n_sampled + n_routing].reshape(routing_shape)
    sampled = jnp.array(outbox[:n_sampled], copy=True)
    if load_shape is None:
        return sampled, routing
    return sampled, routing, load + outbox[n_sampled + n_routing:].reshape(load_shape)


@dataclass
class Resident:
    """One step program's resident buffers: `inbox` int32 [sum(parts)] holds the step's packed inputs
    (meta ints, meta floats, sampling ints, sampling floats; floats bit-cast; only the sampling ones where the
    step shares its bucket's forward: StepPrograms.shares_forward), rewritten in place by the runner's
    staging program (ModelRunner.run); `outbox` int32 holds its results (pack_bits of (SampleOutput, routing,
    load)): the sampled tokens first (`sampled_layout`), rewritten in place by the step."""
    parts: tuple[int, int, int, int]
    inbox: Any
    outbox: Any
    sampled_layout: Layout
    routing_shape: tuple[int, ...] | None
    load_shape: tuple[int, ...] | None = None  # the step's expert load counts [num_moe_layers, E], after routing

    @property
    def n_sampled(self) -> int:
        return bits_size(self.sampled_layout)


@dataclass
class StepOut:
    """One queued step's results on the device: `buf`, its packed SampleOutput (int32, unpacked with
    `layout`); `routing`, the routed expert ids (None unless RunnerConfig.collect_routing)."""
    buf: Any
    layout: Layout
    routing: Any

    def block_until_ready(self) -> "StepOut":
        self.buf.block_until_ready()
        return self

    def copy_to_host_async(self) -> None:
        self.buf.copy_to_host_async()

    def to_host(self):
        """The step's SampleOutput with numpy leaves (waits for the step)."""
        buf = self.buf if self.buf.is_fully_addressable else self.buf.addressable_data(0)  # several hosts: replicated
        return unpack_bits(np.asarray(buf), self.layout)


@dataclass
class StepResult:
    token_ids: dict[str, int]
    logprobs: dict[str, tuple[float, list[int], list[float]]]  # rid -> (sampled lp, top ids, top lps)
    # Speculative steps (HostStep.spec_width > 1): rid -> the tokens the step emits (its accepted drafts and the
    # token of its first rejected or bonus position; token_ids holds the last), and their logprobs (full variant)
    spec_token_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    spec_logprobs: dict[str, list[tuple[float, list[int], list[float]]]] = dataclasses.field(default_factory=dict)
    # `deepseek_mtp`: rid -> the K drafts the MTP proposed after the step's last accepted position
    mtp_drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)


def step_result(host: HostStep, sampled) -> StepResult:
    """A step's SampleOutput on the host (`StepOut.to_host`) -> each sampling row's token id by request, and where
    the step ran the full variant (`host.penalties`), its logprob and top logprobs. With speculation each
    sequence row r has rows r * W ..: its tokens are those up to its first row that did not accept its draft."""
    result = StepResult({}, {})
    full = host.penalties
    W = host.spec_width

    def lp(row):
        return (float(sampled.logprob[row]), sampled.top_logprob_ids[row].tolist(),
                sampled.top_logprobs[row].tolist())

    for row in host.sample_rows:
        rid = host.request_ids[row]
        if W == 1:
            result.token_ids[rid] = int(sampled.token_ids[row])
            if full:
                result.logprobs[rid] = lp(row)
            continue
        rows = []
        for j in range(W):
            rows.append(row * W + j)
            if not sampled.accepted[row * W + j]:
                break
        tokens = [int(sampled.token_ids[i]) for i in rows]
        if sampled.drafts is not None:
            result.mtp_drafts[rid] = sampled.drafts[row].tolist()
        result.spec_token_ids[rid] = tokens
        result.token_ids[rid] = tokens[-1]
        if full:
            result.spec_logprobs[rid] = [lp(i) for i in rows]
            result.logprobs[rid] = result.spec_logprobs[rid][-1]
    return result
