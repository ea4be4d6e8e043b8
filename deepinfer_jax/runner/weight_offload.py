"""Weights in host memory (vLLM's `--cpu-offload-gb`): chosen param leaves live in pinned host memory and every
program that reads the params copies them to the device inside the program.

Which leaves (`choose`): a leaf is one weight of the param specs (models/params.py), a quantized weight's arrays
(q and scale) together. Routed experts first, then every other weight; within each group the least-touched
layers first: the MTP layers (read only with speculative decoding), then the layer segments from the deepest one
up, then the embedding, final norm and LM head; within a segment the largest leaf first. Without routing
statistics, depth stands for how rarely a weight is needed. Leaves are stacked per segment, so a segment's
routed experts (gate_up, down) are two leaves: the granularity is a whole segment's weight. DeepSeek-V4 keeps one
dict a layer (`layers`, its layers differ in kind): each V4 layer is a segment of one layer here. Each leaf in this
order is taken while it fits in what is left of the budget, so the offloaded bytes never exceed it.
`choose` is plain Python over (path, bytes): `deepinfer plan` (engine/plan.py) runs it on the specs' bytes and
the engine on the loaded arrays' bytes, so both pick the same leaves.

Placement (`offload`): the leaves go to the device's "pinned_host" memory (jax.sharding memory_kind); for params
still loading (weights/pending.py) the abstract tree announces that placement, so warm-up compiles the step
programs for it, and a loader offering `load_to` puts the chosen leaves there directly: Hugging Face (DeepSeek-V4's
too) and converted checkpoints straight from the files, never on the device; random weights drawn a leaf at a time
by programs whose output is in host memory. Any other load (`LoadFirst`) moves them once loaded. Inside a program,
`stream` copies the leaves outside the layer segments to the device (`to_device`: `jax.device_put(x, jax.memory.Space.Device)` on every leaf
whose memory space is the host's) and hands the forward `to_device` as its `layer_fetch`: the layer loop
(models/deepseek.py `run_layers`) slices each layer out of the stacked host leaves and copies that slice in;
DeepSeek-V4's (models/v4_paged.py `forward_paged`) copies a layer's own host leaves in inside a call of that layer.
So a step holds one layer's share of the offloaded layer weights at a time, not all of them (`copy_in_bytes` reads
both figures off a traced program; `step_window` computes the second from the choice, for `deepinfer plan`). XLA
schedules the copies (asynchronous host-to-device copies on a GPU). A leaf on the device passes through
unchanged, so without offload the programs are the same HLO as before.

What the device still holds: an offloaded slice is on the device only while its layer runs; between steps the
device holds only the other leaves, so the KV cache is sized with the offloaded bytes free
(runner/device_memory.py counts what is in use). A `LoadFirst` load places each leaf on the device before moving
it (the whole model must fit the device while it loads).
"""

from __future__ import annotations

import logging
from concurrent.futures import wait
from typing import Any, Iterable

import jax
import jax.extend
import numpy as np

from deepinfer_jax.weights.pending import PendingParams
from deepinfer_jax.xla_env import use_host_memory

log = logging.getLogger(__name__)
HOST_KIND = "pinned_host"
# Families whose layer loop copies each layer's offloaded weights in itself (`layer_fetch` of their forwards), and
# the params key of their layers: DeepSeek and dense stack them per segment (models/deepseek.py `run_layers` streams
# a segment's slices), DeepSeek-V4 keeps one dict a layer (models/v4_paged.py streams each layer's own).
STREAMING_FAMILIES = {"deepseek": "segments", "dense": "segments", "deepseek_v4": "layers"}
LAYER_KEYS = ("segments", "layers")


def _unit(x: Any) -> bool:
    """A param leaf: an array, an abstract one, or a quantized weight (a pytree of q and scale)."""
    return not isinstance(x, (dict, list, tuple))


def _in_layers(path: tuple) -> bool:
    """Whether `path` is inside a layer segment (`segments`, stacked layers) or a DeepSeek-V4 layer (`layers`, one
    layer each): path[1] is then its index."""
    return len(path) > 1 and path[0] in LAYER_KEYS and isinstance(path[1], int)


def _order(path: tuple, nbytes: int, num_segments: int) -> tuple:
    experts = "experts" in path and "shared" not in path
    if path and path[0] == "mtp":
        depth = num_segments + (path[1] if len(path) > 1 and isinstance(path[1], int) else 0)
    elif _in_layers(path):
        depth = path[1]
    else:
        depth = -1  # embed, final_norm, lm_head: read by every token
    return (not experts, -depth, -nbytes, tuple(map(str, path)))


def choose(leaves: Iterable[tuple[tuple, int]], budget: int) -> list[tuple]:
    """The paths of the leaves to offload: (path, bytes) pairs in the module doc's order, each taken while it fits
    in what is left of `budget` bytes. Paths are tuples of dict keys and list indices."""
    leaves = list(leaves)
    num_segments = 1 + max((p[1] for p, _ in leaves if _in_layers(p)), default=0)
    chosen, left = [], budget
    for path, n in sorted(leaves, key=lambda pn: _order(pn[0], pn[1], num_segments)):
        if 0 < n <= left:
            chosen.append(path)
            left -= n
    return chosen


def check_budget(gib: float, total: int) -> int:
    """`cpu_offload_gb` GiB -> bytes; a ValueError when it exceeds the model's weights (`total` bytes)."""
    budget = int(gib * 2**30)
    if budget > total:
        raise ValueError(f"cpu_offload_gb {gib:g} GiB exceeds the model's weights ({total / 2**30:.3f} GiB)")
    return budget


def step_window(chosen: Iterable[tuple[tuple, int]], segment_layers: list[int], family: str) -> int:
    """The most of the offloaded bytes a step holds on the device at once, from the chosen leaves' (path, bytes) and
    each layer segment's layer count: where the family streams them (STREAMING_FAMILIES), one layer's share of each
    chosen leaf of a segment, the largest segment's (DeepSeek-V4: each of its `layers` a one-layer segment of its
    own, `segment_layers` unused), plus the chosen leaves outside the layers (the MTP layers, the embedding, the LM
    head), copied in whole; in any other family every chosen byte."""
    chosen = list(chosen)
    if family not in STREAMING_FAMILIES:
        return sum(n for _, n in chosen)
    outside, per_segment = 0, {}
    for path, n in chosen:
        if _in_layers(path):
            share = n // segment_layers[path[1]] if path[0] == "segments" else n
            per_segment[path[:2]] = per_segment.get(path[:2], 0) + share
        else:
            outside += n
    return outside + max(per_segment.values(), default=0)


# ---- on the arrays ----------------------------------------------------------------------------------------------
def path_key(path) -> tuple:
    """A jax key path -> a tuple of dict keys and list indices (engine/plan.py's paths)."""
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        else:
            out.append(str(k))
    return tuple(out)


def _nbytes(unit: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(unit))


def param_leaves(params: Any) -> list[tuple[tuple, int]]:
    """(path, bytes) of every param leaf (`_unit`) of a params tree (arrays or abstract)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=_unit)
    return [(path_key(p), _nbytes(u)) for p, u in flat if u is not None]


def host_sharding(sharding: Any) -> Any:
    return sharding.with_memory_kind(HOST_KIND)


def check_backend() -> None:
    """A ValueError unless the first device has pinned host memory, usable (no VMM allocator on a GPU: xla_env)."""
    use_host_memory(1.0, None)
    kinds = [m.kind for m in jax.devices()[0].addressable_memories()]
    if HOST_KIND not in kinds:
        raise ValueError(f"cpu_offload_gb needs pinned host memory, which this backend lacks (its memories: {kinds})")


def _map_chosen(params: Any, chosen: set, fn) -> Any:
    def visit(path, unit):
        return jax.tree.map(fn, unit) if path_key(path) in chosen else unit

    return jax.tree_util.tree_map_with_path(visit, params, is_leaf=_unit)


def place(params: Any, chosen: set) -> Any:
    """The params with the `chosen` leaves' arrays moved to pinned host memory (the device copies dropped)."""
    return _map_chosen(params, chosen, lambda x: jax.device_put(x, host_sharding(x.sharding)))


def offload(params: Any, gib: float, sharding: Any = None) -> tuple[Any, int]:
    """Offload up to `gib` GiB of `params` (arrays, or a weights/pending.py PendingParams) -> (params with the chosen
    leaves in pinned host memory, or a `LoadFirst` announcing and doing so; the bytes offloaded). `gib` 0: the
    params as given. ValueErrors for a sharded model (`sharding` not None), a budget larger than the weights and a
    backend without pinned host memory."""
    if not gib:
        return params, 0
    if sharding is not None:
        raise ValueError("cpu_offload_gb is not supported with tensor, data or expert parallelism yet "
                         "(--tensor-parallel-size / --data-parallel-size above 1)")
    check_backend()
    tree = params.abstract if isinstance(params, PendingParams) else params
    leaves = param_leaves(tree)
    budget = check_budget(gib, sum(n for _, n in leaves))
    chosen = set(choose(leaves, budget))
    nbytes = sum(n for p, n in leaves if p in chosen)
    log.info("cpu_offload_gb %g: %d weight leaves, %.3f GiB, in pinned host memory", gib, len(chosen), nbytes / 2**30)
    if not isinstance(params, PendingParams):
        return place(params, chosen), nbytes
    abstract = _map_chosen(params.abstract, chosen, lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=host_sharding(a.sharding)))
    direct = params.relocated(abstract)  # the chosen leaves loaded straight into host memory
    if direct is not None:
        return direct, nbytes
    load = params.load
    return LoadFirst(abstract, lambda: place(load(), chosen)), nbytes


class LoadFirst(PendingParams):
    """Params whose load `start()` waits for, for a loader that cannot place a leaf in host memory itself (no
    `load_to`; every loader of this package offers it): the load holds every leaf on the device until it moves
    the chosen ones to the host, and the engine sizes the KV cache before it starts the load and makes the cache
    after, so the two never take the device at once."""

    def start(self) -> None:
        super().start()
        wait([self._future])  # its error, if any, is raised by result()


def on_host(x: Any) -> bool:
    """Whether array `x` (or a tracer of one) lives in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def to_device(params: Any) -> Any:
    """Inside a jitted program: the params with every leaf in host memory copied to the device (a no-op for the
    others)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x, params)


def stream(params: Any, family: str) -> tuple[Any, Any]:
    """Inside a jitted program, before the forward: (the params with every leaf in host memory outside the layers
    (`LAYER_KEYS`) copied to the device, the forward's `layer_fetch`: `to_device`, which its layer loop applies to
    each layer's weights: a segment's slice of the stacked leaves, or a DeepSeek-V4 layer's own), or for a family
    outside STREAMING_FAMILIES or params with no layer leaf in host memory (`to_device(params)`, None)."""
    key = STREAMING_FAMILIES.get(family)
    layers = params.get(key) if key is not None and isinstance(params, dict) else None
    if not any(on_host(x) for x in jax.tree.leaves(layers)):
        return to_device(params), None
    return {k: v if k == key else to_device(v) for k, v in params.items()}, to_device


def _subjaxprs(eqn) -> Iterable[tuple[Any, int]]:
    """(jaxpr, times it runs per run of `eqn`) of the jaxprs in `eqn`'s params: a scan's body `length` times,
    anything else (a call, a cond's branch, a loop of unknown trip count) once."""
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.Jaxpr):
                yield x, times


def copy_in_bytes(jaxpr: Any) -> tuple[int, int]:
    """(bytes one run of `jaxpr` copies from host memory to the device, the most of them it holds at once) as the
    jaxpr asks (a traced step program's `.jaxpr`). The most at once: this level's copies together, plus the most
    that one of the loop bodies or calls below holds, each of those held one iteration or call at a time. A program
    that copies whole stacked leaves holds them all; one whose layer loop copies its layer's slices holds one
    layer's. XLA's schedule decides the device's real peak (it may start a copy before the last use of the one
    before); `benchmarks/offload.py` prints the compiled program's memory figures beside this."""
    used = {id(v) for e in jaxpr.eqns for v in e.invars} | {id(v) for v in jaxpr.outvars}
    here, below_total, below_peak = 0, 0, 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for a, b in zip(eqn.invars, eqn.outvars):
                if (getattr(a.aval, "memory_space", None) == jax.memory.Space.Host and id(b) in used  # (jit drops
                        and getattr(b.aval, "memory_space", None) != jax.memory.Space.Host):  # an unused copy)
                    here += int(np.prod(b.aval.shape)) * np.dtype(b.aval.dtype).itemsize
        subs = [(copy_in_bytes(sub), times) for sub, times in _subjaxprs(eqn)]
        totals = [times * total for (total, _), times in subs]
        # a cond runs one of its branches; anything else runs each of its jaxprs
        below_total += (max(totals, default=0) if eqn.primitive.name == "cond" else sum(totals))
        below_peak = max([below_peak] + [peak for (_, peak), _ in subs])
    return here + below_total, here + below_peak


def host_bytes(params: Any) -> int:
    """Bytes of the params' arrays in host memory."""
    return sum(_nbytes(x) for x in jax.tree.leaves(params) if on_host(x))
