"""Sleep and wake at the connector level, at chosen moments: rooms survive bit-identical."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import zmq
from conftest import ManualClock
from test_faults import start_room, wait_for

from connector.allocator import BlockAllocator
from connector.bootstrap import BootstrapServer
from connector.buffers import BufferPool
from connector.failures import FailureKind
from connector.messages import (
    InitMsg,
    StatusMsg,
    SuspendAckMsg,
    SuspendMsg,
    decode_encoder_bound,
)
from connector.poll import KVPoll

pytestmark = pytest.mark.transports("mooncake", "memory")


def language_sleep_and_wake(lang, receivers):
    """What the language worker does: suspend, checkpoint, release, re-create, restore, resume."""
    lang.manager.suspend_all(receivers, timeout=30)
    ckpts = [r.checkpoint() for r in receivers]
    assert lang.allocator.all_free()
    lang.manager.detach_pool()
    old_base = lang.pool.base_ptrs
    lang.pool = BufferPool(lang.config.num_blocks, lang.config.block_size, lang.config.hidden_size)
    lang.allocator = BlockAllocator(lang.config.num_blocks)
    lang.manager.attach_pool(lang.pool, lang.allocator)
    assert lang.pool.base_ptrs != old_base
    restored = [lang.manager.restore(c) for c in ckpts]
    for r in restored:
        assert r.try_resume()
    return ckpts, restored


def finish(lang, receiver, expected, timeout=60):
    deadline = time.monotonic() + timeout
    while receiver.poll() != KVPoll.Success:
        receiver.failure_exception()
        assert time.monotonic() < deadline, "room did not finish"
        if not receiver.try_resume():
            receiver.wait(0.5)
    emb = receiver.assemble()
    assert emb.digests() == expected
    emb.release()


def test_language_sleeps_between_rounds_while_the_encoder_waits_for_its_resume(make_peer, make_language) -> None:
    peer, lang = make_peer(resume_timeout=1), make_language()
    expected = peer.call("stage", room=1, tokens=20_000, seed=1)["digests"]
    receiver = start_room(lang, peer, 1, 64)
    wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
    ckpts, (restored,) = language_sleep_and_wake(lang, [receiver])
    assert ckpts[0].landed == 8192 and ckpts[0].total_tokens == 20_000
    finish(lang, restored, expected)
    assert restored.resume_rounds == 1


def test_a_suspended_room_outlives_the_encoders_resume_timeout(make_peer, make_language) -> None:
    peer, lang = make_peer(resume_timeout=1), make_language()
    expected = peer.call("stage", room=2, tokens=9000, seed=2)["digests"]
    receiver = start_room(lang, peer, 2, 64)
    wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
    lang.manager.suspend_all([receiver], timeout=30)
    time.sleep(2.5)  # asleep for longer than the encoder's resume timeout
    assert peer.call("status", room=2)["status"] == "Transferring"
    ckpt = receiver.checkpoint()
    finish(lang, lang.manager.restore(ckpt), expected)


def test_language_sleeps_mid_round_and_the_round_lands_before_the_ack(make_peer, make_language) -> None:
    peer, lang = make_peer(num_blocks=600), make_language(num_blocks=300)
    expected = peer.call("stage", room=3, tokens=36_000, seed=3)["digests"]
    receiver = start_room(lang, peer, 3, 100)  # 12,800 tokens in the first round
    time.sleep(0.005)
    ckpts, (restored,) = language_sleep_and_wake(lang, [receiver])
    assert ckpts[0].landed in (0, 12_800)
    finish(lang, restored, expected)


def test_language_sleeps_before_any_data_and_starts_over_with_a_resume(make_peer, make_language) -> None:
    peer, lang = make_peer(), make_language()
    receiver = start_room(lang, peer, 4, 64)  # the encoder has no data for room 4 yet
    ckpts, (restored,) = language_sleep_and_wake(lang, [receiver])
    assert ckpts[0].landed == 0 and ckpts[0].total_tokens is None
    expected = peer.call("stage", room=4, tokens=10_000, seed=4)["digests"]
    finish(lang, restored, expected)


def test_encoder_sleeps_with_rooms_in_every_phase_and_they_all_finish(make_peer, make_language, connector_kind) -> None:
    peer = make_peer(num_blocks=600)
    # Probes time out after one interval: 1 s leaves room for a loaded machine while the peer copies
    # 360 MB out of its pool, and the peer is found dead only after misses for as long as the waiting
    # timeout (a probe or two missed in a stall decide nothing: the waiting timeout is what the rooms
    # must outlive). Room 11's first round (183 MB) must land within the waiting timeout, which
    # a CI machine running another test beside this one took more than 2.5 s for; past it, only
    # "asleep" saves the rooms. In memory the language side's timeouts and probes run on the test's clock.
    clock = ManualClock() if connector_kind == "memory" else None
    interval_s, waiting_s = 1.0, 5.0
    lang = make_language(num_blocks=300, heartbeat_interval=interval_s, waiting_timeout=waiting_s, clock=clock,
                         heartbeat_max_failures=int(waiting_s / interval_s))
    expected = {room: peer.call("stage", room=room, tokens=tokens, seed=room)["digests"]
                for room, tokens in ((10, 20_000), (11, 30_000), (12, 500))}
    waiting = start_room(lang, peer, 10, 64)
    wait_for(lambda: waiting.poll() == KVPoll.Transferring, 30, "the first round")  # between rounds
    writing = start_room(lang, peer, 11, 200)  # mid-round
    kept = peer.call("sleep")["kept_bytes"]
    assert kept >= (20_000 + 30_000 + 500) * 3584 * 2
    queued = start_room(lang, peer, 12, 8)  # init while the encoder sleeps
    assert waiting.try_resume()  # resume while the encoder sleeps
    if clock is None:
        time.sleep(waiting_s + 1.5)  # past the waiting timeout: a sleeping peer is alive, its rooms wait
    else:
        clock.advance(interval_s)  # one heartbeat: the probe finds the encoder asleep
        wait_for(lambda: lang.manager.encoders.peer(peer.bootstrap_addr).asleep_since is not None, 30, "the probe")
        clock.advance(waiting_s + 0.5)  # past the waiting timeout
        time.sleep(0.6)  # two of the watch's timeout checks
    assert all(r.poll() != KVPoll.Failed for r in (waiting, writing, queued))
    peer.call("wake")
    for room, receiver in ((10, waiting), (11, writing), (12, queued)):
        finish(lang, receiver, expected[room])
    wait_for(lang.allocator.all_free, 5, "language blocks")


def test_a_suspend_during_the_last_round_is_acked_after_its_success(make_peer, raw_language, raw_pool) -> None:
    """On the wire: the round's Success status comes before the SUSPEND_ACK, never after."""
    raw, (transport, pool) = raw_language, raw_pool
    raw.session = transport.session_id
    peer = make_peer(num_blocks=600)
    peer.call("stage", room=20, tokens=36_000, seed=20)
    raw.connect(peer.info["rank_port"])
    raw.register(pool)
    raw.send(InitMsg(20, "127.0.0.1", raw.port, transport.session_id, tuple(range(282)), 1, 282 * 128))
    raw.answer_ping()  # the first write to a new session waits for this: suspend once it can start
    raw.send(SuspendMsg(20, "127.0.0.1", raw.port, 1))  # lands while the round is written
    first = raw.expect()
    second = raw.expect()
    assert isinstance(first, StatusMsg) and first.status == KVPoll.Success, first
    assert isinstance(second, SuspendAckMsg), second


@contextlib.contextmanager
def silent_encoder() -> Iterator[tuple[BootstrapServer, zmq.Socket]]:
    """An encoder's bootstrap and a PULL socket at its route that takes every message and answers none."""
    ctx = zmq.Context()
    encoder_pull = ctx.socket(zmq.PULL)
    encoder_port = encoder_pull.bind_to_random_port("tcp://127.0.0.1")
    bootstrap = BootstrapServer("127.0.0.1", 0)
    bootstrap.put_route(1, 1, "127.0.0.1", encoder_port, 0)
    try:
        yield bootstrap, encoder_pull
    finally:
        bootstrap.close()
        encoder_pull.close(0)
        ctx.term()


@pytest.mark.serial
def test_an_encoder_that_never_acks_the_suspend_is_aborted_and_the_pool_can_still_be_released(make_language) -> None:
    """A fake encoder that takes every message and answers none: sleep must still get every block back
    (those of the unacked abort stay out of use until the pool is deregistered: nothing lands then)."""
    suspend_wait, ack_wait, hold = 0.5, 1.0, 300.0
    lang = make_language(abort_ack_timeout=ack_wait, unacked_block_hold=hold)
    with silent_encoder() as (bootstrap, encoder_pull):
        receiver = lang.manager.create_receiver(f"127.0.0.1:{bootstrap.port}", 41)
        receiver.init(lang.allocator.allocate(4))
        started = time.monotonic()
        lang.manager.suspend_all([receiver], timeout=suspend_wait)
        assert receiver.poll() == KVPoll.Failed and "did not acknowledge the suspend" in receiver.state.reason
        # The abort went unanswered too: past its ack wait, its blocks are only kept out of use.
        assert not lang.allocator.all_free() and lang.manager.only_unacked_blocks_out()
        # the suspend's wait, then the abort's ack wait (plus 4 blocks at --min-link-rate: under a
        # millisecond); not the unacked blocks' hold, which the sleep does not wait out
        assert time.monotonic() - started < suspend_wait + ack_wait + 3.0
        kinds = [type(decode_encoder_bound(encoder_pull.recv_multipart())).__name__ for _ in range(4)]
        assert kinds == ["RegisterMsg", "InitMsg", "SuspendMsg", "AbortMsg"]
        lang.manager.detach_pool()  # raised "blocks still in use" before the suspend waited for them
        assert lang.allocator.all_free()  # deregistered, and its memory set aside: a late write lands unread
        assert [pool for pool, _ in lang.manager._retired_pools] == [lang.pool]
        lang.manager.attach_pool(lang.pool, lang.allocator)


def test_a_restarted_encoder_frees_the_blocks_of_rooms_aborted_at_its_old_process(make_language) -> None:
    """An abort the old process never acked: once another process answers at its address, nothing
    of the old one can land, so the room's blocks come back then, not after --unacked-block-hold."""
    lang = make_language(abort_ack_timeout=0.5, heartbeat_interval=0.5, unacked_block_hold=300.0)
    with silent_encoder() as (bootstrap, _):
        receiver = lang.manager.create_receiver(f"127.0.0.1:{bootstrap.port}", 42)
        receiver.init(lang.allocator.allocate(4))
        receiver.abort(FailureKind.CANCELLED, "the client went away")
        wait_for(lambda: receiver.machine.unacked, 10, "the ack wait to pass")
        assert not lang.allocator.all_free()
        bootstrap.incarnation = "another-process"  # restarted at the same address
        wait_for(lang.allocator.all_free, 10, "the blocks of the room aborted at the old process")
        assert lang.manager.stats["peer_restarted"] == 1
