"""Shared fixtures: tiny HF DeepSeek checkpoints written once per session (see tests/hf_models.py)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' programs are tiny: compiling them, not running them, is most of the suite's time, and much of a CPU
# compile is LLVM optimizing the machine code. Level 0 turns that off; the compiled HLO (fusions, sharding,
# collectives: what the tests inspect) is the same, and a sharding subprocess spends about 40% less CPU time.
# Set before JAX starts (XLA reads XLA_FLAGS once); the tests' subprocesses inherit it; a level already set is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from hf_models import CASES, DENSE_CASES, build_dense_hf_model, build_hf_model, save_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def hf_case(tmp_path_factory):
    """hf_case(name) -> (hf_model, checkpoint_dir), cached per session; name from CASES or DENSE_CASES."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model = build_dense_hf_model(name) if name in DENSE_CASES else build_hf_model(name)
            path = save_hf_model(model, str(tmp_path_factory.mktemp(name)))
            cache[name] = (model, path)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def v4_release(tmp_path_factory):
    """(HF's model on the dequantized weights, the release-format dir, the dequantized float dir) of the tiny
    DeepSeek-V4 written as DeepSeek releases V4 (FP8 linears, FP4 experts; tests/hf_models_v4.py), once a session."""
    from hf_models_v4 import v4_release_dirs

    return v4_release_dirs(str(tmp_path_factory.mktemp("v4release")))


@pytest.fixture(scope="session")
def v4_mtp_dirs(tmp_path_factory):
    """(HF's model, the tiny V4 float dir with an MTP block in DeepSeek's names, its FP8 / FP4 release, HF's own
    save that declares the MTP layer without its tensors), once a session (tests/hf_models_v4.py add_mtp_block)."""
    from hf_models_v4 import add_mtp_block, build_hf_v4, write_v4_release

    tmp = str(tmp_path_factory.mktemp("v4mtp"))
    model = build_hf_v4(seed=0, num_nextn_predict_layers=1)
    bare = os.path.join(tmp, "bare")
    model.save_pretrained(bare, safe_serialization=True)
    mtp = add_mtp_block(bare, os.path.join(tmp, "mtp"))
    release, _ = write_v4_release(mtp, os.path.join(tmp, "release"))
    return model, mtp, release, bare


@pytest.fixture(scope="session", autouse=True)
def _session_cache_dir(tmp_path_factory):
    """Every engine of the session (LLM's compilation_cache_dir "default", `serve` and `generate` subprocesses)
    keeps JAX's compilation cache and its compiled step programs (runner/program_cache.py) in one fresh
    directory: an engine whose configuration an earlier test already compiled loads its programs, whichever
    test ran first, and nothing is read from or left in the user's ~/.cache."""
    d = str(tmp_path_factory.mktemp("deepinfer_cache"))
    before = os.environ.get("DEEPINFER_CACHE_DIR")
    os.environ["DEEPINFER_CACHE_DIR"] = d
    yield d
    if before is None:
        os.environ.pop("DEEPINFER_CACHE_DIR", None)
    else:
        os.environ["DEEPINFER_CACHE_DIR"] = before


@pytest.fixture(params=sorted(CASES))
def case_name(request):
    return request.param


def _clear_compiled_programs():
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


# Clear within a module once the process holds this many memory maps (Linux's default limit is 65,530).
MAX_MAPS_WITHIN_A_MODULE = 40_000


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop JAX's caches of compiled programs after each test module. Every XLA:CPU program maps its code
    into the process (~6 memory maps each), and the library's jitted functions keep theirs for the life of
    the process: the whole suite reached Linux's vm.max_map_count (65,530) and a later compile or
    serialization aborted. Programs a module still holds (an engine in a fixture) stay alive."""
    yield
    _clear_compiled_programs()


@pytest.fixture(autouse=True)
def _free_compiled_programs_within_a_heavy_module():
    """The same after a test, where one module's tests alone brought the maps past MAX_MAPS_WITHIN_A_MODULE
    (tests/model/test_paged_forward.py, each test compiling its own step programs, segfaulted at 37% of
    the suite in XLA:CPU's compilation cache write)."""
    yield
    if _memory_maps() > MAX_MAPS_WITHIN_A_MODULE:
        _clear_compiled_programs()
