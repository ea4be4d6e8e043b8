"""Several hosts: one process a host, every process driving its local devices of one global mesh.

Launch (vLLM's / SGLang's flags): every host runs the same command with `--nnodes N --node-rank R
--master-addr A --master-port P`. `init_distributed` starts `jax.distributed` (the coordinator on rank 0 at
A:P; on a CPU, collectives over gloo), after which `jax.devices()` lists every host's devices and the mesh
(sharding/mesh.py) spans them all.

Lockstep: every process must launch the same programs in the same order, since each program's collectives
wait for every device. Each process loads the weights and warms up alike (the same plan, the same order),
and rank 0 alone schedules: before each step program it sends the step's padded host inputs (a HostStep's
arrays, `encode_step`) over a TCP connection to every other rank (`StepChannel`, port P + 1); those ranks
(`ModelRunner.follow`) run the same step from them, in the same order, and never read its results. The
device state every step reads (the KV cache, the previous step's sampled ids) is then the same program's
output on every process. The channel carries numpy arrays (`np.savez`, no pickle) and one JSON header.
Rank 0 closing the channel (`close`, also at exit) ends the other ranks' loops.
"""

from __future__ import annotations

import atexit
import dataclasses
import io
import json
import logging
import socket
import struct
import time
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 300.0  # how long rank 0 waits for the others to connect, and they for rank 0


def check_launch(nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None) -> None:
    """A one-line ValueError naming the flag for launch arguments that cannot work."""
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes = {nnodes}), got {node_rank}")
    if nnodes > 1 and not master_addr:
        raise ValueError("--nnodes > 1 needs --master-addr (rank 0's address, where jax.distributed's "
                         "coordinator listens)")
    if nnodes > 1 and not (master_port and 0 < master_port < 65535):
        raise ValueError(f"--nnodes > 1 needs --master-port in (0, 65535), got {master_port}")


def init_distributed(nnodes: int, node_rank: int, master_addr: str | None, master_port: int | None) -> None:
    """Start jax.distributed for `nnodes` processes (a no-op for one; for a process already started with the
    same rank and count, too). Must run before anything else touches JAX's backends."""
    import jax

    check_launch(nnodes, node_rank, master_addr, master_port)
    if nnodes == 1:
        return
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (nnodes, node_rank):
            raise ValueError(f"jax.distributed already runs as process {jax.process_index()} of "
                             f"{jax.process_count()}, not --node-rank {node_rank} of --nnodes {nnodes}")
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices' collectives across processes
    jax.distributed.initialize(f"{master_addr}:{master_port}", num_processes=nnodes, process_id=node_rank,
                               initialization_timeout=int(CONNECT_TIMEOUT_S))
    log.info("jax.distributed: process %d of %d, %d local devices of %d", node_rank, nnodes,
             jax.local_device_count(), jax.device_count())


def agree_min(value: int) -> int:
    """The smallest of every process's `value` (one small collective; every process must call it)."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.asarray([value], np.int64))))


# ---- the step channel --------------------------------------------------------------------------------
def encode_step(host: Any) -> bytes:
    """A HostStep's arrays and its program-selecting fields -> bytes (`decode_step` inverts it)."""
    arrays: dict[str, np.ndarray] = {}
    parts = {}
    for part in ("meta", "sampling"):
        obj = getattr(host, part)
        if obj is None:
            parts[part] = None
            continue
        fields = dataclasses.fields(obj)
        names = [f.name for f in fields if not f.metadata.get("static") and getattr(obj, f.name) is not None]
        plain = {f.name: getattr(obj, f.name) for f in fields if f.name not in names}  # static ones, and Nones
        parts[part] = {"fields": names, "plain": plain}
        for n in names:
            arrays[f"{part}.{n}"] = np.asarray(getattr(obj, n))
    head = {"kind": "step", "bucket": host.bucket, "penalties": host.penalties, "greedy": host.greedy,
            "parts": parts}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    h = json.dumps(head).encode()
    return struct.pack("!I", len(h)) + h + buf.getvalue()


def decode_step(data: bytes) -> Any:
    """bytes from `encode_step` -> a HostStep with no request rows (the follower never reads results)."""
    from deepinfer_jax.models.cache import StepMetadata
    from deepinfer_jax.runner.inputs import HostStep
    from deepinfer_jax.sampling import SamplingTensors

    (n,) = struct.unpack("!I", data[:4])
    head = json.loads(data[4:4 + n])
    with np.load(io.BytesIO(data[4 + n:]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    objs = {}
    for part, cls in (("meta", StepMetadata), ("sampling", SamplingTensors)):
        spec = head["parts"][part]
        objs[part] = None if spec is None else cls(
            **{n: arrays[f"{part}.{n}"] for n in spec["fields"]}, **spec["plain"])
    return HostStep(objs["meta"], objs["sampling"], [], [], head["bucket"], head["penalties"], head["greedy"])


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        c = sock.recv(min(n - got, 1 << 20))
        if not c:
            return None
        chunks.append(c)
        got += len(c)
    return b"".join(chunks)


class StepChannel:
    """Rank 0's steps to the other ranks: rank 0 listens on `port` and sends (`send_step`); every other rank
    connects and receives (`recv_step`, None once rank 0 closed the channel or exited)."""

    def __init__(self, nnodes: int, node_rank: int, master_addr: str, port: int,
                 timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.node_rank = node_rank
        self.peers: list[socket.socket] = []
        self.sock: socket.socket | None = None
        if node_rank == 0:
            srv = socket.create_server(("", port), reuse_port=False)
            srv.settimeout(timeout)
            try:
                while len(self.peers) < nnodes - 1:
                    conn, _ = srv.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self.peers.append(conn)
            except socket.timeout:
                raise TimeoutError(f"rank 0 waited {timeout:.0f} s for {nnodes - 1} other ranks to connect on port "
                                   f"{port} (--master-port + 1); {len(self.peers)} did") from None
            finally:
                srv.close()
            atexit.register(self.close)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    self.sock = socket.create_connection((master_addr, port), timeout=10)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank {node_rank} could not reach rank 0 at {master_addr}:{port} "
                                           f"(--master-port + 1) in {timeout:.0f} s") from None
                    time.sleep(0.2)
            self.sock.settimeout(None)  # a server may idle between requests for as long as it likes
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_step(self, host: Any) -> None:
        data = encode_step(host)
        frame = struct.pack("!Q", len(data)) + data
        for p in self.peers:
            p.sendall(frame)

    def recv_step(self) -> Any | None:
        head = _recv_exact(self.sock, 8)
        if head is None:
            return None
        (n,) = struct.unpack("!Q", head)
        data = _recv_exact(self.sock, n)
        return None if data is None else decode_step(data)

    def close(self) -> None:
        """Rank 0: end the other ranks' loops (they see the connection close)."""
        for p in self.peers:
            try:
                p.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            p.close()
        self.peers = []
        if self.sock is not None:
            self.sock.close()
            self.sock = None
