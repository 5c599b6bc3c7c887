"""The encode side while a write is in flight: a Failed status waits for it, a pause that times
out leaves the encoder working, an unexpected write error fails only its room, destinations of
one room get the same rounds. In-process with a gated byte mover (the fast path; the real
Mooncake paths are in test_faults, test_transfer and test_sleep_*)."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from conftest import ManualClock, RawLanguage
from test_early_resume import GatedTransport
from test_faults import wait_for

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.failures import FailureKind, TransferFailure
from connector.messages import AbortAckMsg, AbortMsg, InitMsg, ResumeMsg, StatusMsg
from connector.poll import KVPoll
from connector.sender import HELD_WRITE_MAX_S, EmbeddingSender, EmbeddingSenderManager
from connector.transport import WriteUnsettled
from harness.connector_peer import synthetic_embedding

pytestmark = pytest.mark.fast

EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"
TICKS = 0.8  # a few of the sender's 0.25 s housekeeping ticks: long enough to act, if it would
PAUSE_S = 30.0  # the longest a pause waits here for writes in flight


class FailingFirstWrite(GatedTransport):
    """Its first write raises something that is not a TransferError; later writes go through."""

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        with self._lock:
            self._calls += 1
            if self._calls == 1:
                raise RuntimeError("engine handle vanished")
        self.release.set()
        super().write(peer_session, src_addrs, dst_addrs, lengths)


class HeldFirstWrite(GatedTransport):
    """Its first write is given up on while its parts are still held (Mooncake's connect into a
    cut link): they land once ``release`` is set; later writes go through."""

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        with self._lock:
            self._calls += 1
            call = self._calls
        if call > 1:
            self.release.set()
            return super().write(peer_session, src_addrs, dst_addrs, lengths)
        self.first_started.set()

        def settled() -> bool:
            if self.release.is_set() and not self.finished:
                for src, dst, n in zip(src_addrs, dst_addrs, lengths, strict=True):
                    ctypes.memmove(dst, src, n)  # it lands late: the source had to stay as it was
                self.finished.append(call)
            return bool(self.finished)

        raise WriteUnsettled("write of 1 part(s) not settled after 10.0s", settled)


@pytest.fixture
def encoder(raw_language) -> Iterator:
    """Start an in-process sender on a transport class; returns (sender, allocator, start_room)."""
    raw = raw_language
    made = []

    def start(transport: GatedTransport, clock: Callable[[], float] = time.monotonic):
        sender = EmbeddingSenderManager(ConnectorConfig(num_blocks=64, hidden_size=64), transport,
                                        BufferPool(64, 128, 64), allocator := BlockAllocator(64), clock)
        dst = BufferPool(64, 128, 64)  # the gated transport writes here: it must outlive the sender
        made.append((sender, transport, dst))
        raw.connect(sender.rank_port)
        raw.register(dst)

        def start_room(room: int) -> EmbeddingSender:  # 1200 tokens: one round into 10 destination blocks
            handle = sender.create_sender(room)
            handle.send(synthetic_embedding(1200, 64, "bfloat16", seed=room))
            dst_blocks = tuple(range(10 * (room % 6), 10 * (room % 6) + 10))
            raw.send(InitMsg(room, "127.0.0.1", raw.port, raw.session, dst_blocks, 1, 1280))
            return handle

        return sender, allocator, start_room

    yield start, raw
    for sender, transport, _ in made:
        transport.release.set()
        sender.close()


def room_one_held_in_flight(encoder):
    """An encoder whose room 1 is being written and held there until ``transport.release``."""
    start, raw = encoder
    transport = GatedTransport()
    sender, allocator, start_room = start(transport)
    start_room(1)
    raw.answer_ping()  # the first write to a new session waits for it
    # Inside the transport, not only planned: a write planned but not yet begun when its room
    # fails is skipped (nothing can land), and the Failed status rightly goes out at once.
    assert transport.first_started.wait(EVENTUALLY_S), "the write did not start"
    return sender, allocator, start_room, transport, raw


def test_a_failed_status_waits_until_the_write_in_flight_has_landed(encoder) -> None:
    sender, allocator, _, transport, raw = room_one_held_in_flight(encoder)
    sender.abort_all(FailureKind.ASLEEP, "the encode worker went to sleep (preserve_state=false)")
    # The language side frees its blocks on Failed: it must not hear of it while bytes may land.
    assert raw.recv(0.3) is None, "Failed went out while the write was still in flight"
    transport.release.set()
    msg = raw.expect()
    assert (msg.room, msg.status) == (1, KVPoll.Failed) and msg.reason.startswith("asleep: ")
    assert "went to sleep" in msg.reason
    wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")


def test_a_pause_that_times_out_leaves_the_encoder_writing(encoder) -> None:
    sender, allocator, start_room, transport, raw = room_one_held_in_flight(encoder)
    with pytest.raises(TimeoutError, match="writes still in flight"):
        sender.pause(timeout=0.2)
    transport.release.set()
    assert raw.expect() == StatusMsg(1, KVPoll.Success, 1200)
    start_room(2)  # before the fix the encoder stayed paused: no write, no timeout, for ever
    assert raw.expect() == StatusMsg(2, KVPoll.Success, 1200)
    wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")


def test_an_unexpected_write_error_fails_its_room_and_the_worker_goes_on(encoder) -> None:
    start, raw = encoder
    sender, allocator, start_room = start(FailingFirstWrite())
    start_room(1)
    msg = raw.expect()
    assert (msg.room, msg.status) == (1, KVPoll.Failed)
    assert "write failed unexpectedly: RuntimeError: engine handle vanished" in msg.reason
    wait_for(allocator.all_free, EVENTUALLY_S, "room 1's source blocks")
    for room in (2, 3, 4):  # more rooms than transfer workers: none of them died
        start_room(room)
        assert raw.expect() == StatusMsg(room, KVPoll.Success, 1200)
    wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")


def test_a_write_given_up_while_still_held_keeps_its_blocks_status_and_ack_until_it_settles(encoder) -> None:
    """Mooncake gave up on a write it still holds: the room fails at once (its encode request is
    answered), but the language side hears nothing that would let it reuse the blocks (Failed,
    ABORT_ACK) and the source blocks stay, until the held parts settle; no second attempt."""
    start, raw = encoder
    transport = HeldFirstWrite()
    sender, allocator, start_room = start(transport)
    delivered = start_room(1).delivered
    raw.answer_ping()
    with pytest.raises(TransferFailure, match="transfer to language peer 127.0.0.1:.* not settled after 10.0s"):
        delivered.result(EVENTUALLY_S)
    raw.send(AbortMsg(1, "127.0.0.1", raw.port, raw.generation))
    assert raw.recv(0.5) is None, "a Failed status or an ack went out while the write was held"
    assert not allocator.all_free(), "the source blocks were freed while Mooncake could still read them"
    assert sender.stats["writes_held"] == 1
    transport.release.set()  # the held parts land (the link came back)
    msg = raw.expect()
    assert (msg.room, msg.status) == (1, KVPoll.Failed) and "not settled" in msg.reason
    assert raw.expect() == AbortAckMsg(1, raw.generation)
    wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")
    assert transport._calls == 1, "a held write was written once more"
    start_room(2)  # the worker goes on
    assert raw.expect() == StatusMsg(2, KVPoll.Success, 1200)


def test_a_write_held_past_the_limit_frees_its_room(encoder) -> None:
    start, raw = encoder
    clock = ManualClock()  # the limit is crossed by moving the sender's clock, not by waiting it out
    sender, allocator, start_room = start(HeldFirstWrite(), clock)
    start_room(1)
    raw.answer_ping()
    wait_for(lambda: sender.stats["writes_held"] == 1, EVENTUALLY_S, "the write to be given up on")
    raw.send(AbortMsg(1, "127.0.0.1", raw.port, raw.generation))
    clock.advance(HELD_WRITE_MAX_S - 1)
    assert raw.recv(TICKS) is None, "a Failed status or an ack went out while the write was held"
    assert not allocator.all_free(), "the source blocks were freed before the limit"
    clock.advance(2)
    msg = raw.expect()  # after the limit, though it never settled
    assert (msg.room, msg.status) == (1, KVPoll.Failed)
    assert raw.expect() == AbortAckMsg(1, raw.generation)
    wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")


def test_a_pause_is_refused_at_once_while_a_write_is_held(encoder) -> None:
    """The encode worker's sleep waits for writes in flight; a held one may take minutes."""
    start, raw = encoder
    transport = HeldFirstWrite()
    sender, allocator, start_room = start(transport)
    start_room(1)
    raw.answer_ping()
    wait_for(lambda: sender.stats["writes_held"] == 1, EVENTUALLY_S, "the write to be given up on")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"Mooncake still holds writes given up on \(rooms 1\)"):
        sender.pause(timeout=PAUSE_S)
    assert time.monotonic() - started < PAUSE_S / 2  # refused, not waited out: halfway to the pause's timeout
    transport.release.set()
    assert raw.expect().status == KVPoll.Failed
    sender.pause(timeout=PAUSE_S)  # settled: nothing in flight


def test_destinations_with_unequal_allocations_get_the_same_round() -> None:
    """Two language peers of one room: each round is the smaller allocation, for both alike."""
    ctx = zmq.Context()
    transport = GatedTransport()
    transport.release.set()
    allocator = BlockAllocator(64)
    sender = EmbeddingSenderManager(ConnectorConfig(num_blocks=64, hidden_size=64), transport,
                                    BufferPool(64, 128, 64), allocator)
    peers = [(RawLanguage(ctx, session), BufferPool(64, 128, 64)) for session in ("127.0.0.1:2", "127.0.0.1:3")]
    try:
        for raw, dst in peers:
            dst.embeddings[:] = 0
            raw.connect(sender.rank_port)
            raw.register(dst)
        emb = synthetic_embedding(2000, 64, "bfloat16", seed=9)
        sender.create_sender(5).send(emb)
        for (raw, _), allocated in zip(peers, (1280, 2560), strict=True):
            raw.send(InitMsg(5, "127.0.0.1", raw.port, raw.session, tuple(range(allocated // 128)), 2, allocated))
        for raw, _ in peers:  # the round waits until both sessions answered a ping
            raw.answer_ping()
        assert [raw.expect() for raw, _ in peers] == [StatusMsg(5, KVPoll.Transferring, 1280)] * 2
        assert not peers[1][1].embeddings[10:].any(), "the larger allocation got more than the status says"
        for raw, _ in peers:
            raw.send(ResumeMsg(5, "127.0.0.1", raw.port, raw.session, tuple(range(20, 26)), 2, 1280, 768))
        assert [raw.expect() for raw, _ in peers] == [StatusMsg(5, KVPoll.Success, 2000)] * 2
        for _, dst in peers:
            out = Embedding.empty(2000, 64, "bfloat16")
            dst.read_into(list(range(10)) + list(range(20, 26)), out, 0, 2000)
            out.aux[:] = dst.aux[0]
            assert out.digests() == emb.digests()
        wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")
    finally:
        sender.close()
        for raw, _ in peers:
            raw.close()
        ctx.term()
