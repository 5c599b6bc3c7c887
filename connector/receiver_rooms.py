"""Language-side rooms as pure state machines: phases, the one transition table, events, effects.

**Where a room's phase changes:** only in :meth:`ReceiverRoom.on` (through ``_move`` and
:func:`connector.transitions.checked_move`, against ``TRANSITIONS`` below), restore from a
checkpoint included (the :class:`Restore` event). **Where its blocks leave it:** only through the
:class:`FreeBlocks` and :class:`CopyOut` effects ``on`` returns; :mod:`connector.receiver` (the
``EmbeddingReceiver`` handle and its manager) applies them: it gives ``FreeBlocks`` back to the
allocator at once, and ``CopyOut`` once their rows are copied (or, for a zero-copy assembly, when
the embedding is released).

A :class:`ReceiverRoom` holds the phase, the progress the wire sees (``RoomState``), the rounds'
block ids and the numbers the protocol needs, and nothing else: no manager, lock, pool, allocator,
socket or clock. What it needs to know of the world comes in a :class:`World` (the manager's
clock, when the room's encoder was seen asleep, the limits in force). Its
``on(event, world) -> effects`` decides; the handle applies the effects (sends frames, frees and
copies blocks, counts, wakes waiters).

Block ownership: blocks passed in with :class:`Init` or :class:`Resumed` belong to the room from
then on. They leave it when the embedding is assembled or checkpointed (or spilled to host
memory), or when the room failed and no peer can still write into them: a ``Failed`` status from
the encoder (it sends one only with nothing in flight), its ``ABORT_ACK``, a peer whose process is
gone (connection refused), a message that could not be sent, the pool deregistered and set aside
(sleep), or, ``unacked_block_hold`` after the ack wait, regardless: until then an encoder cut off
by a partition may still have a write queued in Mooncake that lands when the link returns.

An encoder built from the reference fork (``extended`` False: its bootstrap sends no incarnation
header) gets no message of ours beyond register, init and resume: no abort, no suspend. It cannot
be told to stop, but it writes a round only when asked and reports every round with a status, so
an aborted room's blocks wait for the status of the round it owes (or ``fork_abort_hold``), and a
suspend waits for that status in place of the ack.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from connector.failures import FailureKind, parse_wire_reason
from connector.poll import KVPoll, RoomState
from connector.transitions import checked_move


class ReceiverPhase(enum.Enum):
    CREATED = "created"  # the encoder's route is known; no blocks yet
    WAITING = "waiting"  # a round was asked for (init or resume): waiting for its status
    EARLY = "early"  # the total is known while round one is written: the rest may be asked for now
    PARTIAL = "partial"  # a round landed (Transferring): allocate for the rest and resume
    LANDED = "landed"  # Success: the blocks hold the whole embedding until it is assembled
    SUSPENDING = "suspending"  # sleep: suspend sent, nothing new asked for until its ack
    SUSPENDED = "suspended"  # acked: nothing of the room is or will be in flight; checkpoint it
    RESTORED = "restored"  # after a wake: continue with a resume from what landed
    ABORTING = "aborting"  # failed; the blocks wait until no peer can write into them
    CLOSED = "closed"  # blocks given back


R = ReceiverPhase
TRANSITIONS: dict[ReceiverPhase, frozenset[ReceiverPhase]] = {
    R.CREATED: frozenset({R.WAITING, R.RESTORED, R.CLOSED}),  # RESTORED: made from a checkpoint (Restore)
    R.WAITING: frozenset({R.EARLY, R.PARTIAL, R.LANDED, R.SUSPENDING, R.ABORTING, R.CLOSED}),
    R.EARLY: frozenset({R.WAITING, R.PARTIAL, R.SUSPENDING, R.ABORTING, R.CLOSED}),
    R.PARTIAL: frozenset({R.WAITING, R.SUSPENDING, R.ABORTING, R.CLOSED}),
    R.LANDED: frozenset({R.CLOSED}),
    R.SUSPENDING: frozenset({R.SUSPENDED, R.LANDED, R.ABORTING, R.CLOSED}),
    R.SUSPENDED: frozenset({R.CLOSED}),
    R.RESTORED: frozenset({R.WAITING, R.SUSPENDED, R.CLOSED}),
    R.ABORTING: frozenset({R.CLOSED}),
    R.CLOSED: frozenset(),
}
# Phases in which the encoder may be writing into the room's blocks.
MAYBE_IN_FLIGHT = frozenset({R.WAITING, R.EARLY, R.PARTIAL, R.SUSPENDING})
# The same for a fork encoder, which writes only the round asked for and reports it.
FORK_OWES_A_ROUND = frozenset({R.WAITING, R.SUSPENDING})
RESUMABLE = frozenset({R.PARTIAL, R.EARLY, R.RESTORED})


@dataclass(frozen=True)
class Round:
    start: int  # first token this round's blocks hold
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class World:
    """What a room's decision depends on outside the room, read by the handle as it calls ``on``."""

    now: float  # the manager's clock
    asleep_since: float | None  # when the room's encoder was seen asleep (None: awake)
    abort_ack_timeout: float  # how long an aborted room waits for the ABORT_ACK ...
    seconds_per_block: float  # ... plus this per block it holds: an encoder's write on a slow link ends later
    unacked_block_hold: float  # then its blocks stay out of use this much longer, unless the ack comes
    fork_abort_hold: float  # ... or, with a fork encoder, for the status of the round it owes
    max_sleep: float  # how long a room waits for its encoder to wake
    waiting_timeout: float  # how long a room asked for a round may go without progress
    join_timeout: float  # how long an init waits for our encoder to say the room is real


# ---- events: what happened to the room (when: the World's ``now``) ------------------------------

@dataclass(frozen=True)
class Init:
    """The language side asks for the first round with these blocks."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Resumed:
    """The handle allocated these blocks for the next round (the room was resumable)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Spill:
    """No block is free: give the landed rounds to host memory (ignored while one is written)."""


@dataclass(frozen=True)
class Clone:
    """The reference strategy (``clone_concat``): copy the landed rounds out before a resume."""


@dataclass(frozen=True)
class StatusIn:
    """A status from the encoder. ``aux``: the first block's aux row, read while the room has none."""

    status: KVPoll
    sent_tokens: int | None
    total_tokens: int | None
    reason: str
    aux: np.ndarray | None
    monotonic: float  # time.monotonic() as it came (for ``sending_at``)


@dataclass(frozen=True)
class AbortAck:
    ours: bool  # for an ABORT of this worker's generation


@dataclass(frozen=True)
class SuspendAck:
    ours: bool


@dataclass(frozen=True)
class Abort:
    kind: FailureKind
    reason: str


@dataclass(frozen=True)
class Suspend:
    """Sleep: ask the encoder to write nothing more for this room."""


@dataclass(frozen=True)
class SendFailed:
    """A message of ours could not be sent: the encoder cannot take messages (nor write)."""


@dataclass(frozen=True)
class PeerGone:
    """A probe found no process at the peer: nothing can write into our blocks any more."""


@dataclass(frozen=True)
class PoolReleased:
    """The pool was deregistered (sleep) and its memory set aside: a late write lands where nobody reads."""


@dataclass(frozen=True)
class PeerDead:
    """The peer was declared dead; ``gone``: its process is gone (else it only stopped answering)."""

    why: str
    gone: bool


@dataclass(frozen=True)
class PeerWoke:
    """The peer answered awake after a sleep: the waiting timeout starts again."""


@dataclass(frozen=True)
class Rebound:
    """The encoder restarted at a new rank: ask it again for the round it owes."""

    extended: bool
    peer_name: str


@dataclass(frozen=True)
class Tick:
    """The manager's periodic check: fail a wait that ran out."""


@dataclass(frozen=True)
class Assemble:
    """Hand the landed embedding out (once)."""


@dataclass(frozen=True)
class Checkpoint:
    """Sleep: keep what landed in host memory and give every block back."""


@dataclass(frozen=True)
class Restore:
    """Made from a checkpoint (in CREATED): continue with a resume from ``landed``."""

    total_tokens: int | None
    aux: np.ndarray | None
    resume_rounds: int
    landed: int


Event = (Init | Resumed | Spill | Clone | StatusIn | AbortAck | SuspendAck | Abort | Suspend | SendFailed | PeerGone
         | PoolReleased | PeerDead | PeerWoke | Rebound | Tick | Assemble | Checkpoint | Restore)


# ---- effects (what the handle must do, in order) ------------------------------------------------

@dataclass(frozen=True)
class SendRound:
    """Send the 7-frame init (``start`` None) or the 8-frame resume of one round."""

    block_ids: tuple[int, ...]
    start: int | None
    register: bool = False  # register first even when registered (an init mends a replaced one)


@dataclass(frozen=True)
class SendAbort:
    pass


@dataclass(frozen=True)
class SendSuspend:
    pass


@dataclass(frozen=True)
class FreeBlocks:
    """Give these blocks back to the allocator now: no peer writes into them any more."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class CopyOut:
    """These rounds leave the room: copy their tokens below ``upto`` out of the pool (``into``:
    "spill" and "checkpoint" into the room's host-memory target, "clone" into a new copy,
    "assemble" into the result, a zero-copy view when it can), then free their blocks."""

    rounds: tuple[Round, ...]
    upto: int
    into: str


@dataclass(frozen=True)
class Notify:
    """The room's status or phase changed: wake waiters."""


@dataclass(frozen=True)
class NoteFailure:
    """Count the failed room against its encoder (once; for /health)."""

    kind: FailureKind
    reason: str
    joined: bool  # the encoder spoke of the room (a status, a total): it took part in it


@dataclass(frozen=True)
class NoteSuccess:
    pass


@dataclass(frozen=True)
class Count:
    stat: str
    n: int = 1


@dataclass(frozen=True)
class Forget:
    """The room closed: drop it from the manager's table."""


@dataclass(frozen=True)
class Warn:
    text: str


# Calls a closed room still answers: an init frees its blocks, the others raise (a bug of the caller).
_ANSWERED_WHEN_CLOSED = (Init, Resumed, Assemble, Checkpoint, Restore)

Effect = (SendRound | SendAbort | SendSuspend | FreeBlocks | CopyOut | Notify | NoteFailure | NoteSuccess | Count
          | Forget | Warn)


@dataclass
class ReceiverRoom:
    """One request's receiving end as data: change it only through :meth:`on`."""

    room: int
    block_size: int
    extended: bool  # the encoder speaks our extensions (else it is the reference fork)
    peer_name: str  # names the encoder in failure reasons
    last_progress: float  # the manager's clock when the waiting timeout last started
    clone_concat: bool = False  # the reference fork's strategy (benchmarks only): never resume early
    phase: ReceiverPhase = ReceiverPhase.CREATED
    state: RoomState = field(default_factory=RoomState)
    total_tokens: int | None = None
    resume_rounds: int = 0
    # when the encoder had the embedding (it announced the total, or a fork's first round
    # landed; time.monotonic()): before it, the room waits for the encoder; after it, the wire works
    sending_at: float | None = None
    rounds: list[Round] = field(default_factory=list)  # rounds whose blocks the room still holds
    round_end: int = 0  # tokens that have landed once the current round succeeds
    spilled: int = 0  # tokens [0, spilled) already copied to host memory
    aux: np.ndarray | None = None
    aborted_at: float = 0.0
    unacked: bool = False  # aborting past its ack wait: its blocks are kept out of use, not waited for
    failure_noted: bool = False
    heard: bool = False  # a status of the encoder's for this room came (ours says so when the room is real)

    # ---- queries (change nothing) ------------------------------------------------------------

    @property
    def resumable(self) -> bool:
        return self.phase in RESUMABLE

    def blocks_needed(self, default_blocks: int) -> int:
        """How many blocks the next round wants (all the rest, or the default before a total)."""
        if self.total_tokens is None:  # restored before anything landed: start over from 0
            return default_blocks
        return -(-(self.total_tokens - self.round_end) // self.block_size)

    def used_blocks(self, rounds: tuple[Round, ...]) -> list[int]:
        """The blocks of ``rounds`` that hold tokens of the embedding."""
        assert self.total_tokens is not None
        bs = self.block_size
        return [b for rnd in rounds for b in rnd.block_ids[: max(0, -(-(self.total_tokens - rnd.start) // bs))]]

    # ---- the one place a phase changes -------------------------------------------------------

    def on(self, event: Event, world: World) -> list[Effect]:
        """Apply ``event``; the effects the handle must apply, in order."""
        out: list[Effect] = []
        if self.phase == R.CLOSED and not isinstance(event, _ANSWERED_WHEN_CLOSED):
            return out  # a closed room sends, frees and counts nothing more
        match event:
            case Init():
                self._on_init(event, out)
            case Resumed():
                self._on_resumed(event, world, out)
            case Spill():
                self._on_spill(event, out)
            case Clone():
                self._on_clone(event, out)
            case Abort():
                self._on_abort(event, world, out)
            case Suspend():
                self._on_suspend(event, out)
            case Assemble():
                self._on_assemble(event, out)
            case Checkpoint():
                self._on_checkpoint(event, out)
            case Restore():
                self._on_restore(event, out)
            case StatusIn():
                self._on_status_in(event, world, out)
            case SuspendAck():
                self._on_suspend_ack(event, world, out)
            case AbortAck():
                self._on_abort_ack(event, out)
            case SendFailed():
                self._on_send_failed(event, out)
            case PeerGone() | PoolReleased():
                self._on_nothing_can_land(out)
            case PeerDead():
                self._on_peer_dead(event, world, out)
            case PeerWoke():
                self._on_peer_woke(event, world, out)
            case Rebound():
                self._on_rebound(event, world, out)
            case Tick():
                self._on_tick(event, world, out)
            case _:
                raise TypeError(f"room {self.room}: unknown event {event!r}")
        return out

    def _move(self, phase: ReceiverPhase) -> None:
        self.phase = checked_move(TRANSITIONS, self.phase, phase, f"room {self.room}")

    # ---- language side -----------------------------------------------------------------------

    def _on_init(self, ev: Init, out: list[Effect]) -> None:
        if self.phase == R.CLOSED:  # e.g. its peer was declared dead meanwhile
            out.append(FreeBlocks(tuple(ev.block_ids)))
            return
        if self.phase != R.CREATED or not ev.block_ids:
            raise ValueError(f"room {self.room}: init needs blocks and may be called once")
        self.rounds.append(Round(0, tuple(ev.block_ids)))
        self.round_end = len(ev.block_ids) * self.block_size
        self.state.advance(KVPoll.WaitingForInput)
        self._move(R.WAITING)
        out.append(SendRound(tuple(ev.block_ids), None, register=True))

    def _on_resumed(self, ev: Resumed, world: World, out: list[Effect]) -> None:
        if not self.resumable or not ev.block_ids:
            raise ValueError(f"room {self.room}: no resume in phase {self.phase.name}")
        early = self.phase == R.EARLY
        start = self.round_end
        self.rounds.append(Round(start, tuple(ev.block_ids)))
        self.round_end = start + len(ev.block_ids) * self.block_size
        if early:  # progress stays where it is until the current round lands
            out.append(Count("early_resumes"))
        else:
            self.state.advance(KVPoll.WaitingForInput, start)
        self.resume_rounds += 1
        self.last_progress = world.now
        self._move(R.WAITING)
        out.append(SendRound(tuple(ev.block_ids), start))

    def _on_spill(self, ev: Spill, out: list[Effect]) -> None:
        # never spill a round still being written
        if self.phase not in (R.PARTIAL, R.RESTORED) or not self.rounds:
            return
        assert self.total_tokens is not None
        out.append(CopyOut(self._take_rounds(), self.total_tokens, "spill"))
        out.append(Count("spilled_tokens", self.round_end - self.spilled))
        self.spilled = self.round_end

    def _on_clone(self, ev: Clone, out: list[Effect]) -> None:
        if self.phase not in (R.PARTIAL, R.RESTORED) or not self.rounds:
            return
        assert self.total_tokens is not None
        out.append(CopyOut(self._take_rounds(), min(self.round_end, self.total_tokens), "clone"))

    def _on_abort(self, ev: Abort, world: World, out: list[Effect]) -> None:
        """Fail at once and tell the encoder. Blocks the encoder may still be writing come back
        with its ack (or when it is found gone, or ``unacked_block_hold`` past the ack timeout);
        others at once."""
        if self.phase in (R.CLOSED, R.ABORTING) or not self.state.fail(ev.kind, ev.reason):
            return
        self._note_failure(out)
        if self.phase in (MAYBE_IN_FLIGHT if self.extended else FORK_OWES_A_ROUND):
            self._move(R.ABORTING)
            self.aborted_at = world.now
            out.append(Notify())
        else:
            self._close(out)
        if self.extended:
            out.append(SendAbort())

    def _on_suspend(self, ev: Suspend, out: list[Effect]) -> None:
        """Ask the encoder to write nothing more (sleep); its ack ends SUSPENDING. A fork encoder
        is not asked: the status of the round it owes ends SUSPENDING."""
        if self.phase == R.RESTORED:  # the encoder still holds it suspended: nothing to ask
            self._move(R.SUSPENDED)
            return
        if self.phase not in (R.WAITING, R.EARLY, R.PARTIAL):
            return
        owes_a_round = self.phase == R.WAITING
        self._move(R.SUSPENDING)
        if not self.extended:
            if not owes_a_round:
                self._move(R.SUSPENDED)
                out.append(Notify())
            return
        out.append(SendSuspend())

    def _on_assemble(self, ev: Assemble, out: list[Effect]) -> None:
        if self.phase != R.LANDED:
            if self.state.status == KVPoll.Failed:  # cancelled or failed after its Success was read
                raise self.state.failure(self.room)
            raise RuntimeError(f"room {self.room}: cannot assemble in phase {self.phase.name}")
        assert self.total_tokens is not None and self.aux is not None
        out.append(CopyOut(self._take_rounds(), min(self.round_end, self.total_tokens), "assemble"))
        self._close(out)

    def _on_checkpoint(self, ev: Checkpoint, out: list[Effect]) -> None:
        if self.phase != R.SUSPENDED:
            raise RuntimeError(f"room {self.room}: cannot checkpoint in phase {self.phase.name}")
        if self.state.status == KVPoll.Transferring:
            assert self.total_tokens is not None
            landed = min(self.round_end, self.total_tokens)
        else:  # a round asked for but never written, or restored and not resumed yet
            landed = max(self.state.progress.sent_tokens, self.spilled)
        out.append(CopyOut(self._take_rounds(), landed, "checkpoint"))
        self._close(out)

    def _on_restore(self, ev: Restore, out: list[Effect]) -> None:
        if self.phase != R.CREATED:
            raise ValueError(f"room {self.room}: only a new room is restored")
        self.total_tokens, self.aux, self.resume_rounds = ev.total_tokens, ev.aux, ev.resume_rounds
        self.spilled = self.round_end = ev.landed
        self._move(R.RESTORED)

    # ---- the encoder and the peer watch ------------------------------------------------------

    def _on_status_in(self, ev: StatusIn, world: World, out: list[Effect]) -> None:
        self.heard = True
        if ev.status == KVPoll.Failed:  # the encoder stopped writing: the blocks are safe to free
            if self.state.status != KVPoll.Failed:
                kind, text = parse_wire_reason(ev.reason)
                self.state.fail(kind, f"{self.peer_name} failed the room: {text}", by_peer=True)
            self._close(out)
            return
        if self.phase == R.ABORTING and not self.extended:  # the fork's last write landed
            out.append(Count("fork_abort_settled"))
            self._close(out)
            return
        if self.phase not in (R.WAITING, R.EARLY, R.SUSPENDING):
            return  # aborting, or a status that is late for its round
        if ev.total_tokens is not None:
            self._on_total(ev.total_tokens, ev.monotonic, out)
            return
        if ev.status not in (KVPoll.Transferring, KVPoll.Success):
            return
        if ev.sent_tokens is not None and ev.sent_tokens > self.round_end:
            self._fail_bad(f"status says {ev.sent_tokens} tokens sent, only {self.round_end} allocated", world, out)
            return
        self.sending_at = self.sending_at or ev.monotonic
        if self.aux is None:  # the first round carried aux: read the total from it
            assert ev.aux is not None, "a status of the first round comes with its aux row"
            self.aux = ev.aux
            total = int(self.aux[0])
            if total <= 0 or self.total_tokens not in (None, total):
                self._fail_bad(f"aux reports {total} total tokens (announced: {self.total_tokens})", world, out)
                return
            self.total_tokens = total
        assert self.total_tokens is not None
        landed = ev.sent_tokens if ev.sent_tokens is not None else min(self.round_end, self.total_tokens)
        if ev.status == KVPoll.Success:
            if landed != self.total_tokens:
                self._fail_bad(f"Success after {landed} of {self.total_tokens} tokens", world, out)
                return
            self.state.advance(KVPoll.Success, landed)
            self._move(R.LANDED)
            out.append(NoteSuccess())
        else:
            if landed >= self.total_tokens:
                self._fail_bad(f"Transferring although all {self.total_tokens} tokens were allocated", world, out)
                return
            if self.round_end > landed:  # the next round was asked for early and is under way
                self.state.advance(KVPoll.WaitingForInput, landed)
            else:
                self.state.advance(KVPoll.Transferring, self.state.progress.sent_tokens)
                if self.phase != R.SUSPENDING:
                    self._move(R.PARTIAL)
                elif not self.extended:  # the fork's round landed: nothing is in flight
                    self._move(R.SUSPENDED)
        self.last_progress = world.now
        out.append(Notify())

    def _on_total(self, total: int, monotonic: float, out: list[Effect]) -> None:
        """The encoder announced the total as the first round started: allow an early resume."""
        if self.total_tokens is not None:
            return
        self.total_tokens = total
        self.sending_at = self.sending_at or monotonic
        if (self.phase == R.WAITING and len(self.rounds) == 1 and self.round_end < total
                and not self.clone_concat):
            self._move(R.EARLY)
        out.append(Notify())

    def _on_suspend_ack(self, ev: SuspendAck, world: World, out: list[Effect]) -> None:
        if ev.ours and self.phase == R.SUSPENDING:
            self._move(R.SUSPENDED)
            out.append(Notify())
        elif self.phase in MAYBE_IN_FLIGHT:
            # Suspended there on a SUSPEND we never sent: it would write nothing more until
            # we resumed it, which we would not know to do. Give it up (the abort ends it there).
            out.append(Count("foreign_suspend"))
            self._on_abort(Abort(FailureKind.ABORTED, f"{self.peer_name} suspended the room on a SUSPEND "
                                                      "this worker did not send"), world, out)
        else:
            out.append(Count("stale_message"))

    def _on_abort_ack(self, ev: AbortAck, out: list[Effect]) -> None:
        if ev.ours and self.phase == R.ABORTING:
            out.append(Count("abort_acked"))
            self._close(out)
        elif self.phase in MAYBE_IN_FLIGHT:
            # The encoder gave the room up on an ABORT we never sent (a stranger named our
            # endpoint): it is gone there, and an ack comes only with nothing in flight.
            out.append(Count("foreign_abort"))
            self.state.fail(FailureKind.ABORTED, f"{self.peer_name} ended the room on an ABORT "
                                                 "this worker did not send")
            self._close(out)
        else:
            out.append(Count("stale_message"))

    def _on_send_failed(self, ev: SendFailed, out: list[Effect]) -> None:
        # the encoder never got it; an aborting room still waits for its ack
        if self.phase not in (R.CLOSED, R.ABORTING):
            self.state.fail(FailureKind.PEER_UNREACHABLE, f"cannot reach {self.peer_name}")
            self._close(out)

    def _on_nothing_can_land(self, out: list[Effect]) -> None:
        if self.phase == R.ABORTING:
            self._close(out)

    def _on_peer_dead(self, ev: PeerDead, world: World, out: list[Effect]) -> None:
        """A peer whose process is gone writes nothing more: the blocks come back at once. One that
        only stopped answering may still write when it comes back: abort, the blocks wait."""
        reason = f"{self.peer_name} is dead: {ev.why}"
        if self.phase in MAYBE_IN_FLIGHT and not ev.gone:
            self._on_abort(Abort(FailureKind.PEER_DEAD, reason), world, out)
        elif self.phase not in (R.LANDED, R.CLOSED) and (ev.gone or self.phase != R.ABORTING):
            self.state.fail(FailureKind.PEER_DEAD, reason)
            self._close(out)

    def _on_peer_woke(self, ev: PeerWoke, world: World, out: list[Effect]) -> None:
        self.last_progress = world.now

    def _on_rebound(self, ev: Rebound, world: World, out: list[Effect]) -> None:
        """Ask the restarted encoder again for the round it owes this room. A round that starts
        at token 0 is asked for with an init, a later one with a resume; a restarted encoder
        restores exactly those two kinds of room from its checkpoint."""
        self.extended, self.peer_name, self.last_progress = ev.extended, ev.peer_name, world.now
        if self.phase != R.WAITING:
            return  # nothing requested: the next resume goes to the new rank
        start = self.state.progress.sent_tokens
        pending = next((rnd for rnd in self.rounds if rnd.start == start), None)
        if pending is not None:
            out.append(SendRound(pending.block_ids, start or None))

    def _on_tick(self, ev: Tick, world: World, out: list[Effect]) -> None:
        if self.phase == R.ABORTING:
            self._check_abort_hold(world, out)
        elif world.asleep_since is not None:
            if world.now - world.asleep_since > world.max_sleep:
                self._on_abort(Abort(FailureKind.TIMEOUT, f"{self.peer_name} slept longer than {world.max_sleep:g}s"),
                               world, out)
        elif (self.phase == R.WAITING and self.extended and not self.heard and self.total_tokens is None
              and world.now - self.last_progress > world.join_timeout):  # (a total came: restored after a restart)
            self._on_abort(Abort(FailureKind.TIMEOUT, f"{self.peer_name} has no encode request for room {self.room} "
                                                      f"(none within {world.join_timeout:g}s)"), world, out)
        elif self.phase in (R.WAITING, R.EARLY) and world.now - self.last_progress > world.waiting_timeout:
            self._on_abort(Abort(FailureKind.TIMEOUT, f"no data from {self.peer_name} within "
                                                      f"{world.waiting_timeout:g}s"), world, out)

    def _check_abort_hold(self, world: World, out: list[Effect]) -> None:
        """An aborted room waits for its encoder's ack (a fork's status) to free its blocks. Past
        the ack wait our encoder counts as dead for the room, but the blocks stay out of use up to
        ``unacked_block_hold`` longer: one cut off by a partition may still have a write queued in
        Mooncake that lands once the link returns, and it acks only after that write settled."""
        waited = world.now - self.aborted_at
        if not self.extended:
            if waited > world.fork_abort_hold:
                out.append(Warn(f"room {self.room}: no status from {self.peer_name} within "
                                f"{world.fork_abort_hold:g}s; its blocks are freed"))
                self._close(out)
            return
        ack_wait = world.abort_ack_timeout + sum(len(rnd.block_ids) for rnd in self.rounds) * world.seconds_per_block
        if waited > ack_wait + world.unacked_block_hold:
            out.append(Warn(f"room {self.room}: no ABORT_ACK from {self.peer_name} within "
                            f"{ack_wait + world.unacked_block_hold:g}s; its blocks are freed"))
            self._close(out)
        elif waited > ack_wait and not self.unacked:
            self.unacked = True
            out += [Count("abort_unacked"),
                    Warn(f"room {self.room}: no ABORT_ACK from {self.peer_name} within {ack_wait:g}s; its blocks "
                         f"stay out of use until it acknowledges or is found gone, at most "
                         f"{world.unacked_block_hold:g}s more")]

    # ---- helpers -----------------------------------------------------------------------------

    def _fail_bad(self, what: str, world: World, out: list[Effect]) -> None:
        out.append(Count("bad_status"))
        self._on_abort(Abort(FailureKind.PROTOCOL, f"{self.peer_name} sent an inconsistent status: {what}"), world, out)

    def _note_failure(self, out: list[Effect]) -> None:
        """Count a failed room against its encoder once, as soon as it failed (for /health)."""
        if self.state.status == KVPoll.Failed and not self.failure_noted:
            self.failure_noted = True
            assert self.state.kind is not None
            out.append(NoteFailure(self.state.kind, self.state.reason, self.heard))

    def _take_rounds(self) -> tuple[Round, ...]:
        rounds, self.rounds = tuple(self.rounds), []
        return rounds

    def _close(self, out: list[Effect]) -> None:
        """Give back every block still held and forget the room."""
        self._note_failure(out)
        if self.rounds:
            out.append(FreeBlocks(tuple(b for rnd in self._take_rounds() for b in rnd.block_ids)))
        self._move(R.CLOSED)
        out.append(Forget())
        out.append(Notify())
