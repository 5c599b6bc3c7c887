"""Shared fixtures: a real encode-side connector process and a real language-side manager."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from peer_control import EncodePeer  # noqa: E402

from connector.allocator import BlockAllocator  # noqa: E402
from connector.buffers import BufferPool  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
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
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = peer.call("stats")
        if stats["free_blocks"] == stats["num_blocks"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
