"""Encode peers for the connector tests and benchmarks: ``connector_peer.py`` as a child process
talked to over its control socket (real Mooncake), or the same service in this process over
the in-memory transport (the fast test tier); both answer the same ``call``."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool
from connector.config import ConnectorConfig
from connector.memory_transport import MemoryTransport
from connector.mooncake_transport import MooncakeTransport
from connector.receiver import EmbeddingReceiverManager
from harness.connector_peer import PeerService

PEER_SCRIPT = Path(__file__).resolve().parent / "connector_peer.py"


class EncodePeer:
    """A real encode-side connector process; ``call`` sends one JSON control request."""

    def __init__(self, *args: str, startup_timeout: float = 60.0, host: str = "127.0.0.1",
                 prefix: tuple[str, ...] = ()) -> None:
        """``host``: the address it binds and is reached at; ``prefix``: what runs it on another
        (simulated) host, ``hosts.Host.exec_prefix()``."""
        self.host = host
        self.proc = subprocess.Popen([*prefix, sys.executable, str(PEER_SCRIPT), "--host", host, *args],
                                     stdout=subprocess.PIPE, text=True)
        line = self._read_ready(startup_timeout)
        self.info = json.loads(line.split(" ", 1)[1])
        self.bootstrap_addr = f"{host}:{self.info['bootstrap_port']}"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.RCVTIMEO, int(startup_timeout * 1000))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"tcp://{host}:{self.info['control_port']}")
        self._lock = threading.Lock()  # one REQ socket, many caller threads

    def _read_ready(self, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.proc.kill()
            raise RuntimeError(f"encode peer did not start within {timeout:g}s")
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"encode peer failed to start: {line!r}")
        return line

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, op: str, **fields: object) -> dict:
        with self._lock:
            self._sock.send(json.dumps({"op": op, **fields}).encode())
            reply = json.loads(self._sock.recv())
        if "error" in reply:
            raise RuntimeError(f"encode peer: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("shutdown")
                self.proc.wait(timeout=15)
            except (zmq.ZMQError, subprocess.TimeoutExpired, RuntimeError):
                self.proc.kill()
                self.proc.wait()
        self._sock.close()
        self._ctx.term()


class InProcessPeer:
    """The encode peer's service in this process, writing over :class:`MemoryTransport`: the
    same control operations as :class:`EncodePeer`, each request and reply going through JSON
    as they would over the socket."""

    def __init__(self, config: ConnectorConfig, link_bytes_per_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.service = PeerService(config, MemoryTransport(config.host, link_bytes_per_s), clock=clock)
        self.info = {"bootstrap_port": self.service.bootstrap.port, "rank_port": self.service.manager.rank_port}
        self.bootstrap_addr = f"127.0.0.1:{self.info['bootstrap_port']}"
        self._lock = threading.Lock()
        self._closed = False

    @property
    def alive(self) -> bool:
        return not self._closed

    def call(self, op: str, **fields: object) -> dict:
        with self._lock:  # one request at a time, as the process's REQ/REP socket serves them
            reply = json.loads(json.dumps(self.service.handle(json.loads(json.dumps({"op": op, **fields})))))
        if "error" in reply:
            raise RuntimeError(f"encode peer: {reply['error']}")
        return reply

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.service.close()


def receiving_side(config: ConnectorConfig) -> EmbeddingReceiverManager:
    """A language-side receiver manager with its own pool and Mooncake engine, for benchmarks;
    end it with :func:`close_receiving_side`."""
    transport = MooncakeTransport.for_worker(config)
    pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
    return EmbeddingReceiverManager(config, transport, pool, BlockAllocator(config.num_blocks))


def close_receiving_side(manager: EmbeddingReceiverManager) -> None:
    manager.close()
    manager.transport.close()


def assert_blocks_back(peer: EncodePeer, manager: EmbeddingReceiverManager) -> None:
    """Every block of both pools is free again (a benchmark leaks nothing)."""
    stats = peer.call("stats")
    assert manager.allocator.all_free() and stats["free_blocks"] == stats["num_blocks"], "blocks leaked"
