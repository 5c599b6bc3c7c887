"""Encode-side rooms as state machines: phases, the one transition table, and ``SenderRoom.on``.

``SenderRoom.on(event, world)`` is the only place a room's phase changes, and every change goes
through ``TRANSITIONS`` (a room restored from a checkpoint too: the ``Restored`` event). The room
holds the protocol's data and nothing else: no socket, lock, pool, allocator or clock. What it
needs to know of the world comes in a :class:`World` (the time, whether this worker is paused,
which of its language registrations may be written to now); what it wants done comes back as a list
of effects that :class:`connector.sender.EmbeddingSenderManager` applies in order (send a
frame, start a write, free blocks, settle the staging budget, answer the encode request).

A room's phase says what it waits for; where its embedding is (host memory, pool blocks or
nowhere yet) is kept beside it, because data may move between the two in several phases (the
placer puts it into blocks, a sleep or an eviction takes it out). Its source blocks are freed
by the ``FreeBlocks`` effects of :meth:`SenderRoom._end` (the room ended and no write of it is
in flight) and of the placement events (data moved out, or a copy finished for a room that ended
meanwhile).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from connector.buffers import Embedding
from connector.failures import FailureKind, TransferFailure, wire_reason
from connector.messages import AbortAckMsg, AbortMsg, StatusMsg, SuspendAckMsg, SuspendMsg
from connector.poll import KVPoll, RoomState
from connector.transitions import checked_move


class SenderPhase(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # not every destination has sent its init
    AWAITING_DATA = "awaiting_data"  # every init is in; the embedding is not handed over yet
    # Data here and every destination ready for the next round: it starts once the data is in
    # pool blocks, every destination session is confirmed and this worker is not paused.
    READY = "ready"
    WRITING = "writing"  # a round (and perhaps the next, requested early) is being written
    AWAITING_RESUME = "awaiting_resume"  # a partial round landed; the destination allocates the rest
    SUSPENDED = "suspended"  # the language side sleeps: nothing is written until it asks again
    DRAINING = "draining"  # failed while a write is in flight; ends when that write has settled
    DONE = "done"  # every destination has every token
    FAILED = "failed"


P = SenderPhase
TRANSITIONS: dict[SenderPhase, frozenset[SenderPhase]] = {
    P.BOOTSTRAPPING: frozenset({P.AWAITING_DATA, P.READY, P.SUSPENDED, P.FAILED}),
    P.AWAITING_DATA: frozenset({P.READY, P.SUSPENDED, P.FAILED}),
    P.READY: frozenset({P.WRITING, P.SUSPENDED, P.FAILED}),
    P.WRITING: frozenset({P.READY, P.AWAITING_RESUME, P.SUSPENDED, P.DONE, P.DRAINING}),
    P.AWAITING_RESUME: frozenset({P.READY, P.AWAITING_DATA, P.SUSPENDED, P.FAILED}),
    P.SUSPENDED: frozenset({P.BOOTSTRAPPING, P.AWAITING_DATA, P.READY, P.FAILED}),
    P.DRAINING: frozenset({P.FAILED}),
    P.DONE: frozenset(),
    P.FAILED: frozenset(),
}
LIVE = frozenset({P.BOOTSTRAPPING, P.AWAITING_DATA, P.READY, P.WRITING, P.AWAITING_RESUME, P.SUSPENDED})


@dataclass
class Destination:
    endpoint: str
    port: int
    session_id: str
    block_ids: tuple[int, ...]
    allocated_tokens: int
    ready: bool = True  # has blocks for the round to come
    # When it joined the room (its init; the resume that rebound a suspended room), on the
    # manager's clock: the heartbeat pings sent to its session before then speak for it.
    joined: float = 0.0

    @property
    def peer(self) -> tuple[str, str, int]:
        """Its registration: the Mooncake session and the endpoint that registered it."""
        return self.session_id, self.endpoint, self.port


@dataclass
class Write:
    """One round being written: tokens ``[start, end)`` from ``src_blocks`` into each
    destination's blocks as they were when the round started (an early resume may already have
    replaced them)."""

    start: int
    end: int
    dsts: list[Destination]
    src_blocks: tuple[int, ...]
    done: bool = False


@dataclass(frozen=True)
class Timeouts:
    bootstrap: float  # init and data of a new room
    resume: float  # a partial room waiting for its resume
    max_sleep: float  # a suspended room waiting for its language side to wake


@dataclass(frozen=True)
class World:
    """What a room's decision depends on outside the room, read by the manager as it calls ``on``."""

    now: float
    paused: bool = False  # this worker sleeps: no write starts
    writable: frozenset[tuple[str, str, int]] = frozenset()  # the room's registrations confirmed alive now


# ---- events: what happened to the room ----------------------------------------------------


@dataclass(frozen=True)
class Restored:
    """Made from a checkpoint on disk: the whole embedding in host memory, ``sent_tokens`` sent."""

    data: Embedding
    sent_tokens: int
    destinations: int


@dataclass(frozen=True)
class Handover:
    """The encode request hands over the whole embedding, in host memory."""

    embedding: Embedding


@dataclass(frozen=True)
class Init:
    dst: Destination
    required_dsts: int


@dataclass(frozen=True)
class Resume:
    """A resume that passed :meth:`SenderRoom.resume_refusal`."""

    dst: Destination
    sent_tokens: int


@dataclass(frozen=True)
class Refused:
    """An init or resume from ``host:port`` was refused: tell it ``Failed`` (after the room's
    writes have landed, when it is one of the room's own destinations)."""

    host: str
    port: int
    status: StatusMsg


@dataclass(frozen=True)
class Abort:
    msg: AbortMsg


@dataclass(frozen=True)
class Suspend:
    msg: SuspendMsg


@dataclass(frozen=True)
class Fail:
    kind: FailureKind
    reason: str
    notify: bool = True  # tell the destinations (not when one of them asked for the failure)


@dataclass(frozen=True)
class Kick:
    """Something outside the room changed (a session confirmed, this worker woke, data moved):
    report a landed round that waited for it and start what can start."""


@dataclass(frozen=True)
class WriteLanded:
    write: Write
    error: str = ""


@dataclass(frozen=True)
class MoveStarted:
    """The placer began copying the room's data between host memory and pool blocks."""


@dataclass(frozen=True)
class Placed:
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class TakenOut:
    """The room's blocks were read back into host memory as ``data`` (lent blocks taken back, sleep)."""

    data: Embedding


@dataclass(frozen=True)
class Woken:
    """A new pool is attached after a sleep: every wait restarts."""


@dataclass(frozen=True)
class Claimed:
    """An encode request owns the room now: the destinations already in hear that it is real."""


@dataclass(frozen=True)
class Tick:
    """Time passed: fail a wait that ran out."""


Event = (Restored | Handover | Init | Resume | Refused | Abort | Suspend | Fail | Kick | WriteLanded
         | MoveStarted | Placed | TakenOut | Woken | Claimed | Tick)


# ---- effects: what the manager does for the room, in order ----------------------------------------


@dataclass(frozen=True)
class SendStatus:
    host: str
    port: int
    status: StatusMsg


@dataclass(frozen=True)
class SendAck:
    host: str
    port: int
    ack: AbortAckMsg | SuspendAckMsg


@dataclass(frozen=True)
class AnnounceJoined:
    """The room has its encode half (a request claimed it, or its data is here) and ``dst`` has
    sent its init: tell it the room is real, so it keeps its blocks for it past the join wait."""

    dst: Destination


@dataclass(frozen=True)
class AnnounceTotal:
    """An oversized first round starts: tell the destination the total now, so it can allocate
    and resume while this round is written."""

    dst: Destination


@dataclass(frozen=True)
class StartWrite:
    write: Write


@dataclass(frozen=True)
class FreeBlocks:
    """Give these blocks back to the allocator now: no write reads from them any more."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class WantBlocks:
    """The room's data is in host memory and it wants pool blocks (queue it for the placer)."""


@dataclass(frozen=True)
class StagingSettle:
    nbytes: int  # what the handed-over embedding takes in host memory


@dataclass(frozen=True)
class StagingCharge:
    nbytes: int  # data came back into host memory


@dataclass(frozen=True)
class StagingPromote:
    """Every destination asked for the room: its staging reservation goes first."""


@dataclass(frozen=True)
class StagingRelease:
    error: TransferFailure | None = None  # fails a reservation still waiting


@dataclass(frozen=True)
class Delivered:
    failure: TransferFailure | None = None  # None: every destination has every token


@dataclass(frozen=True)
class RoomFailed:
    kind: FailureKind
    reason: str


@dataclass(frozen=True)
class PeerFailed:
    peer: str  # "endpoint:port" of a destination
    kind: FailureKind
    reason: str
    joined: bool  # the room had its encode request: not a room only the destination knew of


@dataclass(frozen=True)
class PeerSucceeded:
    peer: str


@dataclass(frozen=True)
class Confirm:
    """A write or its status waits for these registrations to confirm they are alive (ping them)."""

    peers: tuple[tuple[str, str, int], ...]


@dataclass(frozen=True)
class Count:
    stat: str
    n: int = 1


@dataclass(frozen=True)
class Ended:
    """The room ended and nothing of it is in flight."""


Effect = (SendStatus | SendAck | AnnounceJoined | AnnounceTotal | StartWrite | FreeBlocks | WantBlocks | StagingSettle
          | StagingCharge | StagingPromote | StagingRelease | Delivered | RoomFailed | PeerFailed
          | PeerSucceeded | Confirm | Count | Ended)


def embedding_nbytes(emb: Embedding) -> int:
    return emb.embeddings.nbytes + emb.fill_ids.nbytes + emb.mrope_positions.nbytes


@dataclass
class SenderRoom:
    room: int
    timeouts: Timeouts
    deadline: float  # of the bootstrap or resume wait
    phase: SenderPhase = SenderPhase.BOOTSTRAPPING
    state: RoomState = field(default_factory=RoomState)
    claimed: bool = False  # an encode request owns it: a second one for the room is refused
    required_dsts: int = 0  # 0 until the first init arrives
    dsts: list[Destination] = field(default_factory=list)
    total_tokens: int = 0
    staged: Embedding | None = None  # the embedding in host memory (never also in blocks)
    src_blocks: tuple[int, ...] | None = None  # the embedding in pool blocks
    moving: bool = False  # the placer is copying the data between host memory and blocks
    writes: list[Write] = field(default_factory=list)  # in token order; at most two
    round_end: int = 0  # sent_tokens once the rounds being written land
    pending_acks: list[AbortMsg] = field(default_factory=list)
    pending_suspend_acks: list[SuspendMsg] = field(default_factory=list)
    # Failed statuses held back while a write is in flight: a peer frees its blocks on Failed,
    # so it must not see one before the last byte has landed.
    held_failures: list[SendStatus] = field(default_factory=list)
    suspended_at: float = 0.0

    # ---- reading ---------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return self.phase in LIVE

    @property
    def in_flight(self) -> bool:
        return bool(self.writes)

    @property
    def has_data(self) -> bool:
        return self.staged is not None or self.src_blocks is not None

    @property
    def inited(self) -> bool:
        return self.required_dsts > 0 and len(self.dsts) >= self.required_dsts

    @property
    def lent(self) -> bool:
        """Holds blocks no destination is waiting on: they can be taken back."""
        return (self.src_blocks is not None and not self.moving and not self.in_flight
                and self.phase in (P.BOOTSTRAPPING, P.SUSPENDED))

    @property
    def claimable(self) -> bool:
        """An encode request may take the room (nobody owns it, it did not finish, it holds no data)."""
        return not (self.claimed or self.phase == P.DONE or (self.live and self.has_data))

    def peers(self) -> set[tuple[str, str, int]]:
        """The language registrations (session, endpoint) the room writes or will write to."""
        return {d.peer for d in self.dsts} | {d.peer for w in self.writes for d in w.dsts}

    def owned_by(self, host: str, port: int) -> bool:
        """``host:port`` is the language endpoint of one of the room's destinations."""
        return any((d.endpoint, d.port) == (host, port) for d in self.dsts)

    def resume_refusal(self, session_id: str, sent_tokens: int) -> str:
        """Why a resume from ``session_id`` at ``sent_tokens`` cannot be served; "" when it can."""
        if not self.live:
            return f"resume for unknown or finished room {self.room}"
        progress = self.state.progress
        if self.phase == P.SUSPENDED:  # after a sleep: any state, as long as progress agrees
            if max(len(self.dsts), self.required_dsts) > 1:
                return (f"room {self.room} has {max(len(self.dsts), self.required_dsts)} destinations; "
                        "only one can be resumed after sleep")
            if sent_tokens != progress.sent_tokens:
                return f"resume after sleep at sent_tokens {sent_tokens} != {progress.sent_tokens} already sent"
            return ""
        if not any(d.session_id == session_id for d in self.dsts):
            return f"resume for room {self.room} from session {session_id}, which did not init it"
        if self.phase == P.WRITING:
            if len(self.writes) == 1 and len(self.dsts) == 1 and sent_tokens == self.round_end < self.total_tokens:
                return ""  # early: it continues where the round being written ends
            return f"resume for room {self.room} at {sent_tokens} while tokens up to {self.round_end} are being written"
        if self.phase != P.AWAITING_RESUME:
            return f"resume for room {self.room} in state {progress.status.name}"
        if sent_tokens != progress.sent_tokens:
            return f"resume sent_tokens {sent_tokens} != {progress.sent_tokens} already sent"
        return ""

    # ---- the state machine -------------------------------------------------------------------

    def on(self, event: Event, world: World) -> list[Effect]:
        """Apply ``event``; return what the manager must do, in order."""
        out: list[Effect] = []
        match event:
            case Restored(data, sent_tokens, destinations):
                self.total_tokens, self.staged, self.required_dsts = data.num_tokens, data, destinations
                out.append(StagingCharge(embedding_nbytes(data)))
                if sent_tokens:
                    self.state.advance(KVPoll.Transferring, sent_tokens)
                self._move(P.SUSPENDED, world)
            case Handover(embedding):
                self._handover(embedding, world, out)
            case Init(dst, required_dsts):
                self._init(dst, required_dsts, world, out)
            case Resume(dst, sent_tokens):
                self._resume(dst, sent_tokens, world, out)
            case Refused(host, port, status):
                self._tell_failed(SendStatus(host, port, status), out)
            case Abort(msg):
                if self.phase == P.DRAINING:
                    self.pending_acks.append(msg)
                elif not self.live:
                    out.append(SendAck(msg.endpoint, msg.dst_port, AbortAckMsg(self.room, msg.generation)))
                else:
                    self.pending_acks.append(msg)  # acked when the room ends (nothing in flight then)
                    self._fail(FailureKind.ABORTED, f"aborted by language peer {msg.endpoint}:{msg.dst_port}",
                               False, world, out)
            case Suspend(msg):
                self._suspend(msg, world, out)
            case Fail(kind, reason, notify):
                self._fail(kind, reason, notify, world, out)
            case Kick():
                if self.writes and self.writes[0].done:  # landed while its status waited for a pong
                    self._settle(world, out)
                self._start(world, out)
            case WriteLanded(write, error):
                write.done = True
                if error:
                    self._fail(FailureKind.TRANSFER, error, True, world, out)
                self._settle(world, out)
            case MoveStarted():
                self.moving = True
            case Placed(blocks):
                self.moving = False
                if self.live and self.staged is not None:
                    self.src_blocks, self.staged = blocks, None
                    out += [StagingRelease(), Count("placed")]
                else:  # ended while it was copied in
                    out.append(FreeBlocks(blocks))
                self._start(world, out)
            case TakenOut(data):
                self._taken_out(data, out)
                self._start(world, out)
            case Woken():
                self.deadline = max(self.deadline, world.now + self.timeouts.resume)
            case Claimed():
                self.claimed = True
                if self.live:
                    out += [AnnounceJoined(d) for d in self.dsts]
            case Tick():
                self._check_timeout(world, out)
            case _:
                raise TypeError(f"room {self.room}: unknown event {event!r}")
        return out

    # ---- transitions (each changes the phase only through _move) ----------------------------------

    def _move(self, phase: SenderPhase, world: World) -> None:
        self.phase = checked_move(TRANSITIONS, self.phase, phase, f"room {self.room}")
        if phase == P.SUSPENDED:
            self.suspended_at = world.now

    def _handover(self, embedding: Embedding, world: World, out: list[Effect]) -> None:
        if not self.live:  # aborted meanwhile: nothing to keep
            out.append(StagingRelease())
            return
        self.staged, self.total_tokens = embedding, embedding.num_tokens
        out.append(StagingSettle(embedding_nbytes(embedding)))
        if self.phase == P.AWAITING_DATA:
            self._move(P.READY, world)
        self._want_blocks(out)  # asked for or not: an idle pool lends it blocks

    def _init(self, dst: Destination, required_dsts: int, world: World, out: list[Effect]) -> None:
        hold = self.owned_by(dst.endpoint, dst.port)
        if not self.live:  # failed (aborted, refused) or finished: say so, with the reason
            kind = self.state.kind or FailureKind.CONFLICT
            why = self.state.reason or f"room {self.room} already finished"
            self._tell_failed(SendStatus(dst.endpoint, dst.port, StatusMsg(
                self.room, KVPoll.Failed, 0, wire_reason(kind, why))), out, hold)
            return
        if self.phase == P.SUSPENDED and not self.dsts:  # restored from disk, asked for again from token 0
            self._move(P.BOOTSTRAPPING, world)
        if self.phase != P.BOOTSTRAPPING or self.inited:
            self._tell_failed(SendStatus(dst.endpoint, dst.port, StatusMsg(self.room, KVPoll.Failed, 0, wire_reason(
                FailureKind.CONFLICT, f"room {self.room} already initialised"))), out, hold)
            return
        self.required_dsts = required_dsts
        dst.joined = world.now
        self.dsts.append(dst)
        if self.claimed or self.has_data:
            out.append(AnnounceJoined(dst))
        if self.inited:
            self.state.advance(KVPoll.WaitingForInput)
            self._move(P.READY if self.has_data else P.AWAITING_DATA, world)
            out.append(StagingPromote())
            self._start(world, out)

    def _resume(self, dst: Destination, sent_tokens: int, world: World, out: list[Effect]) -> None:
        if self.phase == P.WRITING:  # early resume: its round starts right away
            self._ready_again(self.dsts[0], dst)
            self._start(world, out)
            return
        if self.phase == P.SUSPENDED:  # woken or restarted language side (or encoder): rebind
            dst.joined = world.now
            self.dsts, self.required_dsts = [dst], 1
        else:
            self._ready_again(next(d for d in self.dsts if d.session_id == dst.session_id), dst)
        if all(d.ready for d in self.dsts):
            self.state.advance(KVPoll.WaitingForInput, sent_tokens)
            self._move(P.READY if self.has_data else P.AWAITING_DATA, world)
            self._start(world, out)

    @staticmethod
    def _ready_again(slot: Destination, resumed: Destination) -> None:
        slot.block_ids, slot.allocated_tokens, slot.ready = resumed.block_ids, resumed.allocated_tokens, True

    def _suspend(self, msg: SuspendMsg, world: World, out: list[Effect]) -> None:
        """The language side goes to sleep: write nothing more for the room, ack once idle (a
        draining room once its write has settled: the ack lets the language side free the blocks)."""
        if self.phase == P.DRAINING:
            self.pending_suspend_acks.append(msg)
            return
        if not self.live:
            out.append(SendAck(msg.endpoint, msg.dst_port, SuspendAckMsg(self.room, msg.generation)))
            return
        self.pending_suspend_acks.append(msg)
        if not self.in_flight:
            if self.phase != P.SUSPENDED:
                self._move(P.SUSPENDED, world)
            self._send_suspend_acks(out)

    def _fail(self, kind: FailureKind, reason: str, notify: bool, world: World, out: list[Effect]) -> None:
        """Fail a live room; tell its destinations; end it once nothing is in flight."""
        if not self.live or not self.state.fail(kind, reason):
            return
        out.append(RoomFailed(kind, reason))
        out += [PeerFailed(f"{d.endpoint}:{d.port}", kind, reason, self.claimed) for d in self.dsts]
        if notify:
            status = StatusMsg(self.room, KVPoll.Failed, self.state.progress.sent_tokens, wire_reason(kind, reason))
            for d in self.dsts:
                self._tell_failed(SendStatus(d.endpoint, d.port, status), out)
        out += [Delivered(self.state.failure(self.room)), StagingRelease(TransferFailure(kind, reason))]
        self.staged = None
        if self.in_flight:
            self._move(P.DRAINING, world)
            if all(write.done for write in self.writes):  # landed, their statuses held for a pong
                self._settle(world, out)
        else:
            self._move(P.FAILED, world)
            self._end(out)

    def _tell_failed(self, status: SendStatus, out: list[Effect], hold: bool = True) -> None:
        """Send a Failed status now, or (``hold``) once the room's writes have landed."""
        if hold and self.in_flight:
            self.held_failures.append(status)
        else:
            out.append(status)

    def _start(self, world: World, out: list[Effect]) -> None:
        """Start the room's next round if all it needs is there; ask for blocks if only they lack."""
        if world.paused or self.moving or self.phase not in (P.READY, P.WRITING):
            return
        if self.src_blocks is None:
            self._want_blocks(out)
            return
        if not self._confirmed(self.dsts, world, out):
            return  # a ping is out: its pong starts the round
        write = self._next_round()
        if write is None:
            return
        if self.writes:
            out.append(Count("pipelined_rounds"))
        self.writes.append(write)
        if self.phase == P.READY:
            self._move(P.WRITING, world)
        if write.start == 0 and write.end < self.total_tokens and len(self.dsts) == 1:
            out.append(AnnounceTotal(self.dsts[0]))
        out.append(StartWrite(write))

    def _next_round(self) -> Write | None:
        """The round to write next, or None when there is nothing to start now.

        A destination is ready again while a round is still being written only after an early
        resume; that next round is then written beside it, so no gap separates the two.
        """
        if len(self.writes) > 1 or not self.dsts or not all(d.ready for d in self.dsts):
            return None
        assert self.src_blocks is not None
        start = self.round_end if self.writes else self.state.progress.sent_tokens
        if start >= self.total_tokens:
            return None
        # Every destination gets the same round: the smallest allocation among them.
        self.round_end = start + min(self.total_tokens - start, min(d.allocated_tokens for d in self.dsts))
        for d in self.dsts:
            d.ready = False
        return Write(start, self.round_end, [dataclasses.replace(d) for d in self.dsts], self.src_blocks)

    def _settle(self, world: World, out: list[Effect]) -> None:
        """Report finished rounds in token order (a round written beside an earlier one waits for
        it), then end the room or go on with what comes next. After a stall of this process a
        round's status also waits for its sessions' pongs: a round that landed after its peer
        gave up on the room must not be reported as delivered (the abort comes first)."""
        if not self.live and self.phase != P.DRAINING:
            return  # ended already (a failed write's _fail settled it)
        while self.writes and self.writes[0].done:
            if self.phase != P.DRAINING and not self._confirmed(self.writes[0].dsts, world, out):
                return  # the pong's Kick settles it
            write = self.writes.pop(0)
            if self.phase == P.DRAINING:
                continue
            status = KVPoll.Success if write.end >= self.total_tokens else KVPoll.Transferring
            self.state.advance(status, write.end)
            # The resume wait starts before the peer can hear of the round (and answer it).
            self.deadline = world.now + self.timeouts.resume
            # The status goes out before any ack _end sends: a peer that sees the ack must
            # already know how the round ended.
            out += [SendStatus(d.endpoint, d.port, StatusMsg(self.room, status, write.end)) for d in write.dsts]
        if self.writes:
            return
        if self.phase == P.DRAINING:
            self._move(P.FAILED, world)
            self._end(out)
        elif self.state.status == KVPoll.Success:
            self._move(P.DONE, world)
            out += [PeerSucceeded(f"{d.endpoint}:{d.port}") for d in self.dsts]
            out.append(Delivered())
            self._end(out)
        elif self.pending_suspend_acks:
            self._move(P.SUSPENDED, world)
            self._send_suspend_acks(out)
        elif all(d.ready for d in self.dsts):  # resumed early, but the next round could not start yet
            self._move(P.READY, world)
            self._start(world, out)
        else:
            self._move(P.AWAITING_RESUME, world)

    @staticmethod
    def _confirmed(dsts: list[Destination], world: World, out: list[Effect]) -> bool:
        """Every registration of ``dsts`` is confirmed alive now; if not, ask those that are not."""
        unconfirmed = tuple(dict.fromkeys(d.peer for d in dsts if d.peer not in world.writable))
        if unconfirmed:
            out.append(Confirm(unconfirmed))
        return not unconfirmed

    def _taken_out(self, data: Embedding, out: list[Effect]) -> None:
        """``data`` (read from the room's blocks) replaces them in host memory."""
        self.moving = False
        if self.src_blocks is None:
            return
        out.append(FreeBlocks(self.src_blocks))
        self.src_blocks = None
        if not self.live:  # ended while it was copied out: _end left its blocks to this copy
            return
        self.staged = data
        out.append(StagingCharge(embedding_nbytes(data)))
        if self.inited and self.phase != P.SUSPENDED:  # asked for: back into blocks as soon as it can
            self._want_blocks(out)

    def _want_blocks(self, out: list[Effect]) -> None:
        if self.staged is not None:
            out.append(WantBlocks())

    def _check_timeout(self, world: World, out: list[Effect]) -> None:
        t = self.timeouts
        if self.phase == P.SUSPENDED:
            if world.now - self.suspended_at > t.max_sleep:
                self._fail(FailureKind.TIMEOUT, f"language peer slept longer than {t.max_sleep:g}s", True, world, out)
        elif world.now < self.deadline:
            return
        elif self.phase == P.AWAITING_RESUME:
            self._fail(FailureKind.TIMEOUT, f"no resume within {t.resume:g}s", True, world, out)
        elif self.phase in (P.BOOTSTRAPPING, P.AWAITING_DATA):
            what = "init" if self.phase == P.BOOTSTRAPPING else "encoded data"
            self._fail(FailureKind.TIMEOUT, f"bootstrap, no {what} within {t.bootstrap:g}s", True, world, out)

    def _end(self, out: list[Effect]) -> None:
        """The room ended and no write of it is in flight: free its blocks, send what waited."""
        if self.src_blocks is not None and not self.moving:  # a move in progress frees them when it ends
            out.append(FreeBlocks(self.src_blocks))
            self.src_blocks = None
        out += self.held_failures  # before any ack, as _settle does
        self.held_failures = []
        out += [SendAck(a.endpoint, a.dst_port, AbortAckMsg(self.room, a.generation)) for a in self.pending_acks]
        self.pending_acks = []
        self._send_suspend_acks(out)
        out.append(Ended())

    def _send_suspend_acks(self, out: list[Effect]) -> None:
        out += [SendAck(s.endpoint, s.dst_port, SuspendAckMsg(self.room, s.generation))
                for s in self.pending_suspend_acks]
        self.pending_suspend_acks = []
