"""The shipped GEMM autotuning results seed XLA's per-fusion autotune cache: every entry of the
archive lands under its GPU fingerprint, entries already there are kept, and nothing outside
`<fingerprint>/<name>.pb` is extracted."""

from __future__ import annotations

import io
import os
import tarfile

from deepinfer_jax.runner.compile_cache import AUTOTUNE_DIR, seed_autotune_results, shipped_autotune_archives


def _entries(archive) -> dict[str, bytes]:
    with tarfile.open(archive, "r:gz") as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_shipped_results_seed_an_empty_cache_once(tmp_path):
    (archive,) = shipped_autotune_archives()
    entries = _entries(archive)
    assert len(entries) > 100 and all(name.endswith(".pb") and name.count("/") == 1 for name in entries)
    assert seed_autotune_results(str(tmp_path)) == len(entries)
    for name, data in entries.items():
        assert (tmp_path / AUTOTUNE_DIR / name).read_bytes() == data
    # A second start adds nothing, and an entry XLA rewrote stays as XLA left it.
    name = next(iter(entries))
    (tmp_path / AUTOTUNE_DIR / name).write_bytes(b"tuned here")
    assert seed_autotune_results(str(tmp_path)) == 0
    assert (tmp_path / AUTOTUNE_DIR / name).read_bytes() == b"tuned here"


def test_only_fingerprint_entries_are_extracted(tmp_path):
    archive = tmp_path / "odd.tgz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in [(f"{AUTOTUNE_DIR}/abc/good.pb", b"ok"), (f"{AUTOTUNE_DIR}/../escape.pb", b"no"),
                           (f"{AUTOTUNE_DIR}/abc/notes.txt", b"no"), ("elsewhere/abc/x.pb", b"no"),
                           (f"{AUTOTUNE_DIR}/abc/deep/y.pb", b"no")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(f"{AUTOTUNE_DIR}/abc/link.pb")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    cache = tmp_path / "cache"
    assert seed_autotune_results(str(cache), [archive]) == 1
    found = sorted(os.path.relpath(os.path.join(d, f), cache) for d, _, fs in os.walk(tmp_path) for f in fs
                   if not f.endswith(".tgz"))
    assert found == [f"{AUTOTUNE_DIR}/abc/good.pb"]
