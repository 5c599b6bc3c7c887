"""Shared fixtures: a real encode-side connector process and a real language-side manager."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import zmq  # noqa: E402
from peer_control import EncodePeer  # noqa: E402

from connector.allocator import BlockAllocator  # noqa: E402
from connector.buffers import BufferPool  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.messages import LanguageBound, PingMsg, PongMsg, RegisterMsg, decode_language_bound  # noqa: E402
from connector.mooncake_transport import MooncakeTransport  # noqa: E402
from connector.receiver import EmbeddingReceiverManager  # noqa: E402


@dataclass
class Language:
    manager: EmbeddingReceiverManager
    allocator: BlockAllocator
    pool: BufferPool
    config: ConnectorConfig


def _peer_args(num_blocks: int, block_size: int, hidden_size: int, **extra: object) -> list[str]:
    args = ["--num-blocks", str(num_blocks), "--block-size", str(block_size), "--hidden-size", str(hidden_size)]
    for key, value in extra.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


@pytest.fixture
def make_peer() -> Iterator[Callable[..., EncodePeer]]:
    """Start encode peers; on teardown each live one must have every source block free."""
    peers: list[EncodePeer] = []

    def start(num_blocks: int = 320, block_size: int = 128, hidden_size: int = 3584, **extra: object) -> EncodePeer:
        peer = EncodePeer(*_peer_args(num_blocks, block_size, hidden_size, **extra))
        peers.append(peer)
        return peer

    yield start
    leaks = []
    for peer in peers:
        if peer.proc.poll() is None:
            stats = wait_peer_idle(peer)
            if stats["free_blocks"] != stats["num_blocks"]:
                leaks.append(stats)
        peer.close()
    assert not leaks, f"encode peer leaked blocks: {leaks}"


@pytest.fixture
def make_language() -> Iterator[Callable[..., Language]]:
    """Language-side managers; on teardown every block must be back in each pool."""
    made: list[tuple[Language, MooncakeTransport]] = []

    def start(**overrides: object) -> Language:
        config = ConnectorConfig(**{"num_blocks": 256, **overrides})  # type: ignore[arg-type]
        pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
        allocator = BlockAllocator(config.num_blocks)
        transport = MooncakeTransport(config.host)
        manager = EmbeddingReceiverManager(config, transport, pool, allocator)
        lang = Language(manager, allocator, pool, config)
        made.append((lang, transport))
        return lang

    yield start
    try:
        for lang, _ in made:
            assert lang.manager.active_rooms() == 0, "rooms left open on the language side"
            assert lang.allocator.all_free(), f"language pool leaked: {lang.allocator.free_blocks}/{lang.allocator.num_blocks} free"
    finally:
        for lang, transport in made:
            lang.manager.close()
            transport.close()


def wait_peer_idle(peer: EncodePeer, timeout: float = 10.0) -> dict:
    """Peer stats once its rooms have all ended (frees can trail the last status by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = peer.call("stats")
        if stats["free_blocks"] == stats["num_blocks"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


class RawLanguage:
    """A bare language side on the wire, standing in for a language worker in tests that speak
    raw ZMQ: ``pull`` gets the encoder's messages, ``push`` reaches the encoder. ``recv``
    answers pings as our language workers do (as ``session``) and returns the next other
    message."""

    def __init__(self, ctx: zmq.Context, session: str = "127.0.0.1:2") -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = ctx.socket(zmq.PUSH)
        self.session = session
        self.pings = 0

    def connect(self, rank_port: int) -> None:
        self.push.connect(f"tcp://127.0.0.1:{rank_port}")

    def send(self, msg) -> None:
        self.push.send_multipart(msg.encode())

    def register(self, pool: BufferPool, fork: bool = False) -> None:
        """Register ``pool`` under ``session``: with our extension frames, or as a fork peer does."""
        extra = () if fork else (1, pool.num_blocks, pool.item_lens)
        self.send(RegisterMsg("127.0.0.1", self.port, self.session, pool.base_ptrs, *extra))

    def recv(self, timeout: float = 30.0) -> LanguageBound | None:
        """The next message that is not a ping (answered), or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.pull.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            msg = decode_language_bound(self.pull.recv_multipart())
            if not isinstance(msg, PingMsg):
                return msg
            self.pings += 1
            self.push.send_multipart(PongMsg(self.session, msg.seq).encode())
        return None

    def answer_ping(self, timeout: float = 10.0) -> None:
        """Wait for the encoder's next ping and answer it (nothing else may come first)."""
        assert self.pull.poll(int(timeout * 1000)), "no ping from the encoder"
        msg = decode_language_bound(self.pull.recv_multipart())
        assert isinstance(msg, PingMsg), msg
        self.pings += 1
        self.push.send_multipart(PongMsg(self.session, msg.seq).encode())

    def expect(self, timeout: float = 30.0, room: int | None = None) -> LanguageBound:
        """The next message (for ``room``, when given: others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            assert msg is not None, "no message from the encoder"
            if room is None or msg.room == room:
                return msg

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)


@pytest.fixture
def raw_language() -> Iterator[RawLanguage]:
    ctx = zmq.Context()
    raw = RawLanguage(ctx)
    yield raw
    raw.close()
    ctx.term()


@pytest.fixture
def raw_pool():
    """A registered destination pool with its Mooncake engine, for tests that speak raw ZMQ."""
    transport = MooncakeTransport()
    pool = BufferPool(300, 128, 3584)
    transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
    yield transport, pool
    transport.unregister([b.ctypes.data for b in pool.buffers])
    transport.close()
