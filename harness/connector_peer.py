"""An encode-side connector in its own process, driven over a JSON control socket.

Used by the connector tests and ``bench_transfer.py`` as the real second process: it runs a
Mooncake transfer engine, a source pool, the sender manager and the bootstrap server, and
stages deterministic embeddings on request. It prints one line ``READY {json}`` with its
ports once it listens. Control requests (ZMQ REQ/REP, JSON, no pickle):

* ``{"op": "stage", "room", "tokens", "seed"}`` -> ``{"digests"}``: ``send()`` an embedding and
  wait until it is in the pool's blocks (when the pool has room for it)
* ``{"op": "status", "room"}`` -> ``{"status", "reason", "first_write_at"}``
* ``{"op": "stats"}`` -> ``{"free_blocks", "num_blocks", "active_rooms", "counters", "rejected",
  "socket_send_started_at"}`` (times are ``time.monotonic()``, one clock for all processes)
* ``{"op": "raw_write", "session", "dst", "nbytes"}`` -> ``{"started_at", "ended_at"}``: one
  bare Mooncake write of the pool's first bytes to a peer's registered address
* ``{"op": "sleep"}`` / ``{"op": "wake"}``: keep rooms over a released and re-created pool
* ``{"op": "shutdown"}``

It also serves a plain TCP socket for the benchmark's baseline: send an 8-byte little-endian
length, receive that many bytes.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import logging
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from connector.allocator import BlockAllocator  # noqa: E402
from connector.bootstrap import BootstrapServer  # noqa: E402
from connector.buffers import BufferPool, Embedding  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.mooncake_transport import MooncakeTransport  # noqa: E402
from connector.sender import EmbeddingSender, EmbeddingSenderManager  # noqa: E402
from connector.transport import Transport  # noqa: E402


def synthetic_embedding(tokens: int, hidden: int, dtype: str, seed: int) -> Embedding:
    """Deterministic, content-rich test data for ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    emb = Embedding.empty(tokens, hidden, dtype)
    emb.embeddings[:] = np.frombuffer(rng.bytes(emb.embeddings.nbytes), np.uint8).reshape(emb.embeddings.shape)
    emb.fill_ids[:] = 151655  # Qwen2.5-VL <|image_pad|>
    emb.mrope_positions[:] = rng.integers(0, 1 << 20, size=(3, tokens), dtype=np.int32)
    emb.aux[0], emb.aux[1] = tokens, int(seed % 1000)
    return emb


@functools.lru_cache(maxsize=2)
def staged_embedding(tokens: int, hidden: int, dtype: str, seed: int) -> tuple[Embedding, dict[str, str]]:
    """:func:`synthetic_embedding` and its digests, kept for a repeated stage (benchmarks stage
    the same data for each mode; generating and hashing 448 MiB takes seconds here)."""
    emb = synthetic_embedding(tokens, hidden, dtype, seed)
    return emb, emb.digests()


def serve_socket_baseline(host: str, payload: np.ndarray, send_started: list[float]) -> int:
    """Loopback socket server for the benchmark baseline; returns its port. ``send_started[0]``
    holds ``time.monotonic()`` as the last answer's first byte went out."""
    server = socket.create_server((host, 0))

    def handle(conn: socket.socket) -> None:
        with conn:
            view = memoryview(payload).cast("B")
            while header := conn.recv(8, socket.MSG_WAITALL):
                (n,) = struct.unpack("<Q", header)
                send_started[0] = time.monotonic()
                conn.sendall(view[:n])

    def accept() -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1]


class PeerService:
    """The encode side of a peer (pool, sender manager, bootstrap server) and the control
    operations listed above; ``handle`` answers one request. The process below serves it over
    ZMQ; the fast test tier drives one in-process over :class:`MemoryTransport`."""

    def __init__(self, config: ConnectorConfig, transport: Transport, bootstrap_port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.transport = config, transport
        self.pool: BufferPool | None = BufferPool(config.num_blocks, config.block_size, config.hidden_size,
                                                  config.dtype)
        self.allocator: BlockAllocator | None = BlockAllocator(config.num_blocks)
        self.manager = EmbeddingSenderManager(config, transport, self.pool, self.allocator, clock)
        self.sleeping = threading.Event()
        self.bootstrap = BootstrapServer(config.host, bootstrap_port, secret=config.secret,
                                         health_status=lambda: "SLEEPING" if self.sleeping.is_set() else "OK")
        self.bootstrap.put_route(1, 1, config.public_host, self.manager.rank_port, 0)
        self.socket_send_started = [0.0]  # set by the socket baseline, when the process serves one
        self.senders: dict[int, EmbeddingSender] = {}

    def handle(self, req: dict) -> dict:
        """The reply to one control request; an error is reported, never raised."""
        op = req.get("op")
        try:
            return self._handle(op, req)
        except Exception as exc:  # report to the driver instead of dying
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _handle(self, op: object, req: dict) -> dict:
        config, manager = self.config, self.manager
        if op == "stage":
            emb, digests = staged_embedding(int(req["tokens"]), config.hidden_size, config.dtype, int(req["seed"]))
            sender = manager.create_sender(int(req["room"]))
            sender.send(emb)
            self.senders[sender.room] = sender
            return {"digests": digests, "in_pool": sender.wait_in_pool(5.0)}
        if op == "claim":  # an encode request for the room, its embedding not made yet
            sender = manager.create_sender(int(req["room"]))
            self.senders[sender.room] = sender
            return {"claimed": True}
        if op == "status":
            sender = self.senders[int(req["room"])]
            status = sender.poll()
            return {"status": status.name, "reason": sender.failure_reason, "first_write_at": sender.first_write_at}
        if op == "raw_write":  # the bare transfer-engine write under the connector, for the benchmark
            started = time.monotonic()
            self.transport.write(str(req["session"]), [self.pool.embeddings.ctypes.data], [int(req["dst"])],
                                 [int(req["nbytes"])])
            return {"started_at": started, "ended_at": time.monotonic()}
        if op == "stats":
            return {"free_blocks": self.allocator.free_blocks, "num_blocks": self.allocator.num_blocks,
                    "active_rooms": manager.active_rooms(), "counters": dict(manager.stats),
                    "rejected": manager.rejections.snapshot(), "socket_send_started_at": self.socket_send_started[0]}
        if op == "sleep":
            manager.pause()
            kept = manager.detach_pool()
            self.pool = self.allocator = None  # released: memory the peer no longer holds
            self.sleeping.set()
            return {"kept_bytes": kept}
        if op == "wake":
            self.pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
            self.allocator = BlockAllocator(config.num_blocks)
            manager.attach_pool(self.pool, self.allocator)
            self.sleeping.clear()
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def close(self) -> None:
        self.manager.close()
        self.bootstrap.close()
        self.transport.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--bootstrap-port", type=int, default=0)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--hidden-size", type=int, default=3584)
    ap.add_argument("--resume-timeout", type=float, default=60.0)
    ap.add_argument("--bootstrap-timeout", type=float, default=60.0)
    ap.add_argument("--heartbeat-interval", type=float, default=ConnectorConfig.heartbeat_interval)
    ap.add_argument("--completion", default="poll")
    ap.add_argument("--control-secret", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="peer %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: every thread's stack

    config = ConnectorConfig(host=args.host, num_blocks=args.num_blocks, block_size=args.block_size,
                             hidden_size=args.hidden_size, resume_timeout=args.resume_timeout,
                             bootstrap_timeout=args.bootstrap_timeout, heartbeat_interval=args.heartbeat_interval,
                             completion=args.completion,
                             control_secret=args.control_secret)
    service = PeerService(config, MooncakeTransport.for_worker(config),
                          args.bootstrap_port)
    socket_port = serve_socket_baseline(args.host, service.pool.embeddings, service.socket_send_started)

    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    control_port = rep.bind_to_random_port(f"tcp://{args.host}")
    print("READY " + json.dumps({"bootstrap_port": service.bootstrap.port, "control_port": control_port,
                                 "socket_port": socket_port, "rank_port": service.manager.rank_port}), flush=True)
    while True:
        req = json.loads(rep.recv())
        if req.get("op") == "shutdown":
            rep.send(json.dumps({"ok": True}).encode())
            break
        rep.send(json.dumps(service.handle(req)).encode())
    service.close()


if __name__ == "__main__":
    main()
