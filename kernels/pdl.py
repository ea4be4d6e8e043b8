"""Programmatic dependent launch (PDL) from our Pallas-Triton kernels: the next kernel starts launching while
this one still runs.

On Hopper, XLA launches every kernel of a step's CUDA graph with PDL (benchmarks/RESULTS.md, session 18: our
Pallas kernels included). A kernel so launched may start as soon as every program (CTA) of the kernel before it
has executed `griddepcontrol.launch_dependents` or exited; it must execute `griddepcontrol.wait`, which returns
once that kernel has finished and its writes are visible, before it touches that kernel's data. XLA's Triton
pipeline (xtile_compiler.cc: CompileTritonToLLVM, InsertPDLPass) puts a wait at the entry of every Triton kernel
it compiles with PDL on, ours included, but signals `launch_dependents` only in its own Triton GEMMs. So the
kernel after one of ours begins to launch only when ours has exited, and pays its launch and ramp after it.

`program_id(axis, family)` is `pl.program_id(axis)`; where the trace-time setting `launching` names the kernel's
family, the program first executes `griddepcontrol.wait; griddepcontrol.launch_dependents` (inline PTX, kept
in place: Triton may neither drop nor reorder it, and its result, 0, is added to the id). The next kernel then
launches once every program of this one has started, its programs take the SMs' free slots and wait there, and
run the moment this one ends. The wait is ours as well as XLA's so that no successor of ours can start before
our predecessor has finished, whichever pipeline compiled it.

Invariants:
  * The outputs are the same with and without it (interpret mode runs the id unchanged); only the launch order
    moves. `launch_dependents` is not a memory fence: it is safe because every kernel launched with PDL waits
    before it reads or writes (XLA's kernels and ours), so a successor never sees this kernel's data early.
  * The setting is part of JAX's trace context and jit keys (as `jax.default_matmul_precision` is): a kernel
    wrapper jitted under one setting is traced again under another, never reused.
  * sm_90 or newer (the PTX instructions exist from Hopper on); off by default (RunnerConfig.launch_dependents).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from jax._src import config as jax_config
from jax._src import core as jax_core
from jax.interpreters import mlir

# The kernel families of a decode step that can signal early: the MoE launches (route_experts, residual_route's
# route launch, moe_route, moe_gmm), the query absorption and latent write (mla_absorb, mla_qkv), the decode
# attention (mla_decode), the split merge and W_UV (mla_output), the in-place projections (decode_matmul), the
# residual adds and RMSNorms in launches of their own (residual_route's residual_norm and combine_residual_norm).
FAMILIES = ("moe", "absorb", "attention", "output", "matmul", "norm")

_launching = jax_config.config_ext.Config[str]("deepinfer_launch_dependents", "", include_in_jit_key=True,
                                               include_in_trace_context=True)

# Executed by every thread of a program; the CTA's signal counts once. $0 is the dummy result the id adds.
ASM = "griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;"

_signal_p = jax_core.Primitive("deepinfer_launch_dependents")
_signal_p.def_impl(lambda: jnp.zeros((), jnp.int32))
_signal_p.def_abstract_eval(lambda: jax_core.ShapedArray((), jnp.int32))
# Everywhere but Triton (interpret mode on the CPU): the id unchanged.
mlir.register_lowering(_signal_p, mlir.lower_fun(lambda: jnp.zeros((), jnp.int32), multiple_results=False))


def _register_triton_lowering() -> None:
    """tt.elementwise_inline_asm with pure = false: Triton neither removes it nor moves memory accesses across it."""
    try:
        from jax._src.lib.triton import dialect as tt_dialect
        from jax._src.pallas.triton import lowering
    except ImportError:  # no Triton backend in this jaxlib: interpret mode only
        return

    def rule(ctx, **_):  # a scalar: Triton's i32, not a 0-d tensor
        i32 = lowering._dtype_to_ir_type(jnp.dtype(jnp.int32))
        return tt_dialect.elementwise_inline_asm([i32], ASM, constraints="=r", pure=False, packed_element=1, args=[])

    lowering.register_lowering(_signal_p)(rule)


_register_triton_lowering()


def parse(families: Iterable[str] | str | None) -> tuple[str, ...]:
    """'all' | 'none' | comma-separated names | names -> the sorted tuple of FAMILIES they name (ValueError on
    others)."""
    if families is None or families == "none":
        return ()
    if families == "all":
        return tuple(sorted(FAMILIES))
    names = families.split(",") if isinstance(families, str) else list(families)
    bad = [n for n in names if n not in FAMILIES]
    if bad:
        raise ValueError(f"unknown kernel families {bad}; expected some of {FAMILIES}, 'all' or 'none'")
    return tuple(sorted(set(names)))


@contextlib.contextmanager
def launching(families: Iterable[str] | str | None):
    """Within this context (at trace time), the kernels of `families` signal their dependents early."""
    old = _launching.swap_local(",".join(parse(families)))
    try:
        yield
    finally:
        _launching.set_local(old)


def signals(family: str) -> bool:
    """Whether kernels of `family` signal early in the current trace context."""
    assert family in FAMILIES, family
    return family in _launching.value.split(",")


def program_id(axis: int, family: str) -> jax.Array:
    """`pl.program_id(axis)`, preceded by the wait and the early signal where `launching` names `family`. Call
    it before the kernel body's first read of an operand."""
    from jax.experimental import pallas as pl

    pid = pl.program_id(axis)
    return pid + _signal_p.bind() if signals(family) else pid
