"""Several hosts through jax.distributed: 2 processes on 127.0.0.1, each with 4 fake CPU devices, serve a mixed
greedy batch on one mesh of 8 (TP = 4 inside each process, DP = 2 x EP = 8 across them; rank 0 schedules and
sends each step's inputs, rank 1 follows) and give HF's greedy tokens, which test_sharded_greedy.py shows one
process with 8 devices gives on the same layout, model and batch. tests/sharding/run_multihost.py runs each
process; both run at once.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

from hf_models import hf_greedy
from _runs import REPO, start

SCRIPT = os.path.join(REPO, "tests", "sharding", "run_multihost.py")
LAYOUT = "4x2ep"
TIMEOUT_S = 600


def _free_port_pair() -> int:
    """A port P with P and P + 1 free (the coordinator's and the step channel's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")


def test_two_processes_give_one_process_tokens(hf_case):
    model, path = hf_case("v2_greedy_yarn")  # test_sharded_greedy.py runs it on 4x2ep in one process
    port = _free_port_pair()
    procs = {f"rank{r}": start([SCRIPT, path, LAYOUT, "2", str(r), str(port), "4"]) for r in (0, 1)}
    out = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT_S)
            assert p.returncode == 0, f"{name}: {stderr[-4000:]}"
            out[name] = stdout
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert "FOLLOWED" in out["rank1"]
    res = json.loads(out["rank0"].split("RESULT ", 1)[1])
    assert res["compiles_after_warmup"] == 0
    assert res["tokens"] == [hf_greedy(model, p, n) for p, n in zip(res["prompts"], res["max_tokens"])]


@pytest.mark.parametrize("args,match", [
    ((2, 2, "127.0.0.1", 29500), r"--node-rank must be in \[0, --nnodes = 2\)"),
    ((2, 0, None, 29500), "needs --master-addr"),
    ((2, 1, "127.0.0.1", None), "needs --master-port"),
    ((0, 0, None, None), "--nnodes must be >= 1"),
])
def test_bad_launch_flags_are_refused(args, match):
    from deepinfer_jax.runner.multihost import check_launch

    with pytest.raises(ValueError, match=match):
        check_launch(*args)
    check_launch(1, 0, None, None)
