"""The weight converter (HF safetensors -> orbax) and loading converted directories.

Round trip equals the HF loader exactly (fp32 logits and greedy tokens, bf16 and FP8 sources, MTP);
bad input gets one error and leaves nothing behind; interrupted runs leave no directory; host memory
stays about one layer; loading places arrays on the requested shardings.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hf_models import build_hf_model, save_hf_model
from hf_models import read_tensors as _tensors
from hf_models import rewrite_checkpoint as _rewrite
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.models.quant import is_quantized
from deepinfer_jax.weights import convert as convert_mod
from deepinfer_jax.weights.convert import convert, main
from deepinfer_jax.weights.hf_loader import dequantize_fp8_blocks
from deepinfer_jax.weights.loader import load_model
from deepinfer_jax.weights.orbax_io import META_FILE
from deepinfer_jax.weights.safetensors_io import index_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def _leaves_equal(a, b):
    fa, ta = jax.tree_util.tree_flatten(a)
    fb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(fa, fb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _greedy(fwd, params, prompt, n=6):
    """Greedy decoding by full recompute over a fixed-length buffer (causal: the zero padding after the
    last real token does not change its logits), so one compile serves every step."""
    buf = np.zeros((1, len(prompt) + n), np.int32)
    buf[0, : len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n):
        buf[0, i] = int(np.asarray(fwd(params, jnp.asarray(buf)))[0, i - 1].argmax())
    return buf[0].tolist()


def _ls(d):
    return sorted(os.listdir(d))


@pytest.mark.parametrize("case", ["v2_greedy_yarn", "v3_grouped_noaux"])
def test_round_trip_fp32_equals_hf_exactly(hf_case, tmp_path, case):
    src = shutil.copytree(hf_case(case)[1], str(tmp_path / "src"))
    for fn, text in (("tokenizer.json", "{}"), ("tokenizer_config.json", '{"x": 1}'), ("generation_config.json", "{}")):
        open(os.path.join(src, fn), "w").write(text)
    dst = str(tmp_path / "conv")
    meta = convert(src, dst, "float32", "none", progress=False)
    assert meta["dtype"] == "float32" and meta["quantization"]["method"] == "none"
    assert meta["converter_version"] >= 1 and meta["model_config"]["model_type"] == case.split("_")[0].replace("v", "deepseek_v")
    assert open(os.path.join(dst, "config.json")).read() and json.load(open(os.path.join(dst, "config.json"))) == \
        json.load(open(os.path.join(src, "config.json")))
    assert open(os.path.join(dst, "tokenizer_config.json")).read() == '{"x": 1}'
    assert {"tokenizer.json", "generation_config.json", META_FILE, "params"} <= set(_ls(dst))
    assert _ls(tmp_path) == ["conv", "src"]  # no temporary directory left beside it

    cfg_h, p_h = load_model(src, jnp.float32, progress=False)
    cfg_c, p_c = load_model(dst, jnp.float32, progress=False)
    assert cfg_c == cfg_h
    _leaves_equal(p_c, p_h)
    fwd = jax.jit(lambda p, t: forward(p, cfg_h, t))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg_h.vocab_size, (1, 9)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(fwd(p_c, ids)), np.asarray(fwd(p_h, ids)))
    prompt = np.asarray(ids[0, :3]).tolist()
    tokens = _greedy(fwd, p_c, prompt)
    assert tokens == _greedy(fwd, p_h, prompt) and len(tokens) == 9


def test_bf16_conversion_and_dtype_on_load(hf_case, tmp_path):
    _, src = hf_case("v3_flat_plain_rope")
    dst = str(tmp_path / "bf16")
    convert(src, dst, "bfloat16", "none", progress=False)
    _, p_c = load_model(dst, jnp.bfloat16, progress=False)
    _, p_h = load_model(src, jnp.bfloat16, progress=False)
    _leaves_equal(p_c, p_h)  # same fp32 -> bf16 rounding, fp32 router bias kept
    assert p_c["segments"][1]["moe"]["e_score_correction_bias"].dtype == jnp.float32
    # A bf16 checkpoint loaded as fp32 is the bf16 values, upcast.
    _, p_32 = load_model(dst, jnp.float32, progress=False)
    np.testing.assert_array_equal(np.asarray(p_32["embed"]), np.asarray(p_c["embed"]).astype(np.float32))


def test_fp8_source_and_mtp_layers(hf_case, tmp_path):
    """An FP8 (e4m3 + 128-blocks weight_scale_inv) checkpoint with one MTP module converts to exactly
    what the HF loader makes of it."""
    from test_hf_loader import quantize_fp8_blocks

    _, path = hf_case("v3_grouped_noaux")
    t = _tensors(path)
    last = ModelConfig.from_model_dir(path).num_hidden_layers - 1
    for name in [n for n in t if n.startswith(f"model.layers.{last}.")]:  # MTP layer 3 = copy of layer 2
        t[name.replace(f"layers.{last}.", f"layers.{last + 1}.")] = t[name] * 1.5
    D = t["model.norm.weight"].shape[0]
    t[f"model.layers.{last + 1}.enorm.weight"] = np.full(D, 1.1, np.float32)
    t[f"model.layers.{last + 1}.hnorm.weight"] = np.full(D, 0.9, np.float32)
    t[f"model.layers.{last + 1}.shared_head.norm.weight"] = np.full(D, 1.2, np.float32)
    t[f"model.layers.{last + 1}.eh_proj.weight"] = np.random.default_rng(0).standard_normal((D, 2 * D)).astype(np.float32)
    fp8 = {}
    for name, w in t.items():
        if name.endswith("proj.weight") and "eh_proj" not in name and w.ndim == 2:
            fp8[name], fp8[name + "_scale_inv"] = quantize_fp8_blocks(w, block=16)
        else:
            fp8[name] = w
    extra = {"num_nextn_predict_layers": 1,
             "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}}
    src = _rewrite(path, str(tmp_path / "fp8"), fp8, extra)
    dst = str(tmp_path / "conv")
    meta = convert(src, dst, "float32", "none", progress=False)
    assert meta["source"]["fp8"] and meta["num_nextn_predict_layers"] == 1 and "mtp_0" in meta["units"]
    cfg_h, p_h = load_model(src, jnp.float32, progress=False, quantization="none")
    cfg_c, p_c = load_model(dst, jnp.float32, progress=False)
    assert cfg_c == cfg_h and cfg_c.num_nextn_predict_layers == 1 and "mtp" in p_c
    _leaves_equal(p_c, p_h)
    q = fp8["model.layers.1.self_attn.q_a_proj.weight"]
    s = fp8["model.layers.1.self_attn.q_a_proj.weight_scale_inv"]
    np.testing.assert_array_equal(np.asarray(p_c["segments"][1]["attn"]["q_a_proj"][0]),
                                  dequantize_fp8_blocks(q, s, (16, 16)).T)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_conversion_loads_quantized_leaves(hf_case, tmp_path, method):
    _, src = hf_case("v3_grouped_noaux")
    dst = str(tmp_path / method)
    assert main(["--src", src, "--dst", dst, "--dtype", "bfloat16", "--quantize", method, "--group-size", "16",
                 "--no-progress"]) == 0
    cfg, p = load_model(dst, jnp.bfloat16, progress=False)
    seg = p["segments"][1]
    qw = seg["moe"]["experts"]["gate_up"]  # [L, E, D, 2, I]
    L, E, D, I = 2, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert is_quantized(qw) and qw.shape == (L, E, D, 2, I)
    if method == "int8":
        assert qw.q.dtype == jnp.int8 and qw.scale.shape == (L, E, 1, 2, I)
    else:
        assert qw.q.dtype == jnp.uint8 and qw.q.shape == (L, E, D // 2, 2, I) and qw.scale.shape == (L, E, D // 8, 2, I)  # 64 rows: 8 groups of 8
    assert is_quantized(seg["attn"]["o_proj"]) and not is_quantized(seg["moe"]["gate"])
    assert not is_quantized(p["embed"]) and p["embed"].dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 16)), jnp.int32)
    out = np.asarray(forward(p, cfg, ids))
    assert np.isfinite(out).all() and out.shape == (1, 16, cfg.vocab_size)


def test_int4_group_sizes_are_read_from_the_checkpoint(hf_case, tmp_path, monkeypatch):
    """A checkpoint written under another group rule loads with its own groups (from the scales)."""
    from deepinfer_jax.models import quant

    _, src = hf_case("v3_grouped_noaux")
    dst = str(tmp_path / "g4")
    with monkeypatch.context() as m:
        m.setattr(quant, "int4_group", lambda n, g: 4)
        convert(src, dst, "float32", "int4", 16, progress=False)
    _, p = load_model(dst, jnp.float32, progress=False)
    qw = p["segments"][1]["moe"]["experts"]["gate_up"]  # [L, E, D, 2, I], D = 64
    assert qw.group_size == 4 and qw.scale.shape == (2, 16, 16, 2, 32)


def test_cli_wrapper_from_a_clone(hf_case, tmp_path):
    _, src = hf_case("v2_greedy_yarn")
    dst = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""}
    r = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_weights.py"), "--src", src,
                        "--dst", str(dst), "--quantize", "int8"], capture_output=True, text=True, env=env,
                       cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "converting" not in r.stderr and "wrote" in r.stdout  # no progress bar: stderr is not a terminal
    meta = json.load(open(dst / META_FILE))
    assert meta["dtype"] == "bfloat16" and meta["quantization"]["method"] == "int8"


def test_cli_prints_no_jax_info_lines(tmp_path):
    """`deepinfer convert` logs at INFO, but JAX's own INFO lines (its backend probe's "Unable to initialize backend
    'tpu'" where there is none) stay out, as in serve: only the converter's lines and the result."""
    from deepinfer_jax.server.args import DEFAULT_MODEL_DIR

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # every platform probed, as a user's run
    env["PYTHONPATH"] = REPO
    r = subprocess.run([sys.executable, "-m", "deepinfer_jax.cli", "convert", "--src", DEFAULT_MODEL_DIR, "--dst",
                        str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=300)
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr
    assert not [line for line in r.stderr.splitlines() if " jax" in line], r.stderr


# ------------------------------------------------------------------------------------------------
# Bad input: one clear error, exit 1 (2 for a usage error found while parsing), nothing left behind
# ------------------------------------------------------------------------------------------------


def _bad(tmp_path, capsys, argv, pattern, code=1):
    before = _ls(tmp_path)
    try:
        rc = main(argv + ["--no-progress"])
    except SystemExit as e:  # argparse's usage error
        rc = e.code
    assert rc == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("deepinfer convert: error:"), err
    assert re.search(pattern, err), err
    assert _ls(tmp_path) == before  # no dst, no temporary directory
    return err


def test_bad_inputs(hf_case, tmp_path, capsys):
    _, src = hf_case("v2_greedy_yarn")
    dst = str(tmp_path / "dst")
    _bad(tmp_path, capsys, ["--src", str(tmp_path / "nope"), "--dst", dst], "argument --src: .* does not exist", 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    _bad(tmp_path, capsys, ["--src", str(empty), "--dst", dst], "argument --src: .*no config.json", 2)
    _bad(tmp_path, capsys, ["--src", src, "--dst", dst, "--group-size", "0"], "argument --group-size", 2)
    (empty / "config.json").write_text("{not json")
    _bad(tmp_path, capsys, ["--src", str(empty), "--dst", dst], "not valid JSON")
    shutil.copy(os.path.join(src, "config.json"), empty / "config.json")
    _bad(tmp_path, capsys, ["--src", str(empty), "--dst", dst], r"no \*\.safetensors")
    (empty / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    _bad(tmp_path, capsys, ["--src", str(empty), "--dst", dst], "not a safetensors file")
    (empty / "config.json").write_text(json.dumps({"model_type": "gemma"}))
    _bad(tmp_path, capsys, ["--src", str(empty), "--dst", dst], "model_type 'gemma' is not supported")

    t = _tensors(src)
    missing = dict(t)
    del missing["model.layers.2.mlp.experts.5.up_proj.weight"]
    d = _rewrite(src, str(tmp_path / "missing"), missing)
    _bad(tmp_path, capsys, ["--src", d, "--dst", dst], r"missing tensor model\.layers\.2\.mlp\.experts\.5\.up_proj")
    wrong = dict(t, **{"model.norm.weight": t["model.norm.weight"].astype(np.int32)})
    d = _rewrite(src, str(tmp_path / "int32"), wrong)
    _bad(tmp_path, capsys, ["--src", d, "--dst", dst], r"model\.norm\.weight has dtype I32")
    shape = dict(t, **{"model.layers.0.self_attn.kv_b_proj.weight": t["model.layers.0.self_attn.kv_b_proj.weight"][:-1]})
    d = _rewrite(src, str(tmp_path / "shape"), shape)
    _bad(tmp_path, capsys, ["--src", d, "--dst", dst], r"kv_b_proj\.weight has shape \(127, 32\)")
    f8 = dict(t, **{"model.layers.0.self_attn.o_proj.weight":
                    t["model.layers.0.self_attn.o_proj.weight"].astype(ml_dtypes.float8_e4m3fn)})
    d = _rewrite(src, str(tmp_path / "f8"), f8)
    _bad(tmp_path, capsys, ["--src", d, "--dst", dst], "without a usable weight_scale_inv")
    _bad(tmp_path, capsys, ["--src", src, "--dst", src, "--overwrite"], "must differ")
    _bad(tmp_path, capsys, ["--src", src, "--dst", dst, "--quantize", "fp8"], "holds no FP8 weights")
    with pytest.raises(ValueError, match="unsupported --dtype 'float16'"):
        convert(src, dst, "float16")
    with pytest.raises(SystemExit) as e:  # argparse rejects it before any work, exit 2
        main(["--src", src, "--dst", dst, "--dtype", "float16"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert not os.path.exists(dst)


def test_existing_dst_needs_overwrite(hf_case, tmp_path, capsys):
    _, src = hf_case("v2_greedy_yarn")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")
    _bad(tmp_path, capsys, ["--src", src, "--dst", str(dst)], "already exists; pass --overwrite")
    assert (dst / "keep.txt").read_text() == "old"
    assert main(["--src", src, "--dst", str(dst), "--overwrite", "--no-progress"]) == 0
    assert not (dst / "keep.txt").exists() and (dst / META_FILE).exists()
    assert _ls(tmp_path) == ["dst"]


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_interrupted_conversion_leaves_nothing(hf_case, tmp_path, monkeypatch, capsys, exc):
    _, src = hf_case("v3_grouped_noaux")
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("old")  # an --overwrite run that fails keeps the old dst
    real, calls = convert_mod.read_rule_tensor, []

    def flaky(rule, tensors, block):
        calls.append(rule.hf_name)
        if len(calls) == 60:  # midway: the embeddings and layer 0 are already written
            raise exc
        return real(rule, tensors, block)

    monkeypatch.setattr(convert_mod, "read_rule_tensor", flaky)
    if isinstance(exc, KeyboardInterrupt):
        assert main(["--src", src, "--dst", str(dst), "--overwrite", "--no-progress"]) == 130
    else:
        with pytest.raises(RuntimeError, match="disk on fire"):
            convert(src, str(dst), overwrite=True, progress=False)
    assert len(calls) == 60
    assert _ls(tmp_path) == ["dst"] and _ls(dst) == ["keep.txt"]


def test_host_memory_stays_about_one_layer(tmp_path):
    """Peak traced host memory while converting is a few layers' worth, not the model: the stacked
    [L, ...] leaves are never assembled on the host."""
    model = build_hf_model("v2_greedy_yarn", num_hidden_layers=8, hidden_size=128, moe_intermediate_size=128,
                           n_routed_experts=8, vocab_size=256)
    src = save_hf_model(model, str(tmp_path / "hf"))
    del model
    cfg = ModelConfig.from_model_dir(src)
    total = sum(int(np.prod(i.shape)) * 4 for i in index_checkpoint(src).values())  # fp32 bytes
    convert(src, str(tmp_path / "warm"), "float32", "int8", progress=False)  # first-use imports, caches
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        convert(src, str(tmp_path / "out"), "float32", "int8", progress=False)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    E, D, Im = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    layer = 4 * (E * 3 * D * Im + 3 * D * Im * cfg.n_shared_experts + 4 * D * D)  # ~ one MoE layer, fp32
    print(f"\npeak {peak / 1e6:.1f} MB, one layer ~{layer / 1e6:.1f} MB, model {total / 1e6:.1f} MB")
    assert peak < 3 * layer and peak < total / 3


SHARDED_LOAD = r"""
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from deepinfer_jax.models.params import logical_axes, param_specs
from deepinfer_jax.models.quant import is_quantized
from deepinfer_jax.models.deepseek import forward
from deepinfer_jax.weights.loader import load_model, prepare_model
from deepinfer_jax.config import ModelConfig
dst = sys.argv[1]
mesh = Mesh(np.array(jax.devices()), ("tp",))
rules = {"heads": "tp", "expert": "tp"}
cfg = ModelConfig.from_model_dir(dst)
sh = jax.tree.map(lambda axes: NamedSharding(mesh, P(*[rules.get(a) for a in axes])), logical_axes(cfg),
                  is_leaf=lambda x: isinstance(x, tuple))
cfg, pending = prepare_model(dst, jnp.float32, shardings=sh, progress=False)
p = pending.result()  # checked against the abstract tree the loader announced
_, ref = load_model(dst, jnp.float32, progress=False)
# what the engine counts in use on a device before the weights arrive: that device's shards of them
for d in jax.devices():
    on_d = sum(s.data.nbytes for x in jax.tree.leaves(p) for s in x.addressable_shards if s.device == d)
    assert pending.bytes_on(d) == on_d < sum(x.nbytes for x in jax.tree.leaves(p)), (d, pending.bytes_on(d), on_d)
gu = p["segments"][1]["moe"]["experts"]["gate_up"]
o = p["segments"][1]["attn"]["o_proj"]
spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
assert is_quantized(gu) and spec(gu.q) == (None, "tp", None, None, None), gu.q.sharding
assert spec(gu.scale) == (None, "tp", None, None, None), gu.scale.sharding
assert spec(o.q) == (None, "tp", None, None) and spec(o.scale) == (None,) * 4, (o.q.sharding, o.scale.sharding)
assert {s.data.shape for s in gu.q.addressable_shards} == {(2, 4, 64, 2, 32)}
assert {s.data.shape for s in o.scale.addressable_shards} == {o.scale.shape}
assert spec(p["embed"]) == (None, None) and len(p["embed"].sharding.device_set) == 2
from deepinfer_jax.weights.orbax_io import _fit_sharding
fit = _fit_sharding(NamedSharding(mesh, P(None, None, "tp", None)), (2, 8, 11, 64), False)  # 11 rows: kept whole
assert tuple(fit.spec) == (None, None, None, None), fit
assert tuple(_fit_sharding(NamedSharding(mesh, P(None, "tp", None)), (8, 6), True).spec) == ("tp", None)
ids = jnp.asarray(np.arange(24).reshape(2, 12) % cfg.vocab_size, jnp.int32)
np.testing.assert_allclose(np.asarray(forward(p, cfg, ids)), np.asarray(forward(ref, cfg, ids)), atol=1e-5, rtol=0)
print("OK")
"""


def test_load_onto_shardings(hf_case, tmp_path):
    """Two CPU devices: experts and heads split over "tp"; int8 scales of o_proj (one per output
    channel, shared by the heads) come back replicated; logits match the single-device load; the bytes the
    pending load announces for each device are that device's shards."""
    _, src = hf_case("v2_greedy_yarn")
    dst = str(tmp_path / "int8")
    convert(src, dst, "float32", "int8", progress=False)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    r = subprocess.run([sys.executable, "-c", SHARDED_LOAD, dst], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stderr[-3000:]


def test_auto_dtype_of_a_converted_checkpoint(hf_case, tmp_path):
    from deepinfer_jax.engine.llm import resolve_dtype

    _, src = hf_case("v2_greedy_yarn")
    dst = str(tmp_path / "f32")
    convert(src, dst, "float32", "none", progress=False)
    assert resolve_dtype("auto", dst) == "float32"
    assert resolve_dtype("auto", src) == "bfloat16"  # vLLM's rule for an fp32 HF checkpoint
