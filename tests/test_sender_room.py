"""The encode side's room state machine on its own: ``SenderRoom.on(event, world) -> effects``.

No socket, thread or pool: events go in, effects come out. Unit tests walk the protocol's
paths; property tests (hypothesis) drive rooms with random orders of the events the manager
can produce and check what must hold whatever the order: no block freed twice, freed while a
write reads it, or never; no success after a failure; one answer per room; every room ends.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector import sender_rooms as ev
from connector.buffers import Embedding
from connector.failures import FailureKind
from connector.messages import AbortAckMsg, AbortMsg, StatusMsg, SuspendAckMsg, SuspendMsg
from connector.poll import KVPoll
from connector.sender_rooms import Destination, SenderPhase, SenderRoom, Timeouts, World

pytestmark = pytest.mark.fast

P = SenderPhase
TIMEOUTS = Timeouts(bootstrap=30.0, resume=20.0, max_sleep=100.0)
PEERS = {"s1": ("10.0.0.1", 7001), "s2": ("10.0.0.2", 7002)}
ALL = frozenset((session, *address) for session, address in PEERS.items())  # every registration writable


def embedding(tokens: int) -> Embedding:
    emb = Embedding.empty(tokens, 8, "float32")
    emb.aux[0] = tokens
    return emb


def dst(session: str, allocated: int, blocks: tuple[int, ...] = (0,)) -> Destination:
    host, port = PEERS[session]
    return Destination(host, port, session, blocks, allocated)


def of(effects: list, kind: type) -> list:
    return [e for e in effects if isinstance(e, kind)]


class Driver:
    """One room and the books a manager would keep of what it asked for."""

    def __init__(self, room: SenderRoom | None = None) -> None:
        self.r = room or SenderRoom(7, TIMEOUTS, deadline=TIMEOUTS.bootstrap)
        self.now = 0.0
        self.owned: set[int] = set()  # source blocks handed to the room and not freed yet
        self.freed: list[int] = []
        self.in_flight: list[ev.Write] = []  # started, not landed
        self.moving: tuple[bool, tuple[int, ...]] | None = None  # (placing, blocks) of a copy under way
        self.handed_over = False
        self.failed = False  # the room answered its encode request with a failure
        self.answers: list[ev.Delivered] = []
        self.ended = 0
        self.statuses: list[StatusMsg] = []
        self.sent: list[object] = []  # every SendStatus and SendAck
        self.owed_failed: set[tuple[str, int]] = set()
        self.owed_acks: set[tuple[str, int, str]] = set()
        self.next_block = itertools.count(100)

    def world(self, writable: frozenset[tuple[str, str, int]] = ALL, paused: bool = False) -> World:
        return World(self.now, paused, writable)

    def send(self, event: ev.Event, world: World | None = None) -> list:
        was_live = self.r.live
        effects = self.r.on(event, world or self.world())
        for e in effects:
            self.check(e)
        told = isinstance(event, ev.Tick | ev.WriteLanded) or (isinstance(event, ev.Fail) and event.notify)
        if was_live and not self.r.live and self.r.state.status == KVPoll.Failed and told:
            self.owed_failed |= {(d.endpoint, d.port) for d in self.r.dsts}  # each destination hears of it
        if was_live and isinstance(event, ev.Abort | ev.Suspend):
            self.owed_acks.add((event.msg.endpoint, event.msg.dst_port, type(event).__name__))
        return effects

    def check(self, e: object) -> None:
        if isinstance(e, ev.SendStatus | ev.SendAck):
            self.sent.append(e)
        match e:
            case ev.FreeBlocks(blocks):
                for b in blocks:
                    assert b in self.owned, f"block {b} freed twice or never given to the room"
                    self.owned.discard(b)
                    self.freed.append(b)
                reading = {b for w in self.in_flight for b in w.src_blocks}
                assert not reading & set(blocks), "blocks freed while a write reads them"
            case ev.StartWrite(write):
                assert self.r.src_blocks is not None and not self.failed
                self.in_flight.append(write)
            case ev.SendStatus(_, _, status):
                self.statuses.append(status)
                assert not (self.failed and status.status == KVPoll.Success), "Success after a failure"
            case ev.Delivered(failure):
                assert not self.answers, "the encode request answered twice"
                assert failure is not None or not self.failed, "delivered after a failure"
                self.answers.append(e)
                self.failed = self.failed or failure is not None
            case ev.Ended():
                assert self.ended == 0, "ended twice"
                self.ended += 1
                assert self.r.phase in (P.DONE, P.FAILED) and not self.r.writes

    # ---- what the placer and the write threads do -----------------------------------------------

    def start_move(self) -> bool:
        r = self.r
        if self.moving or r.moving:
            return False
        if r.live and r.staged is not None and r.phase != P.SUSPENDED:
            blocks = tuple(next(self.next_block) for _ in range(2))
            self.owned |= set(blocks)
            self.moving = (True, blocks)
        elif r.lent:
            self.moving = (False, r.src_blocks)
        else:
            return False
        self.send(ev.MoveStarted())
        return True

    def finish_move(self, world: World | None = None) -> None:
        placing, blocks = self.moving
        self.moving = None
        if placing:
            self.send(ev.Placed(blocks), world)
        else:
            self.send(ev.TakenOut(embedding(self.r.total_tokens)), world)

    def land(self, index: int, error: str = "", world: World | None = None) -> list:
        write = self.in_flight.pop(index)
        return self.send(ev.WriteLanded(write, error), world)

    def close(self) -> None:
        """What ends any room: its copies and writes finish, then it fails (or it is done)."""
        if self.moving:
            self.finish_move()
        while self.in_flight:
            self.land(0)
        self.send(ev.Fail(FailureKind.CANCELLED, "closing"))
        if self.moving:  # Fail never starts one; a move under way before it has finished above
            self.finish_move()


# ---- the protocol's paths ------------------------------------------------------------------------


def test_a_room_larger_than_its_allocation_goes_round_by_round_and_frees_its_blocks_once() -> None:
    d = Driver()
    assert of(d.send(ev.Handover(embedding(300))), ev.WantBlocks)
    effects = d.send(ev.Init(dst("s1", 128), 1))  # its data is here: the room is real
    assert effects[1:] == [ev.StagingPromote(), ev.WantBlocks()] and of(effects, ev.AnnounceJoined)  # not in blocks yet
    assert d.r.phase == P.READY
    assert d.start_move()
    d.finish_move()
    write = d.in_flight[0]
    assert (write.start, write.end) == (0, 128) and d.r.phase == P.WRITING
    assert of(d.land(0), ev.SendStatus)[0].status == StatusMsg(7, KVPoll.Transferring, 128)
    assert d.r.phase == P.AWAITING_RESUME
    for sent, end in ((128, 256), (256, 300)):
        d.send(ev.Resume(dst("s1", 128, (1,)), sent))
        assert (d.in_flight[0].start, d.in_flight[0].end) == (sent, end)
        effects = d.land(0)
    assert [s.status for s in d.statuses] == [KVPoll.Transferring] * 2 + [KVPoll.Success]
    assert d.r.phase == P.DONE and d.answers == [ev.Delivered()] and d.ended == 1
    assert not d.owned and len(d.freed) == 2
    assert of(effects, ev.PeerSucceeded) == [ev.PeerSucceeded("10.0.0.1:7001")]


def test_an_oversized_first_round_announces_the_total_and_an_early_resume_pipelines_the_next() -> None:
    d = Driver()
    d.send(ev.Handover(embedding(200)))
    d.start_move()
    d.finish_move()  # lent blocks: nobody asked yet
    effects = d.send(ev.Init(dst("s1", 128), 1))
    assert of(effects, ev.AnnounceTotal) and len(d.in_flight) == 1
    assert d.r.resume_refusal("s1", 128) == ""  # early: where the round being written ends
    effects = d.send(ev.Resume(dst("s1", 128, (3,)), 128))
    assert ev.Count("pipelined_rounds") in effects and len(d.in_flight) == 2
    # The second round lands first: nothing is reported before the first has.
    assert not of(d.land(1), ev.SendStatus)
    statuses = of(d.land(0), ev.SendStatus)
    assert [(s.status.status, s.status.sent_tokens) for s in statuses] == [(KVPoll.Transferring, 128),
                                                                           (KVPoll.Success, 200)]
    assert d.r.phase == P.DONE and not d.owned


def test_a_failure_while_writing_is_told_only_after_the_write_landed_and_the_abort_acked_then() -> None:
    d = Driver()
    d.send(ev.Init(dst("s1", 512), 1))
    d.send(ev.Handover(embedding(100)))
    d.start_move()
    d.finish_move()
    assert d.in_flight
    abort = AbortMsg(7, "10.0.0.1", 7001, 3)
    effects = d.send(ev.Abort(abort))
    assert d.r.phase == P.DRAINING and not of(effects, ev.FreeBlocks) and not of(effects, ev.SendAck)
    assert of(effects, ev.Delivered)[0].failure.kind == FailureKind.ABORTED
    effects = d.land(0)
    assert not of(effects, ev.SendStatus)  # the write landed into an aborted room: no status for it
    assert of(effects, ev.SendAck) == [ev.SendAck("10.0.0.1", 7001, AbortAckMsg(7, 3))]
    assert d.r.phase == P.FAILED and not d.owned and d.ended == 1


def test_a_landed_round_waits_for_its_session_to_confirm_before_it_is_reported() -> None:
    d = Driver()
    d.send(ev.Init(dst("s1", 512), 1))
    d.send(ev.Handover(embedding(100)))
    d.start_move()
    d.finish_move()
    effects = d.land(0, world=d.world(writable=frozenset()))
    assert of(effects, ev.Confirm) == [ev.Confirm((("s1", *PEERS["s1"]),))] and not of(effects, ev.SendStatus)
    effects = d.send(ev.Kick())  # the pong
    assert of(effects, ev.SendStatus)[0].status.status == KVPoll.Success and d.r.phase == P.DONE


def test_suspend_waits_for_the_write_and_a_restored_room_is_rebound_by_a_resume() -> None:
    d = Driver()
    d.send(ev.Init(dst("s1", 64), 1))
    d.send(ev.Handover(embedding(100)))
    d.start_move()
    d.finish_move()
    assert not d.send(ev.Suspend(SuspendMsg(7, "10.0.0.1", 7001, 1)))  # a write is in flight
    effects = d.land(0)
    assert d.r.phase == P.SUSPENDED and of(effects, ev.SendAck) == [ev.SendAck("10.0.0.1", 7001, SuspendAckMsg(7, 1))]
    restored = Driver(SenderRoom(9, TIMEOUTS, deadline=0.0))
    restored.send(ev.Restored(embedding(100), 64, 1))
    assert restored.r.phase == P.SUSPENDED and restored.r.state.progress.sent_tokens == 64
    assert restored.r.resume_refusal("s2", 0) == "resume after sleep at sent_tokens 0 != 64 already sent"
    restored.send(ev.Resume(dst("s2", 64), 64))  # another session: the woken language worker
    assert restored.r.phase == P.READY and [d.session_id for d in restored.r.dsts] == ["s2"]


def test_a_suspend_of_a_draining_room_is_acked_once_its_write_settled() -> None:
    """A write given up on while Mooncake holds it: the suspend ack would let the language side
    checkpoint the room and free its blocks, so it waits, as the abort ack does."""
    d = Driver()
    d.send(ev.Init(dst("s1", 64), 1))
    d.send(ev.Handover(embedding(100)))
    d.start_move()
    d.finish_move()  # the first round's write is in flight
    d.send(ev.Fail(FailureKind.TRANSFER, "write of 1 part(s) not settled after 10.0s"))
    assert d.r.phase == P.DRAINING
    assert not of(d.send(ev.Suspend(SuspendMsg(7, "10.0.0.1", 7001, 1))), ev.SendAck)
    effects = d.land(0)
    assert d.r.phase == P.FAILED and ev.SendAck("10.0.0.1", 7001, SuspendAckMsg(7, 1)) in of(effects, ev.SendAck)


def test_waits_time_out_with_their_reason() -> None:
    d = Driver()
    d.now = TIMEOUTS.bootstrap + 1
    d.send(ev.Tick())
    assert d.r.phase == P.FAILED and d.answers[0].failure.kind == FailureKind.TIMEOUT
    assert "bootstrap, no init within 30s" in str(d.answers[0].failure)
    s = Driver()
    s.send(ev.Suspend(SuspendMsg(7, "10.0.0.1", 7001, 1)))
    s.now = TIMEOUTS.max_sleep + 1
    s.send(ev.Tick())
    assert "language peer slept longer than 100s" in str(s.answers[0].failure)


def test_a_room_tells_its_destinations_it_is_real_once_claimed_and_inited() -> None:
    """Init then claim, or claim then init: each destination hears once that the room has its
    encode request; a room nobody claims says nothing (its destination gives up at its join wait)."""
    claimed_late = Driver()
    assert not of(claimed_late.send(ev.Init(dst("s1", 128), 1)), ev.AnnounceJoined)
    (joined,) = of(claimed_late.send(ev.Claimed()), ev.AnnounceJoined)
    assert joined.dst.session_id == "s1" and claimed_late.r.claimed
    claimed_first = Driver()
    assert claimed_first.send(ev.Claimed()) == []
    assert len(of(claimed_first.send(ev.Init(dst("s1", 128), 1)), ev.AnnounceJoined)) == 1
    never = Driver()
    never.send(ev.Init(dst("s1", 128), 1))
    never.now = TIMEOUTS.bootstrap + 1
    assert not of(never.send(ev.Tick()), ev.AnnounceJoined)


def test_a_room_without_its_encode_request_blames_no_language_peer() -> None:
    """A room a client made up reaches the encoder only as the language server's init: when it
    times out there, the language server (which did its part) is not counted as failing."""
    for claimed in (False, True):
        d = Driver()
        if claimed:
            d.send(ev.Claimed())
        d.send(ev.Init(dst("s1", 128), 1))
        d.now = TIMEOUTS.bootstrap + 1
        (failed,) = of(d.send(ev.Tick()), ev.PeerFailed)
        assert failed.kind == FailureKind.TIMEOUT and failed.joined is claimed


def test_an_init_for_an_ended_room_is_answered_with_its_reason() -> None:
    d = Driver()
    d.send(ev.Fail(FailureKind.BAD_REQUEST, "image too small"))
    effects = d.send(ev.Init(dst("s1", 128), 1))
    (status,) = of(effects, ev.SendStatus)
    assert status.status.status == KVPoll.Failed and "image too small" in status.status.reason


def test_every_phase_change_is_in_the_table() -> None:
    d = Driver()
    with pytest.raises(AssertionError, match="no transition BOOTSTRAPPING -> DONE"):
        d.r._move(P.DONE, d.world())


# ---- random orders ------------------------------------------------------------------------------

ACTIONS = ("advance",) * 12 + ("init", "init2", "handover", "start_move", "finish_move", "land", "land_error", "resume",
           "resume_early", "abort", "suspend", "fail", "kick", "kick_unconfirmed", "tick", "refused")


def step(d: Driver, action: str, pick: int) -> None:
    r = d.r
    session = ("s1", "s2")[pick % 2]
    if action == "advance":  # what a cooperative peer and worker would do next
        action = next_step(d, pick)
        if r.dsts:
            session = r.dsts[pick % len(r.dsts)].session_id
    host, port = PEERS[session]
    match action:
        case "init":
            d.send(ev.Init(dst(session, 64 * (1 + pick % 3)), 1))
        case "init2":
            d.send(ev.Init(dst(session, 64 * (1 + pick % 3)), 2))
        case "handover" if not r.has_data and not d.handed_over:
            d.handed_over = True
            d.send(ev.Handover(embedding(1 + pick % 300)))
        case "start_move":
            d.start_move()
        case "finish_move" if d.moving:
            d.finish_move()
        case "land" | "land_error" if d.in_flight:
            d.land(pick % len(d.in_flight), "transfer failed" if action == "land_error" else "")
        case "resume" | "resume_early":
            sent = r.round_end if action == "resume_early" else r.state.progress.sent_tokens
            if r.resume_refusal(session, sent) == "":  # the manager refuses the others
                d.send(ev.Resume(dst(session, 64 * (1 + pick % 3), (pick,)), sent))
        case "abort" if r.owned_by(host, port) or not r.dsts:
            d.send(ev.Abort(AbortMsg(r.room, host, port, pick)))
        case "suspend" if r.owned_by(host, port) or not r.dsts:
            d.send(ev.Suspend(SuspendMsg(r.room, host, port, pick)))
        case "fail":
            d.send(ev.Fail(list(FailureKind)[pick % len(FailureKind)], "injected", notify=pick % 2 == 0))
        case "kick":
            d.send(ev.Kick(), d.world(paused=pick % 5 == 0))
        case "kick_unconfirmed":
            d.send(ev.Kick(), d.world(writable=frozenset({(session, *PEERS[session])})))
        case "tick":
            d.now += (5.0, 25.0, 150.0)[pick % 3]
            d.send(ev.Tick())
        case "refused" if r.owned_by(host, port) or not r.dsts:  # a refused round fails its owner's room
            d.send(ev.Fail(FailureKind.PROTOCOL, "refused round", notify=False))
            d.send(ev.Refused(host, port, StatusMsg(r.room, KVPoll.Failed, 0, "protocol: refused")))


def next_step(d: Driver, pick: int) -> str:
    r = d.r
    if not r.dsts:
        return "init"
    if not d.handed_over:
        return "handover"
    if r.phase == P.WRITING and len(d.in_flight) == 1 and pick % 3:
        return "resume_early"
    if d.in_flight:
        return "land"
    if d.moving:
        return "finish_move"
    if r.phase == P.AWAITING_RESUME:
        return "resume"
    return "start_move" if r.staged is not None else "kick"


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1000)), max_size=40))
def test_any_order_of_events_frees_each_block_once_answers_once_and_ends(actions: list[tuple[str, int]]) -> None:
    d = Driver()
    for action, pick in actions:
        step(d, action, pick)
    d.close()
    r = d.r
    assert r.phase in (P.DONE, P.FAILED) and not r.live and not r.writes
    assert d.ended == 1 and len(d.answers) == 1
    assert not d.owned, f"blocks never freed: {sorted(d.owned)}"
    assert r.src_blocks is None and r.staged is None
    if r.phase == P.DONE:
        assert d.answers == [ev.Delivered()] and r.state.status == KVPoll.Success
    else:
        assert d.answers[0].failure is not None and r.state.status == KVPoll.Failed
        assert KVPoll.Success not in [s.status for s in d.statuses]
    # Nothing is held back once the room ended: every ack and Failed status went out.
    assert not r.pending_acks and not r.pending_suspend_acks and not r.held_failures
    failed_to = {(e.host, e.port) for e in d.sent if isinstance(e, ev.SendStatus) and e.status.status == KVPoll.Failed}
    assert d.owed_failed <= failed_to, "a destination never heard its room failed"
    acked = {(e.host, e.port, "Abort" if isinstance(e.ack, AbortAckMsg) else "Suspend")
             for e in d.sent if isinstance(e, ev.SendAck)}
    assert d.owed_acks <= acked, "an abort or suspend never acked"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1000)), max_size=30))
def test_after_an_ended_room_no_event_does_anything_but_answer(actions: list[tuple[str, int]]) -> None:
    d = Driver()
    for action, pick in actions:
        step(d, action, pick)
    d.close()
    phase, freed = d.r.phase, list(d.freed)
    for action, pick in actions:
        step(d, action, pick)
        assert d.r.phase == phase and d.freed == freed and not d.in_flight
    assert len(d.answers) == 1 and d.ended == 1


def test_the_happy_path_under_random_confirmation_still_delivers() -> None:
    """A session that confirms late only delays a round: the room still ends delivered."""
    d = Driver()
    d.send(ev.Init(dst("s1", 64), 1))
    d.send(ev.Handover(embedding(150)))
    d.start_move()
    d.finish_move(d.world(writable=frozenset()))
    assert not d.in_flight and d.r.phase == P.READY
    d.send(ev.Kick())
    rng = np.random.default_rng(0)
    while d.r.phase != P.DONE:
        if d.in_flight:
            d.land(0, world=d.world(writable=ALL if rng.random() < 0.5 else frozenset()))
        elif d.r.phase == P.AWAITING_RESUME:
            d.send(ev.Resume(dst("s1", 64), d.r.state.progress.sent_tokens))
        else:
            d.send(ev.Kick())
    assert [s.sent_tokens for s in d.statuses] == [64, 128, 150] and not d.owned
