"""runner/lowering.py on this CPU machine, lowering for CUDA (an sm_90 device assumed): a kernel met again in
another program is lowered once and that program's StableHLO is the same text as without the cache; and
lowering a Triton kernel no longer fails to import the `tt` dialect's Python module."""

from __future__ import annotations

import builtins

import jax
import jax.numpy as jnp

from deepinfer_jax.kernels.mla_decode import paged_mla_attention
from deepinfer_jax.runner import lowering

T, H, R, DR, PS, L, PAGES = 16, 16, 512, 64, 64, 2, 8


def _attention_args():
    s = jax.ShapeDtypeStruct
    return (s((T, H, R), jnp.bfloat16), s((T, H, DR), jnp.bfloat16), s((L, PAGES, PS, R + DR), jnp.bfloat16),
            s((), jnp.int32), s((T,), jnp.int32), s((T,), jnp.int32), s((T, 4), jnp.int32))


def _text(cuda_lowering, fn, *args) -> str:
    return cuda_lowering(fn, *args).as_text()


def _program(scale_out):
    """An outer program around the jitted kernel; `scale_out` makes each program's own HLO differ."""
    def fn(*args):
        return paged_mla_attention(*args, 0.1) * scale_out
    return fn


def test_a_kernel_met_again_is_lowered_once_and_lowers_to_the_same_text(cuda_lowering, monkeypatch):
    from jax._src.pallas.triton import lowering as triton_lowering

    cache = lowering.speed_up_kernel_lowering()
    assert isinstance(cache, lowering.TritonLoweringCache)
    assert lowering.speed_up_kernel_lowering() is cache  # idempotent
    args = _attention_args()
    first = _text(cuda_lowering, _program(2.0), *args)
    misses, hits = cache.misses, cache.hits
    second = _text(cuda_lowering, _program(3.0), *args)
    assert cache.misses == misses and cache.hits > hits  # the kernel's Triton module came from the cache
    assert "__gpu$xla.gpu.triton" in second

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", cache._lower)  # without the cache
    uncached = _text(cuda_lowering, _program(3.0), *args)
    assert second == uncached
    assert first != second  # (the programs differ outside the kernel)


def test_a_kernel_of_other_shapes_is_lowered_anew(cuda_lowering):
    cache = lowering.speed_up_kernel_lowering()
    s = jax.ShapeDtypeStruct
    args = list(_attention_args())
    _text(cuda_lowering, _program(2.0), *args)
    misses = cache.misses
    args[0], args[1] = s((2 * T, H, R), jnp.bfloat16), s((2 * T, H, DR), jnp.bfloat16)
    args[4:7] = [s((2 * T,), jnp.int32), s((2 * T,), jnp.int32), s((2 * T, 4), jnp.int32)]
    _text(cuda_lowering, _program(2.0), *args)
    assert cache.misses > misses


def test_lowering_a_kernel_imports_no_missing_dialect_module(cuda_lowering, monkeypatch):
    lowering.speed_up_kernel_lowering()
    failed = []
    real_import = builtins.__import__

    def counting_import(name, *a, **k):
        try:
            return real_import(name, *a, **k)
        except ImportError:
            failed.append(name)
            raise

    monkeypatch.setattr(builtins, "__import__", counting_import)
    s = jax.ShapeDtypeStruct
    # shapes no other test lowers, so the kernel's Triton lowering runs here
    args = list(_attention_args())
    args[2] = s((L, PAGES + 1, PS, R + DR), jnp.bfloat16)
    _text(cuda_lowering, _program(5.0), *args)
    assert not [n for n in failed if n.endswith(".tt")], failed
