"""Failures: dead and misconfigured peers, aborts, timeouts, malformed and stale messages."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq
from conftest import ManualClock
from test_transfer import transfer

from connector.bootstrap import BootstrapServer
from connector.encoder_peers import Probe
from connector.failures import FailureKind, TransferFailure
from connector.messages import (
    AbortAckMsg,
    InitMsg,
    RegisterMsg,
    ResumeMsg,
    StatusMsg,
    decode_encoder_bound,
)
from connector.poll import KVPoll
from connector.receiver import finish_receiving, receive_embedding

pytestmark = pytest.mark.transports("mooncake", "memory")

EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def start_room(lang, peer, room: int, blocks: int):
    receiver = lang.manager.create_receiver(peer.bootstrap_addr, room)
    receiver.init(lang.allocator.allocate(blocks))
    return receiver


def assert_completes(receiver, digests: list) -> None:
    """``receiver``'s room finishes (its resumes asked for) with exactly ``digests``."""
    emb = finish_receiving(receiver, 60)
    try:
        assert emb.digests() == digests
    finally:
        emb.release()


@pytest.mark.serial
@pytest.mark.transports("mooncake")  # a process is killed
def test_sender_killed_mid_round_fails_rooms_naming_the_peer_and_receiver_keeps_serving(make_peer, make_language) -> None:
    lang = make_language(num_blocks=256, heartbeat_interval=0.5, heartbeat_max_failures=2)
    peer = make_peer(num_blocks=600)
    peer.call("stage", room=1, tokens=3 * 8192, seed=1)
    peer.call("stage", room=2, tokens=40_000, seed=2)
    waiting = start_room(lang, peer, 1, 64)  # partial: will wait for a resume that never comes
    wait_for(lambda: waiting.poll() == KVPoll.Transferring, 30, "the first round")
    writing = start_room(lang, peer, 2, 192)  # 24,576 of 40,000 tokens: a large write in flight
    os.kill(peer.proc.pid, signal.SIGKILL)
    peer.proc.wait()
    killed_at = time.monotonic()
    window = 0.5 * 2 + 2.0  # heartbeat interval x misses, plus one interval and scheduling slack
    for receiver in (waiting, writing):
        wait_for(lambda r=receiver: r.poll() == KVPoll.Failed, window, f"room {receiver.room} to fail")
        with pytest.raises(TransferFailure, match=f"encode peer {peer.bootstrap_addr}.*dead.*heartbeats missed"):
            receiver.failure_exception()
    assert time.monotonic() - killed_at < window
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the language pool to be free")
    new_peer = make_peer()
    transfer(lang, new_peer, 3, 9000)


@pytest.mark.serial  # next to the other serial test: under xdist they wait once for the other worker
@pytest.mark.parametrize("fork_register", [False, True])
def test_block_size_mismatch_fails_fast_with_a_reason(make_peer, make_language, monkeypatch, fork_register) -> None:
    peer, lang = make_peer(block_size=128), make_language(block_size=64)
    if fork_register:  # no item lengths: the init's allocated_tokens gives the mismatch away
        full = lang.manager._register_msg()
        monkeypatch.setattr(lang.manager, "_register_msg",
                            lambda: RegisterMsg(full.endpoint, full.dst_port, full.session_id, full.base_ptrs))
    peer.call("stage", room=1, tokens=1000, seed=1)
    start = time.monotonic()
    # A peer registered as the fork gets the fork's two-frame Failed: no reason travels.
    receive_s = 10
    with pytest.raises(TransferFailure, match="no reason given" if fork_register else "pool layout mismatch"):
        receive_embedding(lang.manager, peer.bootstrap_addr, 1, timeout=receive_s)
    assert time.monotonic() - start < receive_s / 2  # fast: refused, not waited out to the receive's timeout
    assert "mismatch" in peer.call("status", room=1)["reason"]


@pytest.mark.parametrize("next_probe", ["answered", "missed"])
def test_a_probe_sent_before_a_room_was_created_does_not_fail_it(make_peer, make_language, next_probe: str) -> None:
    """Two probes missed in a row declare an encoder dead, but a probe speaks only for the rooms
    that existed when it was sent: a room created after the last one left (its init went
    through, so a cut may have healed meanwhile) is spared, and the next probe decides for it:
    answered, it completes with every row the encoder staged; missed, it fails as the others did.
    (Seen in tests/test_hosts.py: a probe sent into a cut timed out just after the heal and
    failed the first request sent after it.)"""
    clock = ManualClock()
    lang = make_language(clock=clock, heartbeat_interval=3600, heartbeat_max_failures=2)  # probes only from here
    peer = make_peer()
    expected = {room: peer.call("stage", room=room, tokens=2000, seed=room)["digests"] for room in (1, 2)}
    older = start_room(lang, peer, 1, 8)  # 1,024 tokens: a partial first round
    wait_for(lambda: older.poll() == KVPoll.Transferring, 30, "room 1's first round")
    sent = clock()
    clock.advance(1)
    younger = start_room(lang, peer, 2, 8)
    wait_for(lambda: younger.poll() == KVPoll.Transferring, 30, "room 2's first round")
    for _ in range(2):
        lang.manager._on_probe(peer.bootstrap_addr, Probe(False, why="ConnectTimeout"), started=sent)
    assert older.poll() == KVPoll.Failed
    with pytest.raises(TransferFailure, match="2 heartbeats missed"):
        older.failure_exception()
    assert younger.poll() == KVPoll.Transferring
    assert "heartbeats missed" in lang.manager.dead_peer(peer.bootstrap_addr)
    if next_probe == "answered":
        lang.manager._on_probe(peer.bootstrap_addr, Probe(True, "OK"), started=clock())
        assert lang.manager.dead_peer(peer.bootstrap_addr) == ""
        assert_completes(younger, expected[2])
    else:
        lang.manager._on_probe(peer.bootstrap_addr, Probe(False, why="ConnectTimeout"), started=clock())
        assert younger.poll() == KVPoll.Failed
        with pytest.raises(TransferFailure, match="heartbeats missed"):
            younger.failure_exception()
    wait_for(lang.allocator.all_free, 10, "every block of the language pool back")


class PingsCut:
    """Stands in for the encoder's sockets in its :class:`LanguagePeers`, which send only pings:
    while ``cut`` is set each ping is dropped (a link cut from the encoder to the language worker,
    or a ping held in TCP's retransmission back-off after it healed), otherwise sent."""

    def __init__(self, push) -> None:
        self.push, self.cut, self.dropped = push, True, 0

    def try_send(self, host: str, port: int, frames: list[bytes]) -> bool:
        if self.cut:
            self.dropped += 1
            return True
        return self.push.try_send(host, port, frames)


@pytest.mark.transports("memory")  # the encoder runs on the test's clock
@pytest.mark.parametrize("next_ping", ["answered", "missed"])
def test_a_ping_sent_before_a_language_worker_joined_a_room_does_not_fail_it(make_peer, make_language, next_ping: str) -> None:
    """The encode side's heartbeat, as the test above is the language side's: two pings missed
    declare a language worker dead, but a ping speaks only for the rooms that existed when it
    was sent. The room created after the last missed ping left is spared, and the next ping
    decides for it: answered, it completes with every row staged; missed, it fails too."""
    interval = 10.0
    clock = ManualClock()
    peer = make_peer(clock=clock, heartbeat_interval=interval, heartbeat_max_failures=2, resume_timeout=3600,
                     bootstrap_timeout=3600)
    lang = make_language()
    manager = peer.service.manager
    expected = {room: peer.call("stage", room=room, tokens=2000, seed=room)["digests"] for room in (1, 2)}
    older = start_room(lang, peer, 1, 8)  # 1,024 tokens: a partial first round
    wait_for(lambda: older.poll() == KVPoll.Transferring, 30, "room 1's first round")
    pings = manager.peers._push = PingsCut(manager.peers._push)

    def beat(pinged: int) -> None:  # one heartbeat interval passes; the encoder's housekeeping beats
        clock.advance(interval)
        wait_for(lambda: pings.dropped + (not pings.cut) >= pinged, EVENTUALLY_S, f"ping {pinged}")

    beat(1)
    beat(2)  # the first ping missed
    clock.advance(1)
    younger = start_room(lang, peer, 2, 8)
    wait_for(lambda: younger.poll() == KVPoll.Transferring, 30, "room 2's first round")
    clock.advance(interval - 1)  # the second missed: dead, for room 1
    wait_for(lambda: older.poll() == KVPoll.Failed, EVENTUALLY_S, "room 1 to fail")
    with pytest.raises(TransferFailure, match="is dead: 2 pings in a row unanswered"):
        older.failure_exception()
    time.sleep(0.5)  # two housekeeping ticks: room 2 would have failed by now
    assert younger.poll() == KVPoll.Transferring and peer.call("status", room=2)["status"] == "Transferring"
    if next_ping == "answered":
        pings.cut = False  # its resume's write waits for a ping round trip (the session is silent)
        assert_completes(younger, expected[2])
    else:
        beat(3)  # the next ping, missed too
        clock.advance(interval)
        wait_for(lambda: younger.poll() == KVPoll.Failed, EVENTUALLY_S, "room 2 to fail")
        with pytest.raises(TransferFailure, match="is dead: 2 pings in a row unanswered"):
            younger.failure_exception()
    wait_for(lang.allocator.all_free, 10, "every block of the language pool back")


def test_abort_mid_round_keeps_blocks_until_the_ack_and_late_writes_cannot_corrupt_reuse(make_peer, make_language) -> None:
    lang = make_language(num_blocks=300)
    peer = make_peer(num_blocks=600)
    peer.call("stage", room=10, tokens=36_000, seed=10)  # 258 MB: the write takes a while
    receiver = start_room(lang, peer, 10, 282)
    time.sleep(0.005)
    receiver.abort(FailureKind.CANCELLED, "client went away")
    assert receiver.poll() == KVPoll.Failed  # local state fails at once
    assert lang.allocator.allocate(lang.allocator.num_blocks) is None, "blocks handed out before the ack"
    assert lang.allocator.free_blocks == 300 - 282
    wait_for(lang.allocator.all_free, 10, "the abort ack")
    assert lang.manager.stats["abort_acked"] == 1  # freed by the ack, not by a timeout
    assert peer.call("status", room=10)["status"] == "Failed"
    assert "aborted by language peer" in peer.call("status", room=10)["reason"]
    # Reuse the same blocks for another room and check its bytes stay intact.
    expected = peer.call("stage", room=11, tokens=36_000, seed=11)["digests"]
    emb, _ = receive_embedding(lang.manager, peer.bootstrap_addr, 11)
    assert emb.release_fn is not None  # a view: the check below reads the pool itself
    assert emb.digests() == expected
    time.sleep(0.3)
    assert emb.digests() == expected, "a late write of the aborted room landed in reused blocks"
    emb.release()


def test_an_abort_crossing_the_last_status_changes_nothing_and_is_counted(make_peer, make_language) -> None:
    """The language side gives up a room whose last round had landed (the abort left as the
    room's last status was on its way: a worker stopping, a client gone): the encoder keeps the
    delivered room as it was (its ``/encode`` had answered 200) and counts the crossing."""
    peer, lang = make_peer(), make_language()
    transfer(lang, peer, 7, 9000)
    lang.manager.abandon(peer.bootstrap_addr, 7)
    wait_for(lambda: peer.call("stats")["counters"].get("aborted_after_delivery") == 1, 10, "the crossing counted")
    assert peer.call("status", room=7)["status"] == "Success"


def test_hidden_size_mismatch_is_refused(make_peer, make_language) -> None:
    peer, lang = make_peer(hidden_size=3584), make_language(hidden_size=1024)
    peer.call("stage", room=1, tokens=500, seed=1)
    with pytest.raises(TransferFailure, match="pool layout mismatch.*hidden size"):
        receive_embedding(lang.manager, peer.bootstrap_addr, 1, timeout=10)
    assert "mismatch" in peer.call("status", room=1)["reason"]


def test_resume_timeout_on_the_encoder_fails_the_room_and_frees_both_pools(make_peer, make_language) -> None:
    peer, lang = make_peer(resume_timeout=1), make_language()
    peer.call("stage", room=1, tokens=10_000, seed=1)
    receiver = start_room(lang, peer, 1, 64)
    wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
    wait_for(lambda: receiver.poll() == KVPoll.Failed, EVENTUALLY_S, "the resume timeout")
    with pytest.raises(TransferFailure, match="no resume within 1s"):
        receiver.failure_exception()
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the language pool to be free")


def test_init_for_a_room_the_encoder_never_gets_times_out_on_both_sides(make_peer, make_language) -> None:
    peer, lang = make_peer(bootstrap_timeout=1), make_language()
    receiver = start_room(lang, peer, 77, 4)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, EVENTUALLY_S, "the bootstrap timeout")
    with pytest.raises(TransferFailure, match="timeout: .*bootstrap, no encoded data within 1s"):
        receiver.failure_exception()
    peer.call("stage", room=78, tokens=300, seed=1)  # staged but never initialised
    wait_for(lambda: peer.call("status", room=78)["status"] == "Failed", EVENTUALLY_S, "the staged room to time out")


def test_waiting_timeout_on_the_language_side_aborts_and_gets_its_blocks_back(make_peer, make_language) -> None:
    peer, lang = make_peer(), make_language(waiting_timeout=1)
    receiver = start_room(lang, peer, 5, 8)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, EVENTUALLY_S, "the waiting timeout")
    with pytest.raises(TransferFailure, match="timeout: no data from encode peer"):
        receiver.failure_exception()
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the abort ack")
    assert lang.manager.stats["abort_acked"] == 1


def recv_status(raw, timeout: float = EVENTUALLY_S) -> StatusMsg:
    msg = raw.expect(timeout)
    assert isinstance(msg, StatusMsg)
    return msg


def test_malformed_and_unknown_messages_get_failed_and_never_stop_the_encoder(make_peer, make_language, raw_language) -> None:
    raw, port = raw_language, raw_language.port
    peer = make_peer()
    raw.connect(peer.info["rank_port"])
    raw.push.send_multipart([b"garbage"])
    raw.push.send_multipart([b"5", b"127.0.0.1", str(port).encode(), b"127.0.0.1:1", b"1,x", b"1", b"256"])
    reply = recv_status(raw)  # an unknown peer may be the fork: the fork's two frames, no reason
    assert (reply.room, reply.status, reply.sent_tokens) == (5, KVPoll.Failed, None)
    raw.send(InitMsg(6, "127.0.0.1", port, "127.0.0.1:1", (0,), 1, 128))
    reply = recv_status(raw)
    assert (reply.room, reply.status, reply.sent_tokens) == (6, KVPoll.Failed, None)
    raw.send(RegisterMsg("127.0.0.1", port, "127.0.0.1:1", (4096, 4096, 4096, 4096), 1, 8, (917504, 512, 1536, 64)))
    raw.push.send_multipart([b"5", b"127.0.0.1", str(port).encode(), b"127.0.0.1:1", b"1,x", b"1", b"256"])
    reply = recv_status(raw)  # registered with our extension frames: now with the reason
    assert (reply.room, reply.status) == (5, KVPoll.Failed) and "block id" in reply.reason
    raw.send(ResumeMsg(999, "127.0.0.1", port, "127.0.0.1:1", (1,), 1, 128, 128))
    reply = recv_status(raw)
    assert reply.room == 999 and reply.status == KVPoll.Failed and "unknown or finished room 999" in reply.reason
    raw.send(InitMsg(7, "127.0.0.1", port, "127.0.0.1:1", (8,), 1, 128))
    reply = recv_status(raw)
    assert reply.status == KVPoll.Failed and "outside the peer's pool of 8 blocks" in reply.reason
    assert peer.call("stats")["rejected"] == {"malformed": 3, "unregistered_session": 1, "not_owner": 1,
                                              "refused_round": 1}
    transfer(make_language(), peer, 8, 5000)  # still serving


def test_stale_abort_ack_of_another_generation_is_dropped(make_language) -> None:
    """A fake encoder in-process: only the ack of this incarnation frees the blocks."""
    lang = make_language()
    ctx = zmq.Context()
    encoder_pull = ctx.socket(zmq.PULL)
    encoder_port = encoder_pull.bind_to_random_port("tcp://127.0.0.1")
    reply = ctx.socket(zmq.PUSH)
    reply.connect(f"tcp://127.0.0.1:{lang.manager.rank_port}")
    bootstrap = BootstrapServer("127.0.0.1", 0)
    bootstrap.put_route(1, 1, "127.0.0.1", encoder_port, 0)
    try:
        receiver = lang.manager.create_receiver(f"127.0.0.1:{bootstrap.port}", 31)
        receiver.init(lang.allocator.allocate(4))
        receiver.abort(FailureKind.CANCELLED, "test")
        kinds = [type(decode_encoder_bound(encoder_pull.recv_multipart())).__name__ for _ in range(3)]
        assert kinds == ["RegisterMsg", "InitMsg", "AbortMsg"]
        reply.send_multipart(AbortAckMsg(31, lang.manager.generation - 1).encode())
        wait_for(lambda: lang.manager.stats["stale_message"] == 1, EVENTUALLY_S, "the stale ack to be handled")
        assert lang.allocator.free_blocks == lang.allocator.num_blocks - 4
        reply.send_multipart(AbortAckMsg(31, lang.manager.generation).encode())
        wait_for(lang.allocator.all_free, EVENTUALLY_S, "the real ack")
    finally:
        bootstrap.close()
        encoder_pull.close(0)
        reply.close(0)
        ctx.term()
