"""The language-side room as a pure state machine (connector.receiver_rooms), in process.

Unit tests walk the transitions one event at a time; the property tests drive a room with
random event orders from a model encoder that behaves as ours does (it writes only rounds it was
asked for and reports each one), and check: every block handed to the room leaves it exactly once,
and only once no peer can write into it (the ack timeout excepted, by design); no Success after a
failure; no phase change outside ``TRANSITIONS``; nothing sent by a closed room; every room
reaches CLOSED after a closing sequence.
"""

from __future__ import annotations

import ast
import collections
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.failures import FailureKind, TransferFailure
from connector.poll import KVPoll
from connector.receiver import ReceiverPhase as ReexportedPhase
from connector.receiver_rooms import (
    TRANSITIONS,
    Abort,
    AbortAck,
    Assemble,
    Checkpoint,
    Clone,
    CopyOut,
    Count,
    Forget,
    FreeBlocks,
    Init,
    NoteFailure,
    NoteSuccess,
    Notify,
    PeerDead,
    PeerGone,
    PeerWoke,
    PoolReleased,
    Rebound,
    ReceiverPhase,
    ReceiverRoom,
    Restore,
    Resumed,
    Round,
    SendAbort,
    SendFailed,
    SendRound,
    SendSuspend,
    Spill,
    StatusIn,
    Suspend,
    SuspendAck,
    Tick,
    Warn,
    World,
)
from connector.transitions import checked_move

pytestmark = pytest.mark.fast

P = ReceiverPhase
BS = 4
HOLD, UNACKED, FORK_HOLD, MAX_SLEEP, WAITING = 15.0, 300.0, 30.0, 600.0, 300.0
JOIN = 1000.0  # the join wait, past every other one here unless a test sets it


def new_room(extended: bool = True, clone_concat: bool = False) -> ReceiverRoom:
    return ReceiverRoom(7, BS, extended, "peer", last_progress=0.0, clone_concat=clone_concat)


def aux(total: int) -> np.ndarray:
    return np.array([total, 0], dtype=np.int64)


def status(st_: KVPoll, sent: int | None = None, total: int | None = None, reason: str = "",
           aux_total: int | None = None) -> StatusIn:
    return StatusIn(st_, sent, total, reason, None if aux_total is None else aux(aux_total), 101.0)


def world(now: float = 1.0, asleep_since: float | None = None, seconds_per_block: float = 0.0,
          join: float = JOIN) -> World:
    """The time, the encoder's sleep and this file's limits, as the handle gives them to ``on``."""
    return World(now, asleep_since, HOLD, seconds_per_block, UNACKED, FORK_HOLD, MAX_SLEEP, WAITING, join)


def freed(effects: list) -> list[int]:
    return [b for e in effects if isinstance(e, FreeBlocks) for b in e.block_ids]


def kinds(effects: list) -> list[type]:
    return [type(e) for e in effects]


def partial_room(extended: bool = True, total: int = 20) -> ReceiverRoom:
    """A room whose first round (blocks 0, 1: 8 tokens) landed, of ``total``."""
    room = new_room(extended)
    room.on(Init((0, 1)), world())
    effects = room.on(status(KVPoll.Transferring, 8 if extended else None, aux_total=total), world())
    assert room.phase == P.PARTIAL and Notify() in effects
    return room


# ---- unit tests --------------------------------------------------------------------------------

def test_the_phase_is_reexported_by_the_receiver_module() -> None:
    assert ReexportedPhase is ReceiverPhase


def test_init_asks_for_the_first_round_and_only_once() -> None:
    room = new_room()
    assert room.on(Init((3, 4)), world()) == [SendRound((3, 4), None, register=True)]
    assert room.phase == P.WAITING and room.round_end == 2 * BS and room.state.status == KVPoll.WaitingForInput
    with pytest.raises(ValueError):
        room.on(Init((5,)), world())
    with pytest.raises(ValueError):
        new_room().on(Init(()), world())


def test_an_init_for_a_closed_room_gives_its_blocks_back_and_sends_nothing() -> None:
    room = new_room()
    room.on(Abort(FailureKind.PEER_DEAD, "dead"), world(0.0))
    assert room.phase == P.CLOSED
    assert room.on(Init((1, 2)), world()) == [FreeBlocks((1, 2))]


def test_a_partial_round_then_a_resume_then_success_lands_the_embedding() -> None:
    room = partial_room(total=20)
    assert room.state.status == KVPoll.Transferring and room.total_tokens == 20 and room.sending_at == 101.0
    assert room.blocks_needed(99) == 3
    effects = room.on(Resumed((5, 6, 7)), world(2.0))
    assert effects == [SendRound((5, 6, 7), 8)]
    assert room.phase == P.WAITING and room.resume_rounds == 1 and room.state.progress.sent_tokens == 8
    effects = room.on(status(KVPoll.Success, 20), world())
    assert room.phase == P.LANDED and NoteSuccess() in effects and room.state.status == KVPoll.Success
    effects = room.on(Assemble(), world())
    (given_out,) = [e for e in effects if isinstance(e, CopyOut)]
    assert given_out.into == "assemble" and given_out.upto == 20
    assert [b for r in given_out.rounds for b in r.block_ids] == [0, 1, 5, 6, 7]
    assert room.used_blocks(given_out.rounds) == [0, 1, 5, 6, 7]
    assert room.phase == P.CLOSED and Forget() in effects and not freed(effects)


def test_the_announced_total_allows_an_early_resume_that_keeps_the_progress() -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    assert room.on(status(KVPoll.Transferring, 0, total=20), world()) == [Notify()]
    assert room.phase == P.EARLY and room.total_tokens == 20
    effects = room.on(Resumed((2, 3, 4)), world(1.0))
    assert effects == [Count("early_resumes"), SendRound((2, 3, 4), 8)]
    assert room.state.status == KVPoll.WaitingForInput and room.state.progress.sent_tokens == 0
    assert room.on(Spill(), world()) == []  # both rounds may be written into: nothing is spilled
    room.on(status(KVPoll.Transferring, 8, aux_total=20), world())  # round one landed, round two under way
    assert room.phase == P.WAITING and room.state.status == KVPoll.WaitingForInput
    room.on(status(KVPoll.Success, 20), world())
    assert room.phase == P.LANDED


def test_the_reference_strategy_never_resumes_early() -> None:
    room = new_room(clone_concat=True)
    room.on(Init((0, 1)), world())
    room.on(status(KVPoll.Transferring, 0, total=20), world())
    assert room.phase == P.WAITING and not room.resumable


def test_a_spill_gives_the_landed_rounds_to_host_memory() -> None:
    room = partial_room(total=20)
    effects = room.on(Spill(), world())
    assert effects == [CopyOut((Round(0, (0, 1)),), 20, "spill"), Count("spilled_tokens", 8)]
    assert room.rounds == [] and room.spilled == 8
    assert room.on(Spill(), world()) == []
    assert room.on(Clone(), world()) == []


def test_an_abort_while_a_round_is_written_waits_for_the_ack() -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    effects = room.on(Abort(FailureKind.CANCELLED, "client left"), world(5.0))
    assert room.phase == P.ABORTING and room.state.status == KVPoll.Failed
    assert kinds(effects) == [NoteFailure, Notify, SendAbort] and not freed(effects)
    assert room.on(Abort(FailureKind.TIMEOUT, "again"), world(6.0)) == []  # once
    assert room.on(AbortAck(ours=False), world()) == [Count("stale_message")]
    assert room.on(Tick(), world(5.0 + HOLD)) == []  # not past the hold yet
    effects = room.on(AbortAck(ours=True), world())
    assert effects[0] == Count("abort_acked") and freed(effects) == [0, 1] and room.phase == P.CLOSED
    assert NoteFailure not in kinds(effects)  # counted once, at the abort
    assert room.on(status(KVPoll.Failed, reason="late"), world()) == []


def unacked_room(blocks: tuple[int, ...] = (0, 1)) -> ReceiverRoom:
    """An aborted room whose ack did not come within the ack wait."""
    room = new_room()
    room.on(Init(blocks), world())
    room.on(Abort(FailureKind.PEER_DEAD, "heartbeats missed"), world(5.0))
    effects = room.on(Tick(), world(5.0 + HOLD + 0.1))
    assert kinds(effects) == [Count, Warn] and effects[0] == Count("abort_unacked") and not freed(effects)
    assert "stay out of use until it acknowledges" in effects[1].text
    assert room.phase == P.ABORTING and room.unacked
    assert room.on(Tick(), world(5.0 + HOLD + 1.0)) == []  # said once
    return room


def test_an_unacked_abort_keeps_the_blocks_out_of_use_until_the_hold_ends() -> None:
    """A partitioned encoder may have a write queued in Mooncake that lands when the link returns."""
    room = unacked_room()
    assert room.on(Tick(), world(5.0 + HOLD + UNACKED - 0.1)) == []
    effects = room.on(Tick(), world(5.0 + HOLD + UNACKED + 0.1))
    assert kinds(effects)[0] is Warn and freed(effects) == [0, 1] and room.phase == P.CLOSED


@pytest.mark.parametrize("event", [AbortAck(ours=True), PeerGone(), PoolReleased(),
                                   status(KVPoll.Failed, reason="transfer: not settled")],
                         ids=["late ack", "peer gone", "pool deregistered", "failed status"])
def test_an_unacked_room_frees_its_blocks_once_nothing_can_land(event) -> None:
    room = unacked_room()
    effects = room.on(event, world())
    assert freed(effects) == [0, 1] and room.phase == P.CLOSED


def test_the_hold_grows_with_the_blocks_a_slow_link_may_still_be_writing() -> None:
    room = new_room()
    room.on(Init((0, 1, 2)), world())
    room.on(Abort(FailureKind.CANCELLED, "client left"), world(5.0))
    assert room.on(Tick(), world(5.0 + HOLD + 2.9, seconds_per_block=1.0)) == []  # 3 blocks at 1 s each
    assert kinds(room.on(Tick(), world(5.0 + HOLD + 3.1, seconds_per_block=1.0))) == [Count, Warn] and room.unacked
    effects = room.on(Tick(), world(5.0 + HOLD + UNACKED + 3.1, seconds_per_block=1.0))
    assert kinds(effects)[0] is Warn and freed(effects) == [0, 1, 2] and room.phase == P.CLOSED


def test_a_fork_room_is_never_sent_an_abort_and_waits_for_the_owed_round() -> None:
    room = new_room(extended=False)
    room.on(Init((0, 1)), world())
    effects = room.on(Abort(FailureKind.CANCELLED, "client left"), world(5.0))
    assert SendAbort not in kinds(effects) and room.phase == P.ABORTING
    assert room.on(Tick(), world(5.0 + HOLD + 1)) == []  # a fork gets fork_abort_hold
    effects = room.on(status(KVPoll.Transferring, aux_total=20), world())
    assert effects[0] == Count("fork_abort_settled") and freed(effects) == [0, 1] and room.phase == P.CLOSED


def test_an_abort_with_nothing_in_flight_frees_at_once_and_still_tells_the_encoder() -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    room.on(status(KVPoll.Success, 8, aux_total=8), world())
    effects = room.on(Abort(FailureKind.CANCELLED, "cancelled after its Success"), world(1.0))
    assert freed(effects) == [0, 1] and kinds(effects)[-1] is SendAbort and room.phase == P.CLOSED
    assert room.state.status == KVPoll.Failed
    with pytest.raises(TransferFailure):
        room.on(Assemble(), world())


def test_a_failed_status_frees_the_blocks_and_keeps_the_peers_reason() -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    effects = room.on(status(KVPoll.Failed, reason="too_large: 9000 tokens"), world())
    assert freed(effects) == [0, 1] and room.phase == P.CLOSED
    assert room.state.kind == FailureKind.TOO_LARGE and NoteFailure in kinds(effects)


@pytest.mark.parametrize("bad", [status(KVPoll.Transferring, 9, aux_total=20),  # more than allocated
                                 status(KVPoll.Transferring, 8, aux_total=0),  # no tokens
                                 status(KVPoll.Success, 8, aux_total=20),  # Success too early
                                 status(KVPoll.Transferring, 8, aux_total=8)])  # all landed, not Success
def test_an_inconsistent_status_aborts_the_room(bad: StatusIn) -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    effects = room.on(bad, world())
    assert effects[0] == Count("bad_status") and room.phase == P.ABORTING
    assert room.state.kind == FailureKind.PROTOCOL and SendAbort in kinds(effects)


def test_a_suspend_waits_for_its_ack_and_the_checkpoint_keeps_what_landed() -> None:
    room = partial_room(total=20)
    room.on(Resumed((5, 6, 7)), world(2.0))
    assert room.on(Suspend(), world()) == [SendSuspend()] and room.phase == P.SUSPENDING
    assert room.on(Suspend(), world()) == []
    with pytest.raises(RuntimeError):
        room.on(Checkpoint(), world())
    assert room.on(SuspendAck(ours=True), world(3.0)) == [Notify()] and room.phase == P.SUSPENDED
    effects = room.on(Checkpoint(), world())
    (given_out,) = [e for e in effects if isinstance(e, CopyOut)]
    assert given_out.into == "checkpoint" and given_out.upto == 8  # the resumed round never landed
    assert room.phase == P.CLOSED


def test_a_foreign_suspend_ack_aborts_the_room() -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    effects = room.on(SuspendAck(ours=False), world(2.0))
    assert effects[0] == Count("foreign_suspend") and room.phase == P.ABORTING and room.aborted_at == 2.0
    assert room.state.kind == FailureKind.ABORTED


def test_a_fork_room_suspends_on_the_status_of_its_round() -> None:
    room = new_room(extended=False)
    room.on(Init((0, 1)), world())
    assert room.on(Suspend(), world()) == [] and room.phase == P.SUSPENDING
    room.on(status(KVPoll.Transferring, aux_total=20), world())
    assert room.phase == P.SUSPENDED
    fork_partial = partial_room(extended=False)
    assert fork_partial.on(Suspend(), world()) == [Notify()] and fork_partial.phase == P.SUSPENDED


def test_a_restored_room_resumes_from_what_landed() -> None:
    room = new_room()
    assert room.on(Restore(20, aux(20), 2, landed=8), world()) == []
    assert room.phase == P.RESTORED and room.round_end == room.spilled == 8 and room.blocks_needed(99) == 3
    assert room.on(Resumed((4, 5, 6)), world(1.0)) == [SendRound((4, 5, 6), 8)]
    assert room.resume_rounds == 3
    with pytest.raises(ValueError):
        room.on(Restore(20, aux(20), 2, landed=8), world())
    again = new_room()
    again.on(Restore(None, None, 0, landed=0), world())
    assert again.blocks_needed(99) == 99
    assert again.on(Suspend(), world()) == [] and again.phase == P.SUSPENDED
    effects = again.on(Checkpoint(), world())
    assert [e.upto for e in effects if isinstance(e, CopyOut)] == [0] and again.phase == P.CLOSED


def test_timeouts_come_with_ticks() -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    assert room.on(Tick(), world(WAITING)) == []
    room.on(PeerWoke(), world(10.0))  # the waiting timeout starts again
    assert room.on(Tick(), world(WAITING + 5.0)) == []
    assert room.on(Tick(), world(WAITING + 5.0, asleep_since=0.0)) == []  # asleep: waits up to max_sleep
    room.on(Tick(), world(MAX_SLEEP + 1.0, asleep_since=0.0))
    assert room.phase == P.ABORTING and room.state.kind == FailureKind.TIMEOUT
    other = new_room()
    other.on(Init((0, 1)), world())
    other.on(Tick(), world(WAITING + 0.1))
    assert other.phase == P.ABORTING and "no data" in other.state.reason


def test_a_room_no_encoder_of_ours_claims_ends_at_the_join_wait() -> None:
    """Our encoder says a room is real (a status) once it has the room's encode request and the
    init: a room a client made up hears nothing and ends at the join wait, its blocks given back
    once the abort is acked; one that was announced waits for its data as long as before. A fork
    encoder says nothing of the kind: its rooms wait for data as they always did."""
    made_up = new_room()
    made_up.on(Init((0, 1)), world())
    assert made_up.on(Tick(), world(14.0, join=15.0)) == []
    made_up.on(Tick(), world(15.5, join=15.0))
    assert made_up.phase == P.ABORTING and made_up.state.kind == FailureKind.TIMEOUT
    assert "has no encode request for room 7 (none within 15s)" in made_up.state.reason
    assert freed(made_up.on(AbortAck(ours=True), world())) == [0, 1]
    real = new_room()
    real.on(Init((0, 1)), world())
    real.on(status(KVPoll.WaitingForInput, 0), world(0.5))
    assert real.on(Tick(), world(WAITING - 1.0, join=15.0)) == [] and real.phase == P.WAITING
    fork = new_room(extended=False)
    fork.on(Init((0, 1)), world())
    assert fork.on(Tick(), world(WAITING - 1.0, join=15.0)) == [] and fork.phase == P.WAITING


def test_a_room_the_encoder_never_spoke_of_is_not_counted_as_its_failure() -> None:
    """A room made up by a client (the encoder has no encode request for it) waits, hears
    nothing and times out: its failure is noted as one the encoder took no part in. A room the
    encoder announced a total for, then went silent, is the encoder's."""
    silent = new_room()
    silent.on(Init((0, 1)), world())
    (noted,) = [e for e in silent.on(Tick(), world(WAITING + 0.1)) if isinstance(e, NoteFailure)]
    assert noted.kind == FailureKind.TIMEOUT and not noted.joined
    started = new_room()
    started.on(Init((0, 1)), world())
    started.on(status(KVPoll.WaitingForInput, total=20), world(1.0))
    (noted,) = [e for e in started.on(Tick(), world(WAITING + 2.0)) if isinstance(e, NoteFailure)]
    assert noted.kind == FailureKind.TIMEOUT and noted.joined


def test_a_dead_peer_aborts_while_it_may_write_and_a_gone_one_frees_at_once() -> None:
    frozen = new_room()
    frozen.on(Init((0, 1)), world())
    effects = frozen.on(PeerDead("3 heartbeats missed", gone=False), world(1.0))
    assert frozen.phase == P.ABORTING and not freed(effects)
    assert frozen.on(PeerDead("again", gone=False), world(2.0)) == []
    assert freed(frozen.on(PeerGone(), world())) == [0, 1]
    gone = new_room()
    gone.on(Init((0, 1)), world())
    effects = gone.on(PeerDead("refused", gone=True), world(1.0))
    assert freed(effects) == [0, 1] and gone.phase == P.CLOSED and gone.state.kind == FailureKind.PEER_DEAD
    landed = new_room()
    landed.on(Init((0, 1)), world())
    landed.on(status(KVPoll.Success, 8, aux_total=8), world())
    assert landed.on(PeerDead("refused", gone=True), world(1.0)) == [] and landed.phase == P.LANDED


def test_a_restarted_encoder_is_asked_again_for_the_round_it_owes() -> None:
    room = partial_room(total=20)
    room.on(Resumed((5, 6, 7)), world(2.0))
    assert room.on(Rebound(True, "new peer"), world(3.0)) == [SendRound((5, 6, 7), 8)]
    assert room.peer_name == "new peer" and room.last_progress == 3.0
    first = new_room()
    first.on(Init((0, 1)), world())
    assert first.on(Rebound(True, "new peer"), world(3.0)) == [SendRound((0, 1), None)]  # an init again
    assert partial_room().on(Rebound(True, "p"), world(1.0)) == []  # nothing owed


def test_a_send_that_fails_closes_the_room_unless_it_waits_for_an_ack() -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    effects = room.on(SendFailed(), world())
    assert freed(effects) == [0, 1] and room.state.kind == FailureKind.PEER_UNREACHABLE
    aborting = new_room()
    aborting.on(Init((0, 1)), world())
    aborting.on(Abort(FailureKind.CANCELLED, "x"), world(0.0))
    assert aborting.on(SendFailed(), world()) == [] and aborting.phase == P.ABORTING


@pytest.mark.parametrize(("event", "at"), [
    *[pytest.param(event, world(1.0), id=type(event).__name__) for event in [
        status(KVPoll.Success, 8, aux_total=8), status(KVPoll.Failed), AbortAck(True), AbortAck(False), SuspendAck(True),
        SuspendAck(False), Abort(FailureKind.CANCELLED, "x"), Suspend(), SendFailed(), PeerGone(), PeerDead("x", True),
        PeerDead("x", False), PeerWoke(), Rebound(True, "p"), Spill(), Clone()]],
    pytest.param(Tick(), world(1e6), id="Tick"),
    pytest.param(Tick(), world(1e6, asleep_since=0.0), id="Tick asleep")])
def test_a_closed_room_sends_frees_and_counts_nothing(event, at: World) -> None:
    room = new_room()
    room.on(Init((0, 1)), world())
    room.on(status(KVPoll.Failed), world())
    assert room.phase == P.CLOSED
    assert room.on(event, at) == [] and room.phase == P.CLOSED
    for call in (Assemble(), Checkpoint(), Resumed((2,)), Restore(None, None, 0, 0)):
        with pytest.raises((RuntimeError, ValueError, TransferFailure)):
            room.on(call, world())


def test_the_table_ends_in_closed_and_refuses_other_moves() -> None:
    assert TRANSITIONS[P.CLOSED] == frozenset()
    assert all(P.CLOSED in targets for phase, targets in TRANSITIONS.items() if phase != P.CLOSED)
    with pytest.raises(AssertionError, match="room 7: no transition PARTIAL -> LANDED"):
        checked_move(TRANSITIONS, P.PARTIAL, P.LANDED, "room 7")


def test_only_the_room_assigns_a_phase() -> None:
    """No module of the language side sets a room's phase but ReceiverRoom._move."""
    root = pathlib.Path(__file__).resolve().parent.parent
    offenders = []
    for path in [root / "connector" / "receiver.py", root / "connector" / "receiver_rooms.py"]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                for sub in ast.walk(node):
                    targets = sub.targets if isinstance(sub, ast.Assign) else (
                        [sub.target] if isinstance(sub, (ast.AugAssign, ast.AnnAssign)) else [])
                    for t in targets:
                        if isinstance(t, ast.Attribute) and t.attr == "phase" and node.name != "_move":
                            offenders.append(f"{path.name}:{sub.lineno} in {node.name}")
    assert offenders == []


# ---- property tests: random event orders ---------------------------------------------------

# What ends or pauses a room comes up more often than the rarer messages.
DISRUPTIONS = ["suspend"] * 3 + ["abort"] * 3 + ["tick"] * 2 + ["peer_dead"] * 3 + [
    "bogus", "fail", "abort_ack", "foreign_abort_ack", "suspend_ack", "foreign_suspend_ack", "sleep_tick", "peer_gone",
    "peer_woke", "rebind", "send_failed", "assemble", "checkpoint"]


class Sim:
    """A room, the blocks handed to it, and a model encoder: ``writable`` holds the rounds it
    was asked for and has not reported (it may be writing into their blocks)."""

    def __init__(self, extended: bool, total: int, clone_concat: bool, restored: bool) -> None:
        self.room = new_room(extended, clone_concat)
        self.total = total
        self.now = 0.0
        self.next_block = 0
        self.owned: set[int] = set()
        self.freed: collections.Counter[int] = collections.Counter()
        self.writable: dict[int, tuple[int, ...]] = {}  # start -> block ids
        self.abort_sent = self.suspend_sent = False
        self.noted_failure = self.noted_success = False
        self.forgotten = 0
        if restored:
            landed = min(total - 1, BS * (total // (2 * BS)))
            self.step(Restore(total if landed else None, aux(total) if landed else None, 1, landed))

    def blocks(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next_block, self.next_block + n))
        self.next_block += n
        self.owned.update(ids)
        return ids

    def step(self, event, at: World | None = None, *, peer_stopped: bool = False) -> list:
        """Hand the room ``event`` (at ``self.now`` unless ``at`` says otherwise) and check its effects."""
        room = self.room
        before, was_failed = room.phase, room.state.status == KVPoll.Failed
        if peer_stopped:  # the encoder wrote its last byte before this event
            self.writable.clear()
        may_free_written = before == P.ABORTING and isinstance(event, Tick)  # the ack timeout, by design
        effects = room.on(event, at or world(self.now))
        after = room.phase
        assert after == before or after in TRANSITIONS[before] or any(
            after in TRANSITIONS[mid] for mid in TRANSITIONS[before]), f"{before} -> {after} on {event}"
        if before == P.CLOSED:
            assert effects == [] or effects == [FreeBlocks(event.block_ids)], f"closed room answered {effects}"
        for eff in effects:
            if isinstance(eff, SendRound):
                assert set(eff.block_ids) <= self.owned and not any(self.freed[b] for b in eff.block_ids)
                self.writable[eff.start or 0] = eff.block_ids
            elif isinstance(eff, SendAbort):
                assert self.room.extended
                self.abort_sent = True
            elif isinstance(eff, SendSuspend):
                assert self.room.extended
                self.suspend_sent = True
            elif isinstance(eff, (FreeBlocks, CopyOut)):
                ids = eff.block_ids if isinstance(eff, FreeBlocks) else [b for r in eff.rounds for b in r.block_ids]
                for b in ids:
                    assert b in self.owned and self.freed[b] == 0, f"block {b} freed twice or never handed over"
                    self.freed[b] += 1
                    if not may_free_written:
                        assert all(b not in w for w in self.writable.values()), f"block {b} freed while written"
            elif isinstance(eff, NoteFailure):
                assert not self.noted_failure
                self.noted_failure = True
            elif isinstance(eff, NoteSuccess):
                assert not self.noted_failure and not self.noted_success
                self.noted_success = True
            elif isinstance(eff, Forget):
                self.forgotten += 1
        if was_failed:
            assert room.state.status == KVPoll.Failed, "Success (or progress) after a failure"
        if after == P.LANDED:
            assert room.state.status == KVPoll.Success
        if after == P.CLOSED:
            assert not room.rounds
        return effects

    def progress(self) -> list[str]:
        """The steps that move the room on from where it is."""
        room = self.room
        steps = []
        if room.phase == P.CREATED:
            steps.append("init")
        if room.resumable:
            steps.append("resume")
        if self.writable and room.phase != P.CLOSED:
            if room.extended and room.total_tokens is None:  # ours announces it as round one starts
                steps += ["announce", "announce"]
            steps.append("land")
        if room.phase == P.LANDED:
            steps.append("assemble")
        if room.phase == P.SUSPENDING and self.suspend_sent:
            steps.append("suspend_ack")
        if room.phase == P.SUSPENDED:
            steps.append("checkpoint")
        if room.phase == P.ABORTING and self.abort_sent:
            steps.append("abort_ack")
        return steps

    def run(self, data: st.DataObject, max_steps: int = 40) -> None:
        """Random steps: mostly progress, else any of the disruptions; one more once the room is
        closed (which it must not answer)."""
        for _ in range(max_steps):
            closed, steps = self.room.phase == P.CLOSED, self.progress()
            if steps and data.draw(st.integers(0, 9), label="progress?") < 6:
                action = data.draw(st.sampled_from(steps), label="progress")
            else:
                action = data.draw(st.sampled_from(DISRUPTIONS), label="disruption")
            self.act(action, data.draw(st.integers(0, 7), label="arg"))
            if closed:
                return

    def act(self, action: str, arg: int) -> None:
        room, self.now = self.room, self.now + 1.0
        if action == "init":
            if room.phase in (P.CREATED, P.CLOSED):
                self.step(Init(self.blocks(1 + arg % 4)))
        elif action == "resume":
            if not room.resumable:
                return
            if room.clone_concat:
                self.step(Clone())
            if arg % 2 == 0:  # the pool is full
                self.step(Spill())
            self.step(Resumed(self.blocks(max(1, min(room.blocks_needed(3), 1 + arg % 4)))))
        elif action == "land":  # the encoder finishes the oldest round it was asked for and reports it
            if not self.writable or room.phase == P.CLOSED:
                return
            start = min(self.writable)
            end = min(self.total, start + len(self.writable.pop(start)) * BS)
            first = room.aux is None and room.rounds
            self.step(StatusIn(KVPoll.Success if end == self.total else KVPoll.Transferring,
                               end if room.extended else None, None, "", aux(self.total) if first else None, self.now))
        elif action == "announce":
            if room.extended and self.writable:
                self.step(status(KVPoll.Transferring, 0, total=self.total))
        elif action == "bogus":  # more tokens than allocated: the room must fail, blocks still written
            # (only ours counts tokens: a fork's status names none, and it sends one only for a round it wrote)
            if room.extended and room.phase != P.CLOSED and room.rounds:
                first = room.aux is None
                self.step(status(KVPoll.Transferring, room.round_end + BS, aux_total=self.total if first else None))
        elif action == "fail":  # sent only with nothing in flight
            self.step(status(KVPoll.Failed, reason="encoder_failed: oom"), peer_stopped=True)
        elif action == "abort":
            self.step(Abort(FailureKind.CANCELLED, "client left"))
        elif action == "suspend":
            self.step(Suspend())
        elif action == "abort_ack":
            if self.abort_sent:  # an ack comes with nothing in flight
                self.step(AbortAck(ours=True), peer_stopped=True)
        elif action == "foreign_abort_ack":
            if room.extended:
                self.step(AbortAck(ours=False), peer_stopped=True)
        elif action == "suspend_ack":
            if self.suspend_sent:
                self.step(SuspendAck(ours=True), peer_stopped=True)
        elif action == "foreign_suspend_ack":
            if room.extended:
                self.step(SuspendAck(ours=False), peer_stopped=True)
        elif action == "tick":
            self.now += [0.0, 20.0, 40.0, 400.0][arg % 4]
            self.step(Tick())
        elif action == "sleep_tick":
            self.now += [1.0, 700.0][arg % 2]
            self.step(Tick(), world(self.now, asleep_since=self.now - [1.0, 700.0][arg % 2]))
        elif action == "peer_dead":
            gone = bool(arg % 2)
            self.step(PeerDead("heartbeats missed", gone), peer_stopped=gone)
        elif action == "peer_gone":
            self.step(PeerGone(), peer_stopped=True)
        elif action == "peer_woke":
            self.step(PeerWoke())
        elif action == "rebind":  # the restarted encoder lost whatever it was writing
            self.step(Rebound(room.extended, "restarted peer"), peer_stopped=True)
        elif action == "send_failed":  # the encoder cannot take messages: it writes nothing either
            self.step(SendFailed(), peer_stopped=True)
        elif action == "assemble":
            if room.phase == P.LANDED:
                self.step(Assemble())
            else:
                with pytest.raises((RuntimeError, TransferFailure)):
                    room.on(Assemble(), world(self.now))
        elif action == "checkpoint":
            if room.phase == P.SUSPENDED:
                self.step(Checkpoint())
            else:
                with pytest.raises(RuntimeError):
                    room.on(Checkpoint(), world(self.now))

    def close(self, how: str) -> None:
        """Hand the room back: assemble or checkpoint what can be, abort the rest, then end the
        wait for the peer (its ack or the round it owes, the hold running out, or it is gone)."""
        room = self.room
        if room.phase == P.LANDED and how != "cancel":
            self.step(Assemble())
        if room.phase == P.SUSPENDED:
            self.step(Checkpoint())
        self.now += 1.0
        self.step(Abort(FailureKind.CANCELLED, "closing"))
        if room.phase == P.ABORTING:
            if how == "tick":
                self.now += max(FORK_HOLD, HOLD + UNACKED) + 1.0
                self.step(Tick())
            elif how == "gone":
                self.step(PeerGone(), peer_stopped=True)
            elif room.extended:
                self.step(AbortAck(ours=True), peer_stopped=True)
            else:  # the fork reports the round it owes
                self.step(status(KVPoll.Transferring), peer_stopped=True)
        assert room.phase == P.CLOSED, f"room left in {room.phase}"
        assert set(self.freed) == self.owned and all(n == 1 for n in self.freed.values())
        assert self.forgotten == 1


@pytest.mark.parametrize("extended", [True, False], ids=["ours", "fork"])
@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 40), clone_concat=st.booleans(), restored=st.booleans(),
       how=st.sampled_from(["ack", "tick", "gone", "cancel"]), data=st.data())
def test_random_event_orders_keep_the_invariants(extended: bool, total: int, clone_concat: bool, restored: bool,
                                                 how: str, data: st.DataObject) -> None:
    sim = Sim(extended, total, clone_concat, restored)
    sim.run(data, data.draw(st.integers(0, 25), label="steps"))  # then close it, wherever it stands
    sim.close(how)
    assert sim.room.on(Abort(FailureKind.CANCELLED, "after"), world(sim.now)) == []
    assert sim.room.on(Rebound(extended, "p"), world(sim.now)) == []


@settings(max_examples=200, deadline=None)
@given(extended=st.booleans(), total=st.integers(1, 40),
       actions=st.lists(st.tuples(st.sampled_from(["init", "resume", "land", "announce"]), st.integers(0, 7)),
                        max_size=60))
def test_a_well_behaved_encoder_always_lands_the_embedding(extended: bool, total: int,
                                                           actions: list[tuple[str, int]]) -> None:
    """With no failure, the rounds asked for always add up: the room lands with every token."""
    sim = Sim(extended, total, clone_concat=False, restored=False)
    for action, arg in actions + [(a, 0) for a in ["init"] + ["resume", "land", "land"] * (total + 2)]:
        sim.act(action, arg)
    assert sim.room.phase == P.LANDED and sim.room.state.progress.sent_tokens == total
    assert sim.noted_success and not sim.noted_failure
    sim.close("ack")
