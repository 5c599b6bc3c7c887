"""The encode side's stall watch: a language session that answers a ping after a stall may be
written again, whatever another thread read while the stall was being counted."""

from __future__ import annotations

import threading

import pytest
import zmq
from conftest import ManualClock

from connector import language_peers
from connector.language_peers import LanguagePeers
from connector.messages import PongMsg, RegisterMsg
from connector.zmq_link import PushSockets

pytestmark = pytest.mark.fast

SESSION = "127.0.0.1:17001"
KEY = (SESSION, "127.0.0.1", 1)  # the registration: session and endpoint
EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"


def _answer_pings(peers: LanguagePeers) -> None:
    """What the language side does: answer every ping that is out."""
    for seq in list(peers._regs[KEY].pings):
        peers.on_pong(PongMsg(SESSION, seq, 1))


def _answered_until_writable(peers: LanguagePeers, rounds: int = 5) -> bool:
    """Answer every ping, as many rounds as it takes (a stall of this busy machine starts a new
    epoch), until the session may be written; whether it came to that."""
    for _ in range(rounds):
        _answer_pings(peers)
        if peers.may_write(KEY):
            return True
    return False


def _registered(clock: ManualClock) -> tuple[zmq.Context, PushSockets, LanguagePeers]:
    """A session registered and confirmed (its pings answered) on an encoder beating every 0.5 s."""
    context = zmq.Context()
    push = PushSockets(context)
    peers = LanguagePeers(push, "127.0.0.1", 1, interval=0.5, max_misses=2, clock=clock)
    assert peers.register(RegisterMsg("127.0.0.1", 1, SESSION, (1, 2, 3, 4), 1, 64, (1, 1, 1, 1)), "", set) == ""
    assert _answered_until_writable(peers)
    return context, push, peers


def test_a_ping_sent_while_a_stall_is_being_counted_still_lets_writes_start(monkeypatch) -> None:
    """On a busy machine the GIL can pass to another thread right as the watch counts a stall
    (the heartbeat of an encoder just resumed from SIGSTOP, say). A ping sent then was tagged
    one epoch above the one the watch settles on; once answered, no later ping could confirm
    the session again: every write to it waited forever (the frozen-encoder test's hang)."""
    context = zmq.Context()
    push = PushSockets(context)
    peers = LanguagePeers(push, "127.0.0.1", 1, interval=0.5, max_misses=2)
    try:
        assert peers.register(RegisterMsg("127.0.0.1", 1, SESSION, (1, 2, 3, 4), 1, 64, (1, 1, 1, 1)), "", set) == ""
        assert not peers.may_write(KEY)  # not confirmed yet: a ping goes out
        assert _answered_until_writable(peers)

        pinged = threading.Event()

        def another_thread_runs(*_args: object) -> None:  # while the watch reports the stall
            peers.may_write(KEY)
            pinged.set()

        monkeypatch.setattr(language_peers.log, "warning", another_thread_runs)
        peers.stall._last -= 10 * peers.stall.threshold  # what the ticker sees after a SIGSTOP
        assert pinged.wait(EVENTUALLY_S)

        assert _answered_until_writable(peers), f"answered pings never confirm the session again: {peers._regs[KEY]}"
    finally:
        peers.close()
        push.close()
        context.term()


def test_a_session_declared_dead_is_written_again_only_once_it_answers() -> None:
    """Two heartbeats without an answer (a cut link): the session's rooms fail and nothing more
    is written to it, not even a write that was confirmed before; its answer to the next ping
    (the link back) lets writes start again."""
    clock = ManualClock()
    context, push, peers = _registered(clock)
    try:
        assert peers.writable(KEY)
        live = {KEY: clock()}  # a room joined before the pings below
        assert peers.beat(live) == []  # a ping out, nothing missed yet
        clock.advance(0.5)
        assert peers.beat(live) == []  # one interval ended with it unanswered
        clock.advance(0.5)
        assert [dead.key for dead in peers.beat(live)] == [KEY]  # two: declared dead
        assert not peers.writable(KEY)
        assert not peers.may_write(KEY)  # asks again
        assert _answered_until_writable(peers), f"answered pings never confirm the session again: {peers._regs[KEY]}"
    finally:
        peers.close()
        push.close()
        context.term()


def test_a_miss_is_a_ping_unanswered_for_half_an_interval() -> None:
    """A ping a write asked for just before the beat has not been missed yet: only one that went
    unanswered for half an interval counts."""
    clock = ManualClock()
    context, push, peers = _registered(clock)
    try:
        live = {KEY: clock()}
        assert peers.beat(live) == []  # a ping out
        clock.advance(0.2)
        assert peers.beat(live) == [] and peers._regs[KEY].misses == 0  # 0.2 s old: not missed
        clock.advance(0.3)
        assert peers.beat(live) == [] and peers._regs[KEY].misses == 1  # 0.5 s old: missed
    finally:
        peers.close()
        push.close()
        context.term()


def test_a_room_joined_after_the_last_missed_ping_waits_for_the_next_one() -> None:
    """Declared dead, the session's rooms joined before the last missed ping left fail (the
    sender fails those, by the time ``beat`` returns); the session stays one miss short of dead,
    silent, and the next ping, missed too, declares it dead for the room joined later."""
    clock = ManualClock()
    context, push, peers = _registered(clock)
    try:
        assert peers.beat({KEY: clock()}) == []  # ping 1 out
        clock.advance(0.5)
        assert peers.beat({KEY: clock()}) == []  # missed; ping 2 out
        second_ping = clock()
        clock.advance(0.1)
        live = {KEY: clock()}  # a room joins
        clock.advance(0.4)
        (dead,) = peers.beat(live)
        assert dead.key == KEY and dead.missed_ping_sent == second_ping and "2 pings in a row unanswered" in dead.why
        assert peers._regs[KEY].misses == 1 and not peers.writable(KEY)
        clock.advance(0.5)
        assert peers.beat(live) == []  # ping 3 out: it speaks for the room
        third_ping = clock()
        clock.advance(0.5)
        (dead,) = peers.beat(live)
        assert dead.missed_ping_sent == third_ping > live[KEY]  # now it covers the room too
        assert peers._regs[KEY].misses == 0
    finally:
        peers.close()
        push.close()
        context.term()
