"""Params that arrive while the engine warms up.

Warm-up traces, lowers and compiles the step programs from the params' shapes, dtypes and placements alone;
only its runs on padding need the values. A `PendingParams` holds that abstract tree at once and loads the
arrays on a thread of its own from `start()`, which the engine calls after measuring the device memory the
KV cache may take (the weights' bytes then come from the abstract tree, `bytes_on`). `result()` waits for the
arrays and checks them against the abstract tree leaf by leaf (tree structure, shape, dtype, placement: `fits`),
so a program compiled for the abstract tree takes them as they are; a mismatch is a loader bug and raises.

Invariant: `abstract` is exactly what `load()` returns, with every leaf a jax.ShapeDtypeStruct carrying the
sharding its array will have.

A loader that can place each leaf where it is told gives `load_to` (a tree like `abstract` whose leaves may name
another memory kind -> the params placed as it says, each leaf put there directly): `relocated` makes the params
pending for such a tree, so weights chosen for host memory (runner/weight_offload.py) go there straight from the
checkpoint and never take device memory.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import is_spec, spec_dtype
from deepinfer_jax.models.registry import param_specs

HOST_MEMORY = ("pinned_host", "unpinned_host")  # memory kinds of a device's host memory


def in_host_memory(abstract: Any) -> bool:
    """Whether the abstract leaf (or quantized weight's arrays) `abstract` is placed in a device's host memory."""
    return any(x.sharding.memory_kind in HOST_MEMORY for x in jax.tree.leaves(abstract))


def fits(abstract: jax.ShapeDtypeStruct, x: Any) -> bool:
    """Whether array `x` is what a program compiled for `abstract` takes: its shape, dtype and placement (an
    equivalent sharding: P() and P(None, None) place alike)."""
    return (tuple(x.shape) == tuple(abstract.shape) and jnp.dtype(x.dtype) == jnp.dtype(abstract.dtype)
            and x.sharding.is_equivalent_to(abstract.sharding, len(x.shape)))


class PendingParams:
    """The params' abstract tree now; the arrays from `load()` (on its own thread once started) later."""

    def __init__(self, abstract: Any, load: Callable[[], Any] | None = None,
                 load_to: Callable[[Any], Any] | None = None):
        self.abstract = abstract
        # () -> the params; run by start() on its own thread
        self.load = load if load is not None else (lambda: load_to(abstract))
        self.load_to = load_to  # (a placement tree like `abstract`) -> the params placed so; None: not offered
        self._future: Future | None = None
        self.seconds: float | None = None  # the load's wall seconds, its arrays ready (set when it ends)

    def relocated(self, abstract: Any) -> "PendingParams | None":
        """The params pending for `abstract` (the same shapes and dtypes, leaves perhaps in another memory kind),
        each leaf loaded straight onto its placement there; None where the loader does not offer `load_to`."""
        if self.load_to is None:
            return None
        return PendingParams(abstract, load_to=self.load_to)

    def bytes_on(self, device: Any) -> int:
        """Bytes the arrays will take on `device` (its shards of them; leaves placed in its host memory,
        runner/weight_offload.py, take none)."""
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(self.abstract)
                   if device in x.sharding.device_set and x.sharding.memory_kind not in HOST_MEMORY)

    def start(self) -> None:
        """Start loading on a thread of its own (a second call does nothing)."""
        if self._future is not None:
            return
        self._future = Future()

        def run(future: Future = self._future) -> None:
            try:
                t = time.perf_counter()
                params = jax.block_until_ready(self.load())
                self.seconds = time.perf_counter() - t
                future.set_result(params)
            except BaseException as e:  # noqa: BLE001 - re-raised by result() on the engine's thread
                future.set_exception(e)

        # Not a daemon: should the engine fail while the weights load, the interpreter waits for the load at exit
        # instead of tearing JAX down under it (a segfault).
        threading.Thread(target=run, name="deepinfer-load-weights").start()

    def result(self) -> Any:
        """The loaded params (starting the load if nobody did), checked against `abstract`; re-raises the load's
        error."""
        self.start()
        params = self._future.result()
        want, got = jax.tree.structure(self.abstract), jax.tree.structure(params)
        if want != got:
            raise RuntimeError(f"the loaded params' tree {got} is not the announced {want}")
        for (path, a), x in zip(jax.tree_util.tree_flatten_with_path(self.abstract)[0], jax.tree.leaves(params)):
            if not fits(a, x):
                raise RuntimeError(f"the loaded param {jax.tree_util.keystr(path)} is {x.shape} {x.dtype} on "
                                   f"{x.sharding}, announced as {a.shape} {a.dtype} on {a.sharding}")
        return params


def abstract_from_specs(cfg: ModelConfig, dtype: Any, shardings: Any = None) -> Any:
    """The params' abstract tree from the model's param specs (every leaf in `dtype` where the spec says "model";
    `shardings`: a params-shaped tree of shardings, None: the default device)."""
    specs = param_specs(cfg)
    if isinstance(shardings, dict) and "mtp" in shardings and "mtp" not in specs:
        # Shardings built from config.json's declared MTP layers for a checkpoint that has none: MTP is absent.
        shardings = {k: v for k, v in shardings.items() if k != "mtp"}
    if shardings is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: default, specs, is_leaf=is_spec)
    return jax.tree.map(lambda spec, sh: jax.ShapeDtypeStruct(spec.shape, spec_dtype(spec, dtype), sharding=sh),
                        specs, shardings, is_leaf=is_spec)
