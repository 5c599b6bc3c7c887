"""Encode-side rooms: their phases, every allowed transition (one table), and round planning.

A room's phase says what it waits for; where its embedding is (host memory, pool blocks or
nowhere yet) is kept beside it, because data may move between the two in several phases (the
placer puts it into blocks, a sleep or an eviction takes it out).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from connector.buffers import Embedding
from connector.messages import AbortMsg, SuspendMsg
from connector.poll import RoomState
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


@dataclass
class Write:
    """One round being written: tokens ``[start, end)`` into each destination's blocks as they
    were when the round started (an early resume may already have replaced them)."""

    start: int
    end: int
    dsts: list[Destination]
    done: bool = False


@dataclass
class SenderRoom:
    room: int
    phase: SenderPhase = SenderPhase.BOOTSTRAPPING
    state: RoomState = field(default_factory=RoomState)
    claimed: bool = False  # an encode request owns it: a second one for the room is refused
    required_dsts: int = 0  # 0 until the first init arrives
    dsts: list[Destination] = field(default_factory=list)
    total_tokens: int = 0
    staged: Embedding | None = None  # the embedding in host memory (never also in blocks)
    src_blocks: list[int] | None = None  # the embedding in pool blocks
    moving: bool = False  # the placer is copying the data between host memory and blocks
    writes: list[Write] = field(default_factory=list)  # in token order; at most two
    round_end: int = 0  # sent_tokens once the rounds being written land
    pending_acks: list[AbortMsg] = field(default_factory=list)
    pending_suspend_acks: list[SuspendMsg] = field(default_factory=list)
    # Failed statuses held back while a write is in flight: a peer frees its blocks on Failed,
    # so it must not see one before the last byte has landed.
    held_failures: list[tuple[str, int, list[bytes]]] = field(default_factory=list)  # (host, port, frames)
    deadline: float = 0.0  # of the bootstrap or resume wait
    suspended_at: float = 0.0
    first_write_at: float | None = None  # time.monotonic() as the first round's write began
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)  # the manager's
    delivered: Future = field(default_factory=Future)  # None once every destination has it all

    def move(self, phase: SenderPhase) -> None:
        self.phase = checked_move(TRANSITIONS, self.phase, phase, f"room {self.room}")
        if phase == P.SUSPENDED:
            self.suspended_at = self.clock()

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

    def next_round(self) -> Write | None:
        """The round to write next, or None when there is nothing to start now.

        A destination is ready again while a round is still being written only after an early
        resume; that next round is then written beside it, so no gap separates the two.
        """
        if self.phase not in (P.READY, P.WRITING) or len(self.writes) > 1:
            return None
        if not self.dsts or not all(d.ready for d in self.dsts):
            return None
        start = self.round_end if self.writes else self.state.progress.sent_tokens
        if start >= self.total_tokens:
            return None
        # Every destination gets the same round: the smallest allocation among them.
        self.round_end = start + min(self.total_tokens - start, min(d.allocated_tokens for d in self.dsts))
        for d in self.dsts:
            d.ready = False
        return Write(start, self.round_end, [dataclasses.replace(d) for d in self.dsts])
