"""The control plane belongs to its owners: registers, aborts and resumes from strangers, route
registration, the shared secret, and how rejected messages are counted and logged."""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
import time
from types import SimpleNamespace

import pytest
import requests
import zmq
from conftest import ManualClock
from test_faults import start_room, wait_for
from test_transfer import transfer

from connector import rejections as rejections_module
from connector.auth import MAC_TAG, AuthError, sign, verify
from connector.bootstrap import RankRoute, fetch_route
from connector.messages import AbortMsg, InitMsg, RegisterMsg, ResumeMsg, StatusMsg, SuspendMsg
from connector.poll import KVPoll
from connector.receiver import receive_embedding
from connector.rejections import Rejections
from connector.zmq_link import FILES_PER_PEER, MAX_SOCKETS, PushSockets

pytestmark = pytest.mark.transports("mooncake", "memory")

SECRET = "a-test-secret-of-enough-length"
EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"
HEARTBEAT_S = 5.0  # the encode peer's heartbeat interval, where a test's bound is measured against it


def rejected(peer) -> dict[str, int]:
    return peer.call("stats")["rejected"]


def resume_and_match(receiver, expected: dict[str, str]) -> None:
    """The owner resumes its partial room; what lands is what was staged."""
    assert receiver.try_resume()
    wait_for(lambda: receiver.poll() == KVPoll.Success, 30, "the owner's resume round")
    emb = receiver.assemble()
    try:
        assert emb.digests() == expected
    finally:
        emb.release()


def test_a_register_that_names_a_live_endpoint_is_dropped_and_its_owner_keeps_working(make_peer, make_language,
                                                                                       raw_language) -> None:
    peer, lang = make_peer(), make_language()
    transfer(lang, peer, 1, 5000)
    m, raw = lang.manager, raw_language
    raw.connect(peer.info["rank_port"])
    # Before: every later request of the real worker failed with "session ... never registered".
    raw.send(RegisterMsg(m.config.host, m.rank_port, "127.0.0.1:1", m.pool.base_ptrs, 1, m.pool.num_blocks,
                         m.pool.item_lens))
    wait_for(lambda: rejected(peer).get("register_takeover") == 1, 10, "the impostor's session to be dropped")
    transfer(lang, peer, 2, 10_000)  # one resume round, from the real session


def test_a_register_naming_a_live_session_from_elsewhere_or_with_a_forged_pool_takes_nothing_from_it(
        make_peer, make_language, raw_language) -> None:
    """A register whose session id is a live worker's Mooncake address, from a new endpoint,
    generation 2**63-1: taken as is, it would make the encoder refuse the real worker's registers
    as older and every init of it as ``not_owner``. A registration belongs to its endpoint: the
    stranger's is kept beside the worker's, for the stranger's own
    requests, and the worker's endpoint keeps its own. One naming the worker's endpoint with
    another pool is settled by the worker's answer to a ping, with its own generation."""
    peer, lang = make_peer(), make_language()
    transfer(lang, peer, 1, 5000)
    m, raw = lang.manager, raw_language
    raw.connect(peer.info["rank_port"])
    session, top = m.transport.session_id, 2**63 - 1
    raw.send(RegisterMsg("127.0.0.1", raw.port, session, m.pool.base_ptrs, top, m.pool.num_blocks, m.pool.item_lens))
    raw.push.send_multipart([b"junk"])  # handled after the register
    wait_for(lambda: rejected(peer).get("malformed") == 1, 10, "the encoder to take the register")
    transfer(lang, peer, 2, 10_000)  # one resume round: the real session is served
    # The same, naming the victim's own endpoint and another pool: its writes would land elsewhere.
    forged_pool = tuple(p + (1 << 30) for p in m.pool.base_ptrs)
    raw.send(RegisterMsg(m.config.host, m.rank_port, session, forged_pool, top, m.pool.num_blocks, m.pool.item_lens))
    wait_for(lambda: rejected(peer).get("register_takeover") == 1, 10, "the forged pool to be refused")
    transfer(lang, peer, 3, 10_000)
    # An older generation than the one the worker's endpoint answered with: a replay, refused at once.
    raw.send(RegisterMsg(m.config.host, m.rank_port, session, forged_pool, m.generation - 1, m.pool.num_blocks,
                         m.pool.item_lens))
    wait_for(lambda: rejected(peer).get("register_conflict") == 1, 10, "the replayed register to be refused")
    transfer(lang, peer, 4, 10_000)
    assert raw.recv(0.5) is None and raw.pings == 0  # the stranger's endpoint was never pinged or written


@pytest.mark.serial  # timed: one ping round trip, not the two or three heartbeats of missed pings
@pytest.mark.parametrize("forged_at", ["a silent endpoint", "an endpoint answering pings", "the worker's endpoint"])
def test_a_register_forged_before_the_workers_first_keeps_it_out_one_ping_round_trip_at_most(
        make_peer, make_language, raw_language, forged_at) -> None:
    """A register naming a language worker's Mooncake session reaches the encoder
    before the worker's own first one (right after it started), with generation 2**63-1 and
    another pool. Before: from another endpoint, the encoder took it and refused the worker's
    inits (a two-frame ``Failed``: "no reason given") until that endpoint had missed its pings
    (10-15 s with the default heartbeat; for ever when it answers them); from the worker's own
    endpoint, the worker's register looked replayed and its writes went to the forged pool. Now a
    registration belongs to its endpoint and is written only once that endpoint answered a ping
    with its pool's generation: the worker waits one ping round trip at most."""
    peer, lang = make_peer(heartbeat_interval=HEARTBEAT_S), make_language()
    m, raw = lang.manager, raw_language
    raw.connect(peer.info["rank_port"])
    raw.session = m.transport.session_id  # the victim's: its READY line shows it, and it is guessable
    endpoint = (m.config.host, m.rank_port) if forged_at == "the worker's endpoint" else ("127.0.0.1", raw.port)
    forged_pool = tuple(p + (1 << 30) for p in m.pool.base_ptrs)
    raw.send(RegisterMsg(*endpoint, raw.session, forged_pool, 2**63 - 1, m.pool.num_blocks, m.pool.item_lens))
    raw.push.send_multipart([b"junk"])  # handled after the register: once it is counted, the encoder has both
    wait_for(lambda: rejected(peer).get("malformed") == 1, 10, "the encoder to take the forged register")
    stop = threading.Event()

    def answer_pings() -> None:
        while not stop.is_set():
            raw.recv(0.05)

    answering = threading.Thread(target=answer_pings, daemon=True)
    if forged_at == "an endpoint answering pings":  # the forger listens where it said and answers as the victim
        answering.start()
    try:
        started = time.monotonic()
        transfer(lang, peer, 1, 3000)  # the worker's own register, init and (after one ping) its round
        took = time.monotonic() - started
    finally:
        stop.set()
        if answering.is_alive():
            answering.join()
    # under one heartbeat interval: the old wait was two or three of them (or for ever)
    assert took < HEARTBEAT_S, f"the worker waited {took:.1f}s for its first round"
    transfer(lang, peer, 2, 10_000)  # and goes on: one resume round


def test_a_new_session_answering_from_the_same_endpoint_ends_the_old_sessions_rooms(make_peer, raw_language,
                                                                                   raw_pool) -> None:
    """A real restart: the process at the endpoint now answers as its new session."""
    (transport, pool), raw = raw_pool, raw_language
    peer = make_peer()
    raw.connect(peer.info["rank_port"])
    peer.call("stage", room=1, tokens=3000, seed=1)
    raw.session = transport.session_id
    raw.register(pool)
    raw.send(InitMsg(1, "127.0.0.1", raw.port, raw.session, tuple(range(8)), 1, 1024))
    assert raw.expect(room=1) == StatusMsg(1, KVPoll.WaitingForInput, 0, "", 3000)  # the total, announced
    assert raw.expect(room=1) == StatusMsg(1, KVPoll.Transferring, 1024)  # now it waits for a resume
    raw.session = "127.0.0.1:2"  # restarted: same endpoint, new Mooncake session
    raw.register(pool)
    deadline = time.monotonic() + EVENTUALLY_S
    while raw.pings < 2:  # the encoder asks the endpoint who it is now
        assert raw.recv(0.2) is None  # only pings come, answered as the new session
        assert time.monotonic() < deadline, f"{raw.pings} pings in {EVENTUALLY_S:g}s"
    wait_for(lambda: "restarted" in peer.call("status", room=1)["reason"], 10, "the old session's room to fail")
    assert "register_takeover" not in rejected(peer)


def test_an_abort_or_resume_from_a_stranger_changes_nothing(make_peer, make_language, raw_language, raw_pool) -> None:
    (_, pool), raw = raw_pool, raw_language
    peer, lang = make_peer(), make_language()
    expected = peer.call("stage", room=1, tokens=20_000, seed=1)["digests"]
    receiver = start_room(lang, peer, 1, 64)  # 8192 tokens: partial, then it waits for our resume
    wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
    raw.connect(peer.info["rank_port"])
    raw.send(AbortMsg(1, "127.0.0.1", raw.port, 1))  # unregistered
    raw.session = "127.0.0.1:3"
    raw.register(pool)
    raw.send(AbortMsg(1, "127.0.0.1", raw.port, 1))  # registered, but not the room's destination
    raw.send(ResumeMsg(1, "127.0.0.1", raw.port, raw.session, tuple(range(100)), 1, 8192, 12_800))
    reply = raw.expect(room=1)
    assert reply.status == KVPoll.Failed and "did not init it" in reply.reason
    wait_for(lambda: rejected(peer).get("not_owner") == 3, 10, "three refusals")
    assert peer.call("status", room=1)["status"] == "Transferring"
    resume_and_match(receiver, expected)


@pytest.mark.parametrize("forged", [AbortMsg, SuspendMsg])
def test_an_abort_or_suspend_forged_with_the_owners_endpoint_fails_the_owners_room_at_once(
        make_peer, make_language, raw_language, forged) -> None:
    """Without the secret nothing proves who sent an ABORT or a SUSPEND; one naming the owner's
    endpoint ends (or holds) the room at the encoder. The owner must not learn nothing and wait
    for its 300 s waiting timeout: the encoder's ack of a message it never sent fails the room
    there at once (a suspended room is aborted, so it ends at the encoder too)."""
    peer, lang = make_peer(), make_language()
    peer.call("stage", room=1, tokens=20_000, seed=1)
    receiver = start_room(lang, peer, 1, 64)  # partial: waits for a resume
    wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
    m, raw = lang.manager, raw_language
    raw.connect(peer.info["rank_port"])
    raw.send(forged(1, m.config.host, m.rank_port, 12345))
    at_once = m.config.waiting_timeout / 10  # "at once": a tenth of the owner's 300 s waiting timeout
    wait_for(lambda: receiver.poll() == KVPoll.Failed, at_once, "the owner's room to fail")
    assert "did not send" in receiver.state.reason
    assert m.stats["foreign_abort" if forged is AbortMsg else "foreign_suspend"] == 1
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the room's blocks to come back")
    wait_for(lambda: peer.call("status", room=1)["status"] == "Failed", EVENTUALLY_S, "the room to end at the encoder")
    transfer(lang, peer, 2, 10_000)  # the worker goes on


def test_route_registration_over_http_is_refused_without_a_secret(make_peer) -> None:
    peer = make_peer()
    body = {"role": "Encode", "tp_size": 1, "dp_size": 1, "rank_ip": "10.9.9.9", "rank_port": 1, "engine_rank": 0}
    reply = requests.put(f"http://{peer.bootstrap_addr}/route", json=body, timeout=5)
    assert reply.status_code == 403 and "shared secret" in reply.text
    assert fetch_route(peer.bootstrap_addr, 0) == RankRoute("127.0.0.1", peer.info["rank_port"])


def test_with_a_shared_secret_only_messages_and_lookups_that_prove_it_act(make_peer, make_language, raw_language,
                                                                            raw_pool) -> None:
    (transport, pool), raw = raw_pool, raw_language
    peer, lang = make_peer(control_secret=SECRET), make_language(control_secret=SECRET)
    transfer(lang, peer, 1, 10_000)  # signed both ways, with a resume round
    # a language side without it, or with another, cannot look the route up, and is told why
    with pytest.raises(ConnectionError, match=r"needs a control secret \(401\) and this worker has none"):
        fetch_route(peer.bootstrap_addr, 2)
    with pytest.raises(ConnectionError, match=r"refused this worker's control secret \(401\): set the same"):
        fetch_route(peer.bootstrap_addr, 2, secret=b"another-secret-of-enough-length")
    url = f"http://{peer.bootstrap_addr}/route"
    assert requests.get(url, params={"engine_rank": -1, "target_dp_group": -1}, timeout=5).status_code == 401
    body = {"role": "Encode", "tp_size": 1, "dp_size": 1, "rank_ip": "127.0.0.1", "rank_port": 1, "engine_rank": 0}
    assert requests.put(url, json=body, timeout=5).status_code == 401
    assert requests.put(url, json=body, timeout=5, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert fetch_route(peer.bootstrap_addr, 2, secret=SECRET.encode()).rank_port == peer.info["rank_port"]
    raw.connect(peer.info["rank_port"])
    raw.session = transport.session_id
    peer.call("stage", room=3, tokens=500, seed=3)
    raw.register(pool)  # unsigned: dropped
    raw.send(InitMsg(3, "127.0.0.1", raw.port, raw.session, (0,), 1, 128))
    init = InitMsg(3, "127.0.0.1", raw.port, raw.session, (0,), 1, 128).encode()
    raw.push.send_multipart(sign(init, b"another-secret-of-enough-length"))
    raw.push.send_multipart([b"x", MAC_TAG + b"1" * 400 + b" ab"])  # once stopped the PULL loop
    assert raw.recv(2.0) is None  # no answer, no ping: nothing of it was taken
    wait_for(lambda: rejected(peer) == {"unauthenticated": 4}, EVENTUALLY_S, "four unauthenticated messages")
    assert peer.call("status", room=3)["status"] == "Bootstrapping"
    with pytest.raises(ConnectionError):  # no write and no route for the room without the secret
        receive_embedding(make_language().manager, peer.bootstrap_addr, 3, timeout=5)
    emb, _ = receive_embedding(lang.manager, peer.bootstrap_addr, 3, timeout=30)
    emb.release()


@pytest.mark.fast
def test_rejections_are_counted_by_reason_and_logged_at_most_burst_per_window(caplog, monkeypatch) -> None:
    clock = ManualClock()  # the window moves only when the test says: a slow loop stays inside it
    monkeypatch.setattr(rejections_module, "time", SimpleNamespace(monotonic=clock))
    rejections = Rejections(logging.getLogger("test-rejections"), window=0.2, burst=3)
    with caplog.at_level(logging.WARNING, "test-rejections"):
        for i in range(100):
            rejections.reject("malformed", f"message {i}")
        assert [r.getMessage() for r in caplog.records] == [f"rejected message (malformed): message {i}"
                                                            for i in range(3)]
        clock.advance(0.25)
        rejections.reject("malformed", "later")
        assert [r.getMessage() for r in caplog.records[3:]] == [
            "97 more messages rejected (malformed) in the last 0.2s were not logged",
            "rejected message (malformed): later"]
    assert rejections.snapshot() == {"malformed": 101}
    with pytest.raises(ValueError, match="unknown rejection reason"):  # metric labels stay a fixed set
        rejections.reject("made up", "x")


def test_a_suspended_room_is_resumed_only_by_its_owner(make_peer, make_language, raw_language, raw_pool) -> None:
    (transport, pool), raw = raw_pool, raw_language
    peer, lang = make_peer(), make_language()
    expected = peer.call("stage", room=1, tokens=20_000, seed=1)["digests"]
    receiver = start_room(lang, peer, 1, 64)
    wait_for(lambda: receiver.poll() == KVPoll.Transferring, 30, "the first round")
    lang.manager.suspend_all([receiver], timeout=10)  # the language worker goes to sleep
    saved = receiver.checkpoint()
    raw.connect(peer.info["rank_port"])
    raw.session = transport.session_id
    raw.register(pool)
    raw.send(ResumeMsg(1, "127.0.0.1", raw.port, raw.session, tuple(range(100)), 1, 8192, 12_800))
    reply = raw.expect(room=1)  # no data, and no progress told to a stranger
    assert reply.status == KVPoll.Failed and "did not init it" in reply.reason and "8192" not in reply.reason
    assert not pool.embeddings.any()
    resume_and_match(lang.manager.restore(saved), expected)  # the owner wakes up and goes on


def test_a_fork_peer_gets_only_fork_frames_even_when_a_stranger_registers_its_address(make_peer, raw_language,
                                                                                     raw_pool) -> None:
    (transport, pool), raw = raw_pool, raw_language
    peer = make_peer()
    raw.connect(peer.info["rank_port"])
    raw.session = transport.session_id
    raw.register(pool, fork=True)
    stranger = RegisterMsg("127.0.0.1", raw.port, "127.0.0.1:7", pool.base_ptrs, 5, pool.num_blocks, pool.item_lens)
    raw.send(stranger)
    raw.send(AbortMsg(9, "127.0.0.1", raw.port, 5))  # an ack would kill the fork peer's thread
    peer.call("stage", room=1, tokens=10_000, seed=1)
    raw.send(InitMsg(1, "127.0.0.1", raw.port, raw.session, tuple(range(64)), 1, 8192))
    assert raw.expect(room=1) == StatusMsg(1, KVPoll.Transferring)  # two frames: no total announced early
    raw.send(ResumeMsg(1, "127.0.0.1", raw.port, raw.session, tuple(range(64, 79)), 1, 8192, 1920))
    assert raw.expect(room=1) == StatusMsg(1, KVPoll.Success)
    assert raw.pings == 0 and raw.recv(1.0) is None  # no ping, no ack
    # An older generation at that address: nothing there answers pings, so nothing proves which of
    # the stranger's registers is a replay (refusing it would let a forged 2**63-1 keep a
    # worker out); the fork peer's own session is served as before, in fork frames.
    old_pool = tuple(p - (1 << 30) for p in pool.base_ptrs)
    raw.send(RegisterMsg("127.0.0.1", raw.port, "127.0.0.1:7", old_pool, 4, pool.num_blocks, pool.item_lens))
    peer.call("stage", room=2, tokens=1000, seed=2)
    raw.send(InitMsg(2, "127.0.0.1", raw.port, raw.session, tuple(range(8)), 1, 1024))
    assert raw.expect(room=2) == StatusMsg(2, KVPoll.Success)
    assert raw.pings == 0 and raw.recv(1.0) is None


@pytest.mark.fast
def test_the_mac_check_refuses_what_it_cannot_verify_without_raising() -> None:
    secret = SECRET.encode()
    frames = [b"1", b"2"]
    assert verify(sign(frames, secret), secret) == frames
    assert verify(sign(frames, secret), b"") == frames  # without a secret the frame is ignored
    bad = {"missing": frames, "huge stamp": [*frames, MAC_TAG + b"1" * 400 + b" ab"],
           "not a number": [*frames, MAC_TAG + b"x1 ab"], "no digest": [*frames, MAC_TAG + b"1"],
           "other frames": [b"1", b"3", sign(frames, secret)[-1]],
           "wrong secret": sign(frames, b"another-secret-of-enough-length")}
    for what, message in bad.items():
        with pytest.raises(AuthError):
            verify(message, secret)
            pytest.fail(f"{what}: accepted")


@pytest.mark.fast
def test_a_socket_that_cannot_get_its_monitor_is_closed_at_once(monkeypatch) -> None:
    """Out of open files at the monitor: the send fails and leaves no socket behind (one left
    open kept ``Context.term`` waiting for ever)."""

    def out_of_files(*_args: object) -> None:
        raise zmq.ZMQError(errno.EMFILE)

    ctx = zmq.Context()
    push = PushSockets(ctx)
    monkeypatch.setattr(zmq.Socket, "get_monitor_socket", out_of_files)
    with pytest.raises(zmq.ZMQError, match="open files") as raised:  # its traceback keeps the frame's locals
        push.send("127.0.0.1", 20_000, [b"x"])
    push.close()
    terminated = threading.Thread(target=ctx.term, daemon=True)
    terminated.start()
    terminated.join(10)
    assert not terminated.is_alive(), f"a socket was left open after {raised.value!r}"


@pytest.mark.fast
@pytest.mark.parametrize("headroom", [1024, 4096])
def test_push_sockets_stay_under_the_zmq_and_open_files_limits_whatever_addresses_messages_name(headroom) -> None:
    """A flood of messages naming made-up peers: at most ``max_sockets`` PUSH sockets at once (the
    least recently used closed), sized so that they take at most half the open-files limit (set
    ``headroom`` above what this process has open: an xdist worker late in the suite holds
    hundreds)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_before = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(open_before + headroom, hard), hard))
    ctx = zmq.Context()
    push = PushSockets(ctx)
    try:
        # Nobody listens: the sends just queue. Twice the sockets it keeps: the evicted ones' files
        # go only once ZMQ's reaper thread has closed them (a close is asynchronous in ZMQ), so on
        # a busy CPU a send of the flood may find no file free: try_send, as the workers send,
        # logs it and the message is lost, as it is to any peer that cannot take it.
        for port in range(20_000, 20_000 + 2 * push.max_sockets):
            push.try_send("127.0.0.1", port, [b"x"])
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert len(push._sockets) <= push.max_sockets == min(MAX_SOCKETS, limit // 2 // FILES_PER_PEER)
        assert 3 * push.max_sockets < ctx.get(zmq.MAX_SOCKETS)  # each: the PUSH and its monitor's two ends
        deadline = time.monotonic() + 10
        while (taken := len(os.listdir("/proc/self/fd")) - open_before) > limit // 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert taken <= limit // 2, (taken, limit)
        assert push.try_send("127.0.0.1", 19_999, [b"x"])  # and a new peer is reached again
        assert len(push._sockets) <= push.max_sockets
    finally:
        push.close()
        ctx.term()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
