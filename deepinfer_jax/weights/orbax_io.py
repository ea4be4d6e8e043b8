"""The converted checkpoint format: one orbax checkpoint of per-layer *units*, plus a metadata file.

Layout of a converted directory (written by weights/convert.py):

  deepinfer_checkpoint.json   metadata (format, converter version, dtype, quantization, units); written
                              last, so its presence marks a complete conversion
  config.json                 the HF config.json, verbatim; tokenizer files beside it
  params/                     an orbax checkpoint (OCDBT + zarr3, uncompressed, chunks <= 64 MiB),
                              pytree under params/state/

The pytree has one top-level key per unit: "top" (embed, final_norm, lm_head), "layer_NNN" (decoder
layer NNN, global index, with its segment's specs unstacked) and "mtp_J". DeepSeek-V4's layers are not
stacked (a dict per layer): "top" adds its hc_head, and "layer_NNN" is params["layers"][NNN] as it is. Stacked leaves
([L, ...] per segment) are therefore stored as per-layer entries and stacked at load time. Units are
written one orbax partial save at a time (so conversion holds about one layer on the host) and
restored one at a time straight onto their target shardings, then placed into the stacked device
leaf with a donated in-place update (so loading holds the model plus about one layer on device).
A quantized leaf is stored as {"q": ..., "scale": ...}; its bits / group size / n_out follow from
the metadata's quantization and the param specs (`expected_unit`), and are checked against the
stored shapes before anything is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.models.params import ParamSpec, is_spec, layer_segments, spec_dtype
from deepinfer_jax.models.registry import param_specs
from deepinfer_jax.models.quant import METHODS, QuantizedWeight, is_quantized, quant_layout, quantized_shapes
from deepinfer_jax.weights.pending import PendingParams, in_host_memory
from deepinfer_jax.weights.safetensors_io import CheckpointError

log = logging.getLogger(__name__)

META_FILE = "deepinfer_checkpoint.json"
PARAMS_DIR = "params"
PYTREE_SUBDIR = "state"  # where orbax's partial save puts the pytree (v1 layout)
FORMAT = "deepinfer-orbax"
CONVERTER_VERSION = 1
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Unit:
    """One stored entry of the checkpoint: a subtree written and restored as a whole.

    `path`: where its leaves live in the params tree (() for "top"); `index`: the layer's offset along
    the stacked axis of its segment, None when the unit's leaves are not stacked."""

    name: str
    path: tuple
    index: int | None
    specs: dict


def checkpoint_units(cfg: ModelConfig) -> list[Unit]:
    specs = param_specs(cfg)
    if cfg.family == "deepseek_v4":  # one dict per layer (models/v4_params.py): nothing stacked
        top = {k: specs[k] for k in ("embed", "final_norm", "lm_head", "hc_head")}
        return ([Unit("top", (), None, top)] + [Unit(f"layer_{i:03d}", ("layers", i), None, lp)
                                                 for i, lp in enumerate(specs["layers"])]
                + [Unit(f"mtp_{j}", ("mtp", j), None, mp) for j, mp in enumerate(specs.get("mtp", []))])
    units = [Unit("top", (), None, {k: specs[k] for k in ("embed", "final_norm", "lm_head")})]
    for si, seg in enumerate(layer_segments(cfg)):
        # one layer's specs: the segment's stacked specs without their leading "layers" axis (any family)
        one = jax.tree.map(lambda s: ParamSpec(s.shape[1:], s.axes[1:], s.dtype), specs["segments"][si],
                           is_leaf=is_spec)
        for layer in range(seg.start, seg.stop):
            units.append(Unit(f"layer_{layer:03d}", ("segments", si), layer - seg.start, one))
    for j, mtp in enumerate(specs.get("mtp", [])):
        units.append(Unit(f"mtp_{j}", ("mtp", j), None, mtp))
    return units


def unit_name_of(cfg: ModelConfig, path: tuple, index: tuple) -> tuple[str, tuple, tuple]:
    """A name-table rule's (path, index) -> (unit name, path inside the unit, index inside the unit)."""
    if path[0] == "segments":
        seg = layer_segments(cfg)[path[1]]
        return f"layer_{seg.start + index[0]:03d}", path[2:], index[1:]
    if path[0] == "mtp":
        return f"mtp_{path[1]}", path[2:], index
    return "top", path, index


def path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def expected_unit(unit: Unit, dtype: Any, method: str, group_size: int) -> dict:
    """The unit's stored tree: ShapeDtypeStruct per float leaf, QuantizedWeight(ShapeDtypeStruct q,
    ShapeDtypeStruct scale, ...) per quantized leaf."""
    bits = METHODS[method]

    def one(path, spec):
        lay = quant_layout(path_keys(path))
        if not bits or lay is None:
            return jax.ShapeDtypeStruct(spec.shape, spec_dtype(spec, dtype))
        q_shape, s_shape, g = quantized_shapes(spec.shape, bits, lay[0], lay[1], group_size)
        q_dt = jnp.int8 if bits == 8 else jnp.uint8
        return QuantizedWeight(jax.ShapeDtypeStruct(q_shape, q_dt), jax.ShapeDtypeStruct(s_shape, jnp.float32),
                               bits, g, lay[1])

    return jax.tree_util.tree_map_with_path(one, unit.specs, is_leaf=is_spec)


def to_stored(tree: Any) -> Any:
    """QuantizedWeight nodes -> {"q", "scale"} dicts (what orbax sees)."""
    return jax.tree.map(lambda x: {"q": x.q, "scale": x.scale} if is_quantized(x) else x, tree, is_leaf=is_quantized)


@contextlib.contextmanager
def _quiet_orbax() -> Iterator[None]:
    """orbax logs absl warnings about step metadata we do not use; keep the CLI output readable."""
    absl = logging.getLogger("absl")
    old = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(old)


@contextlib.contextmanager
def _no_sibling_tracebacks() -> Iterator[None]:
    """A restore that fails (a data file cut short) fails its sibling reads too, which asyncio logs with their
    tracebacks as its loop shuts down; the first error is raised as one line instead (this thread's records only)."""
    import threading

    me = threading.get_ident()

    def keep(record: logging.LogRecord) -> bool:
        return not (record.thread == me and str(record.msg).startswith("unhandled exception during asyncio.run()"))

    log = logging.getLogger("asyncio")
    log.addFilter(keep)
    try:
        yield
    finally:
        log.removeFilter(keep)


class UnitWriter:
    """Writes units into `<dir>/params` with orbax partial saves; `finalize()` makes it one checkpoint."""

    def __init__(self, directory: str):
        import orbax.checkpoint.experimental.v1 as ocp1

        self._ocp1 = ocp1
        self.path = os.path.join(directory, PARAMS_DIR)
        self._ctx = ocp1.Context()
        self._ctx.array.saving.use_compression = False  # weights do not compress; reads stay cheap
        self._ctx.array.saving.storage_options.chunk_byte_size = CHUNK_BYTES  # sharded reads touch less

    def save(self, name: str, tree: Any) -> None:
        with _quiet_orbax(), self._ctx:
            self._ocp1.partial.save(self.path, {name: to_stored(tree)})

    def finalize(self) -> None:
        with _quiet_orbax(), self._ctx:
            self._ocp1.partial.finalize(self.path)


# ------------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------------


def is_converted(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, META_FILE))


def read_meta(model_dir: str) -> dict:
    with open(os.path.join(model_dir, META_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{model_dir}/{META_FILE} is not a {FORMAT} metadata file")
    if meta.get("converter_version", 0) > CONVERTER_VERSION:
        raise CheckpointError(f"{model_dir} was written by converter version {meta['converter_version']}; "
                              f"this engine reads up to {CONVERTER_VERSION}")
    return meta


def _fit_sharding(s: Any, shape: tuple, drop_first: bool) -> Any:
    """The sharding for an array of `shape` derived from its (stacked, float) leaf's sharding `s`:
    without the stacked axis when `drop_first`, and unsplit along axes the mesh does not divide (int8
    scales' length-1 input axes, an INT4 scale axis of in / group rows such as 1408 / 128 = 11)."""
    if isinstance(s, jax.sharding.NamedSharding):
        spec = tuple(s.spec) + (None,) * (len(shape) + drop_first - len(s.spec))
        spec = spec[1:] if drop_first else spec

        def ways(a) -> int:
            names = (a,) if isinstance(a, str) else tuple(a or ())
            return int(np.prod([s.mesh.shape[n] for n in names]))

        spec = tuple(a if a is None or n % ways(a) == 0 else None for a, n in zip(spec, shape))
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=s.memory_kind)
    return s


def _place(seg_tree: Any, unit_tree: Any, i: jax.Array) -> Any:
    """seg_tree[leaf][i] = unit_tree[leaf] for every leaf; jitted with seg_tree donated (in place), so one
    compile serves every layer of a segment and each stacked leaf keeps its buffer and sharding."""
    return jax.tree.map(lambda leaf, v: jax.lax.dynamic_update_index_in_dim(leaf, v.astype(leaf.dtype), i, 0),
                        seg_tree, unit_tree)


_place_donated = jax.jit(_place, donate_argnums=0)


def _place_layer(seg_tree: Any, unit_tree: Any, index: int) -> Any:
    """`_place_donated` at layer `index`, leaves in host memory (numpy arrays, `load_to`) written in numpy."""
    leaves, treedef = jax.tree.flatten(seg_tree)
    if not any(isinstance(x, np.ndarray) for x in leaves):
        return _place_donated(seg_tree, unit_tree, np.int32(index))
    values = jax.tree.leaves(unit_tree)
    dev = [j for j, x in enumerate(leaves) if not isinstance(x, np.ndarray)]
    for j, x in zip(dev, _place_donated([leaves[j] for j in dev], [values[j] for j in dev], np.int32(index))
                    if dev else []):
        leaves[j] = x
    for x, v in zip(leaves, values):
        if isinstance(x, np.ndarray):
            x[index] = np.asarray(v).astype(x.dtype)
    return treedef.unflatten(leaves)


def _put_host(x: Any, abstract: jax.ShapeDtypeStruct) -> Any:
    """A leaf assembled in numpy (one `load_to` places in host memory) onto its placement; any other as it is."""
    return jax.device_put(x, abstract.sharding) if isinstance(x, np.ndarray) else x


def get_path(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _check_stored(unit: Unit, expected: dict, stored_meta: dict) -> None:
    stored = stored_meta.get(unit.name)
    if stored is None:
        raise CheckpointError(f"converted checkpoint has no entry {unit.name!r}")
    flat_exp = jax.tree_util.tree_flatten_with_path(to_stored(expected))[0]
    for path, sds in flat_exp:
        name = unit.name + jax.tree_util.keystr(path)
        try:
            m = get_path(stored, path_keys(path))
        except (KeyError, TypeError):
            raise CheckpointError(f"converted checkpoint is missing {name}") from None
        if tuple(m.shape) != tuple(sds.shape):
            raise CheckpointError(f"{name} is stored with shape {tuple(m.shape)}, expected {tuple(sds.shape)}")
        if (jnp.dtype(m.dtype).kind in "iu") != (jnp.dtype(sds.dtype).kind in "iu"):
            raise CheckpointError(f"{name} is stored as {m.dtype}, expected {sds.dtype}")


def _stored_groups(expected: dict, stored: Any) -> dict:
    """INT4 group sizes as the checkpoint stores them (read off each scale's row count), so a change
    of the group rule never misreads an older checkpoint; other leaves unchanged."""
    def one(path, sds):
        if not is_quantized(sds) or sds.bits != 4 or stored is None:
            return sds
        try:
            rows = tuple(get_path(stored, path_keys(path))["scale"].shape)[sds.scale.ndim - sds.n_out - 1]
        except (KeyError, TypeError, IndexError):
            return sds  # reported by _check_stored
        ax = sds.q.ndim - sds.n_out - 1
        n_in = 2 * sds.q.shape[ax]
        if rows < 1 or n_in % rows:
            return sds
        s_shape = sds.scale.shape[:ax] + (rows,) + sds.scale.shape[ax + 1:]
        return QuantizedWeight(sds.q, jax.ShapeDtypeStruct(s_shape, sds.scale.dtype), 4, n_in // rows, sds.n_out)

    return jax.tree_util.tree_map_with_path(one, expected, is_leaf=is_quantized)


def load_converted(model_dir: str, dtype: Any = jnp.bfloat16, shardings: Any = None, progress: bool = True
                   ) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from a converted directory; every array restored straight onto its
    sharding (`shardings`: params-shaped tree of Sharding, float-leaf shaped at quantized leaves or a
    QuantizedWeight of shardings; None: the default device)."""
    cfg, pending = prepare_converted(model_dir, dtype, shardings, progress)
    return cfg, pending.result()


def _first_line(e: BaseException) -> str:
    """The innermost cause's first line (tensorstore's own message, not the spec orbax wraps it in)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]


def prepare_converted(model_dir: str, dtype: Any = jnp.bfloat16, shardings: Any = None, progress: bool = True
                      ) -> tuple[ModelConfig, PendingParams]:
    """(ModelConfig, the params pending), as `load_converted`: the metadata read and every stored entry checked
    now (a CheckpointError before any device work), the arrays restored when the load starts."""
    import orbax.checkpoint as ocp

    meta = read_meta(model_dir)
    cfg = ModelConfig.from_model_dir(model_dir)
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=int(meta["num_nextn_predict_layers"]))
    qmeta = meta["quantization"]
    method, group = qmeta["method"], int(qmeta.get("group_size", 0))
    tree_dir = os.path.join(model_dir, PARAMS_DIR, PYTREE_SUBDIR)
    if not os.path.isdir(tree_dir):
        raise CheckpointError(f"{model_dir} has no orbax checkpoint at {PARAMS_DIR}/{PYTREE_SUBDIR}")
    ckptr = ocp.PyTreeCheckpointer()
    try:
        with _quiet_orbax():
            item = ckptr.metadata(tree_dir).item_metadata
    except Exception as e:  # orbax raises its own kinds for a corrupt one
        raise CheckpointError(f"{tree_dir}: the checkpoint's metadata cannot be read ({_first_line(e)})") from None
    if item is None:
        raise CheckpointError(f"{tree_dir}: no readable _METADATA (missing or corrupt: an incomplete copy?)")
    stored_meta = item.tree
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    units = checkpoint_units(cfg)
    expected = {u.name: _stored_groups(expected_unit(u, dtype, method, group), stored_meta.get(u.name))
                for u in units}
    for u in units:  # fail before any device work, naming the first bad entry
        _check_stored(u, expected[u.name], stored_meta)

    def leaf_sharding(unit: Unit, path: tuple) -> Any:
        return default if shardings is None else get_path(shardings, unit.path + path)

    def params_tree(make: Any, stacked_only: bool = False) -> dict:
        """The params' tree with every array made by make(shape, dtype, sharding): stacked leaves once a segment,
        on their full shardings; the other units' leaves on theirs (`stacked_only`: left out)."""
        if cfg.family == "deepseek_v4":
            params: dict = {"layers": [None] * cfg.num_hidden_layers}
        else:
            params = {"segments": [None] * len(layer_segments(cfg))}
        if cfg.num_nextn_predict_layers:
            params["mtp"] = [None] * cfg.num_nextn_predict_layers
        for u in units:
            stacked = u.index is not None
            if (stacked and params["segments"][u.path[1]] is not None) or (stacked_only and not stacked):
                continue
            lead = (layer_segments(cfg)[u.path[1]].num_layers,) if stacked else ()

            def one(path, sds, u=u, lead=lead):
                s = leaf_sharding(u, path_keys(path))
                if is_quantized(sds):
                    sq, ss = (s.q, s.scale) if is_quantized(s) else (s, s)
                    shp_q, shp_s = lead + sds.q.shape, lead + sds.scale.shape
                    return QuantizedWeight(make(shp_q, sds.q.dtype, _fit_sharding(sq, shp_q, False)),
                                           make(shp_s, sds.scale.dtype, _fit_sharding(ss, shp_s, False)),
                                           sds.bits, sds.group_size, sds.n_out)
                shp = lead + sds.shape
                return make(shp, sds.dtype, _fit_sharding(s, shp, False))

            tree = jax.tree_util.tree_map_with_path(one, expected[u.name], is_leaf=is_quantized)
            if stacked:
                params["segments"][u.path[1]] = tree
            elif u.path:
                params[u.path[0]][u.path[1]] = tree
            else:
                params.update(tree)
        return params

    def load_to(target: Any) -> dict:
        """The params placed as `target` says (`abstract`, or it with leaves in host memory: those are restored as
        numpy arrays, stacked in numpy and put there once, never on the device; PendingParams.load_to)."""
        def zeros(a: Any) -> Any:
            return np.zeros(a.shape, a.dtype) if in_host_memory(a) else jnp.zeros(a.shape, a.dtype, device=a.sharding)

        # Stacked leaves are allocated once, on their full placements, and filled layer by layer.
        params = {k: [jax.tree.map(zeros, seg) for seg in v] if k == "segments" else [None] * len(v)
                  for k, v in target.items() if k in ("segments", "layers", "mtp")}
        it = units
        if progress:
            from tqdm import tqdm

            it = tqdm(units, desc="loading converted weights", unit="unit", leave=False, disable=None)
        for u in it:
            stacked = u.index is not None

            def restore_arg(path, sds, u=u, stacked=stacked):
                s = leaf_sharding(u, path_keys(path))
                m = get_path(stored_meta[u.name], path_keys(path))
                host = in_host_memory(get_path(target, u.path + path_keys(path)))

                def arg(sh, x, m):
                    # A cast only where the stored dtype differs (tensorstore's cast driver costs time).
                    cast = None if jnp.dtype(m.dtype) == jnp.dtype(x.dtype) else x.dtype
                    if host:
                        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=cast)
                    return ocp.ArrayRestoreArgs(sharding=_fit_sharding(sh, x.shape, stacked), dtype=cast,
                                                global_shape=x.shape)

                if is_quantized(sds):
                    sq, ss = (s.q, s.scale) if is_quantized(s) else (s, s)
                    return {"q": arg(sq, sds.q, m["q"]), "scale": arg(ss, sds.scale, m["scale"])}
                return arg(s, sds, m)

            stored = to_stored(expected[u.name])
            args = jax.tree_util.tree_map_with_path(restore_arg, expected[u.name], is_leaf=is_quantized)
            try:
                with _quiet_orbax(), _no_sibling_tracebacks():
                    got = ckptr.restore(tree_dir, args=ocp.args.PyTreeRestore(
                        item={u.name: jax.tree.map(lambda _: 0, stored)}, restore_args={u.name: args},
                        partial_restore=True))[u.name]
            except Exception as e:  # tensorstore's errors (a data file cut short) carry its whole spec: the cause
                raise CheckpointError(f"{tree_dir}: {u.name} cannot be read ({_first_line(e)})") from None
            got = jax.tree.map(lambda sds, x: QuantizedWeight(x["q"], x["scale"], sds.bits, sds.group_size, sds.n_out)
                               if is_quantized(sds) else x, expected[u.name], got, is_leaf=is_quantized)
            if not stacked:
                want = get_path(target, u.path) if u.path else {k: target[k] for k in got}
                got = jax.tree.map(_put_host, got, want)
                if u.path:
                    params[u.path[0]][u.path[1]] = got
                else:
                    params.update(got)
                continue
            params["segments"][u.path[1]] = _place_layer(params["segments"][u.path[1]], got, u.index)
        if "segments" in params:  # the stacked leaves assembled in numpy, one at a time
            for i, want in enumerate(target["segments"]):
                params["segments"][i] = jax.tree.map(_put_host, params["segments"][i], want)
        return params

    abstract = params_tree(lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh))
    return cfg, PendingParams(abstract, load_to=load_to)
