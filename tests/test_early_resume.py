"""The optional early-total extension: our peers resume while round one is written; fork peers
see exactly the fork's messages."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
from test_transfer import transfer

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.messages import InitMsg, ResumeMsg, StatusMsg, decode_language_bound
from connector.poll import KVPoll
from connector.receiver import EmbeddingReceiverManager
from connector.sender import EmbeddingSenderManager
from connector.transport import Transport
from harness.connector_peer import synthetic_embedding

pytestmark = pytest.mark.transports("mooncake", "memory")

EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"


def test_only_peers_with_our_register_frames_get_the_total_early(make_peer, raw_language, raw_pool) -> None:
    raw, (transport, pool) = raw_language, raw_pool
    raw.session = transport.session_id
    # The rooms left waiting for a resume end by themselves. Pings 60 s apart: the only one within
    # the test is the first write's (a periodic one, or one after a stall of half the interval,
    # would come too where the test is starved for seconds by a serial test beside it).
    peer = make_peer(resume_timeout=1, heartbeat_interval=60)
    raw.connect(peer.info["rank_port"])
    for room, fork in ((1, True), (2, False)):
        peer.call("stage", room=room, tokens=20_000, seed=room)
        raw.register(pool, fork=fork)
        raw.send(InitMsg(room, "127.0.0.1", raw.port, transport.session_id, tuple(range(64)), 1, 8192))
        first = raw.expect(room=room)  # room 1, left waiting for its resume, times out meanwhile
        if fork:
            assert first == StatusMsg(room, KVPoll.Transferring), first  # the fork's two frames
            assert raw.pings == 0  # a fork peer would not parse one
        else:
            assert first == StatusMsg(room, KVPoll.WaitingForInput, 0, "", 20_000), first
            assert raw.expect(room=room) == StatusMsg(room, KVPoll.Transferring, 8192)
            assert raw.pings == 1  # the first write to a new session waits for one ping round trip


def test_our_language_side_resumes_while_the_first_round_is_written(make_peer, make_language, monkeypatch) -> None:
    """The total comes before round one lands, and the language side asks for the rest on it. Round
    one's 58 MB land in tens of milliseconds: the language side hears of it only once it resumed
    (or after EVENTUALLY_S, when it never does), so a thread of it scheduled late cannot make the
    resume a late one."""
    real = EmbeddingReceiverManager._on_message
    held = []

    def on_message(manager: EmbeddingReceiverManager, frames: list[bytes]) -> None:
        try:
            msg = decode_language_bound(frames)
        except Exception:  # noqa: BLE001 - the manager's own handler refuses it
            msg = None
        if not held and isinstance(msg, StatusMsg) and msg.status in (KVPoll.Transferring, KVPoll.Success):
            held.append(msg)  # round one landed: its status waits for the early resume
            deadline = time.monotonic() + EVENTUALLY_S
            while manager.stats["early_resumes"] == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
        real(manager, frames)

    monkeypatch.setattr(EmbeddingReceiverManager, "_on_message", on_message)
    peer, lang = make_peer(), make_language()
    receiver = transfer(lang, peer, 5, 20_000)
    assert held and held[0].sent_tokens == 8192  # the status held was round one's
    assert receiver.resume_rounds == 1
    assert lang.manager.stats["early_resumes"] == 1


class GatedTransport(Transport):
    """In-process byte mover (``memmove``) that holds its first write until released, so a round
    written beside it finishes first. The fast path for ordering; the real one is above."""

    session_id = "127.0.0.1:1"

    def __init__(self) -> None:
        self.release, self.finished = threading.Event(), []
        self.first_started = threading.Event()  # the held write is inside the transport
        self._lock = threading.Lock()
        self._calls = 0

    def register(self, regions: list[tuple[int, int]]) -> None:
        pass

    def unregister(self, addresses: list[int]) -> None:
        pass

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        with self._lock:
            self._calls += 1
            call = self._calls
        if call == 1:
            self.first_started.set()
            assert self.release.wait(30)
        for src, dst, n in zip(src_addrs, dst_addrs, lengths, strict=True):
            ctypes.memmove(dst, src, n)
        self.finished.append(call)

    def close(self) -> None:
        pass


@pytest.mark.fast
def test_a_round_written_beside_the_first_reports_after_it(raw_language) -> None:
    raw = raw_language
    config = ConnectorConfig(num_blocks=200, hidden_size=64, transfer_workers=2)
    src, dst = (BufferPool(200, 128, 64) for _ in range(2))
    transport, allocator = GatedTransport(), BlockAllocator(200)
    sender = EmbeddingSenderManager(config, transport, src, allocator)
    try:
        raw.connect(sender.rank_port)
        raw.register(dst)
        emb = synthetic_embedding(20_000, 64, "bfloat16", seed=3)
        sender.create_sender(7).send(emb)
        raw.send(InitMsg(7, "127.0.0.1", raw.port, raw.session, tuple(range(64)), 1, 8192))
        assert raw.expect() == StatusMsg(7, KVPoll.WaitingForInput, 0, "", 20_000)
        rest = tuple(range(64, 64 + dst.blocks_for(20_000 - 8192)))
        raw.send(ResumeMsg(7, "127.0.0.1", raw.port, raw.session, rest, 1, 8192, len(rest) * 128))
        deadline = time.monotonic() + EVENTUALLY_S
        while transport.finished != [2]:  # the second round landed while the first is held
            assert time.monotonic() < deadline, transport.finished
            time.sleep(0.01)
        assert raw.recv(0.2) is None, "a status went out before the first round landed"
        assert sender.stats["pipelined_rounds"] == 1
        transport.release.set()
        assert raw.expect() == StatusMsg(7, KVPoll.Transferring, 8192)
        assert raw.expect() == StatusMsg(7, KVPoll.Success, 20_000)
        out = Embedding.empty(20_000, 64, "bfloat16")
        dst.read_into(list(range(64)) + list(rest), out, 0, 20_000)
        out.aux[:] = dst.aux[0]  # aux travels in the first block of round one
        assert out.digests() == emb.digests()
        deadline = time.monotonic() + EVENTUALLY_S
        while not allocator.all_free():
            assert time.monotonic() < deadline, "source blocks not freed"
            time.sleep(0.01)
    finally:
        transport.release.set()
        sender.close()
