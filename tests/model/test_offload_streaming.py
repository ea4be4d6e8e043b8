"""forward_paged with layer weights in pinned host memory (--cpu-offload-gb, `layer_fetch`): with every decode
kernel switch on (Pallas interpret), a decode step equals the all-on-device forward's, the weights in host memory
taking the path that reads the layer's copy; the step copies one layer's slices at a time, and lowered for a GPU
(the Pallas-Triton kernels, straight-line layers asked for) each copy to the device is of one layer's slice."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from hf_models import CASES, COMMON
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.cache import StepMetadata, init_kv_cache
from deepinfer_jax.models.decode_kernels import decode_absorb_weights, decode_stacked
from deepinfer_jax.models.deepseek import forward_paged
from deepinfer_jax.models.params import init_params, layer_segments
from deepinfer_jax.runner.weight_offload import copy_in_bytes, place, to_device

PAGE = 16
SWITCHES = dict(fuse_shared_experts=True, fuse_moe_routing=True, decode_projection_kernel=True,
                decode_output_kernel=True, decode_absorb_kernel=True, decode_latent_kernel=True,
                moe_single_launch=True, decode_route_launch=True, decode_moe_launch=True)


def _decode_meta(ids, rows: int = 16) -> StepMetadata:
    """One sequence's token at position 11 in a 16-slot step of `rows` sequence rows (a decode-kernel step), the
    other slots padding into the null page."""
    tid, pos = np.zeros(16, np.int32), np.zeros(16, np.int32)
    slot = (np.arange(16) % PAGE).astype(np.int32)
    tid[0], pos[0], slot[0] = ids[11], 11, PAGE + 11
    table = np.zeros((rows, 4), np.int32)
    table[0, :2] = [1, 2]
    return StepMetadata(jnp.asarray(tid), jnp.asarray(pos), jnp.zeros(16, jnp.int32), jnp.asarray(slot),
                        jnp.asarray(table), jnp.zeros(rows, jnp.int32))


def _leaf(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_streamed_decode_step_equals_on_device(monkeypatch):
    cfg = ModelConfig.from_hf_dict({**COMMON, **CASES["v3_flat_plain_rope"]})
    params = init_params(cfg, seed=0, dtype=jnp.float32, std=0.05)
    segs = layer_segments(cfg)
    moe = next(i for i, s in enumerate(segs) if s.kind == "moe")
    # the MoE segment's experts, o_proj and kv_b_proj in host memory; the dense segment's kv_a_layernorm (its
    # absorb kernel still reading kv_b_proj in place)
    chosen = {("segments", moe, "moe", "experts", "gate_up"), ("segments", moe, "moe", "experts", "down"),
              ("segments", moe, "attn", "o_proj"), ("segments", moe, "attn", "kv_b_proj"),
              ("segments", 1 - moe, "attn", "kv_a_layernorm")}
    host = place(params, chosen)
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 16)
    meta, cache = _decode_meta(ids), init_kv_cache(cfg, 4, PAGE, jnp.float32)
    # on the device, the switches' kernels apply to both segments
    for sp in params["segments"]:
        assert ("attn", "o_proj") in decode_stacked(sp, 16, "pallas_interpret", None, True)
        assert decode_absorb_weights(sp, cfg, meta, "pallas_interpret", None, None, True) is not None

    def step(p, fetch, impl="pallas_interpret", unroll=1):
        return jax.jit(lambda p, c, m: forward_paged(p, cfg, c, m, attn_impl=impl, moe_impl=impl, layer_fetch=fetch,
                                                     unroll=unroll, **SWITCHES))

    want, _ = step(params, None)(params, cache, meta)
    got, _ = step(host, to_device)(host, cache, meta)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    # one layer's slices held at a time, the layers unrolled or not (a streamed segment runs under lax.scan): the
    # larger segment's share
    arrays = {p: jax.tree.leaves(_leaf(host, p)) for p in chosen}
    share = [sum(int(a.nbytes) // segs[p[1]].num_layers for p in chosen if p[1] == s for a in arrays[p])
             for s in range(len(segs))]
    total = sum(int(a.nbytes) for p in chosen for a in arrays[p])
    traced = step(host, to_device, "pallas", unroll=True).trace(host, cache, meta)
    # a one-layer segment is copied in whole before its layer (run_layers): counted beside the streamed share
    whole = sum(share[s] for s in range(len(segs)) if segs[s].num_layers == 1)
    streamed = max([share[s] for s in range(len(segs)) if segs[s].num_layers > 1], default=0)
    assert copy_in_bytes(traced.jaxpr) == (total, whole + streamed)

    from jax._src.pallas.triton import pallas_call_registration as reg

    class _H200:  # Pallas-Triton's lowering asks the GPU for its compute capability (tests/kernels/conftest.py)
        compute_capability = 90

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: _H200())
    hlo = traced.lower(lowering_platforms=("cuda",)).as_text()
    copies = re.findall(r'_xla_buffer_placement = "device".*: \(tensor<([0-9x]+)x\w+>\)', hlo)
    # a layer's slice of each streamed leaf; a one-layer segment's whole (one-layer) stack
    assert sorted(copies) == sorted("x".join(map(str, a.shape[segs[p[1]].num_layers > 1:]))
                                    for p in chosen for a in arrays[p])
