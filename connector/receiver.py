"""Language side of the connector: init, poll, resume rounds, assemble once, abort.

One :class:`EmbeddingReceiverManager` per language worker owns the destination pool, its
allocator, the transport, the PULL socket for statuses, acks and pings, and the watch over its
encode peers (:mod:`connector.encoder_peers`). Each request gets an
:class:`EmbeddingReceiver` (SGLang's ``BaseKVReceiver`` shape), whose phase says what it waits
for; every allowed phase change is in ``TRANSITIONS``.

Block ownership: blocks passed to ``init``/``resume`` belong to the receiver from then on.
They come back to the allocator when the embedding is assembled or checkpointed, or when the
room failed and no peer can still write into them: a ``Failed`` status from the encoder (it
sends one only with nothing in flight), its ``ABORT_ACK``, a peer whose process is gone
(connection refused), or the ack timeout.

An encoder built from the reference fork (its bootstrap sends no incarnation header) gets no
message of ours beyond register, init and resume: no abort, no suspend. It cannot be told to
stop, but it writes a round only when asked and reports every round with a status, so an
aborted room's blocks wait for the status of the round it owes (or ``fork_abort_hold``), and
a suspend waits for that status in place of the ack.

Locks, in this order only: the manager's ``_lock`` (every room's phase and the rooms table),
then the allocator's and a room state's own (leaves: they call nothing back). No copy of an
embedding's rows runs under the manager's lock except a sleep's checkpoint and a spill (both
rare, and both must see a room that cannot change meanwhile).
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import zmq

from connector.allocator import BlockAllocator
from connector.bootstrap import RankRoute
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.encoder_peers import EncoderPeers, Probe
from connector.failures import FailureKind, parse_wire_reason
from connector.messages import (
    AbortAckMsg,
    AbortMsg,
    InitMsg,
    PingMsg,
    PongMsg,
    ProtocolError,
    RegisterMsg,
    ResumeMsg,
    StatusMsg,
    SuspendAckMsg,
    SuspendMsg,
    decode_language_bound,
)
from connector.peer_health import FailingPeers
from connector.poll import KVPoll, RoomState
from connector.rejections import Rejections
from connector.transitions import checked_move
from connector.transport import Transport
from connector.zmq_link import PullLoop, PushSockets

log = logging.getLogger(__name__)


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
    R.CREATED: frozenset({R.WAITING, R.RESTORED, R.CLOSED}),  # RESTORED: made from a checkpoint (restore)
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
_MAYBE_IN_FLIGHT = frozenset({R.WAITING, R.EARLY, R.PARTIAL, R.SUSPENDING})
# The same for a fork encoder, which writes only the round asked for and reports it.
_FORK_OWES_A_ROUND = frozenset({R.WAITING, R.SUSPENDING})


@dataclass
class ReceiverCheckpoint:
    """A room put aside for sleep: what landed so far, and where it came from."""

    room: int
    bootstrap_addr: str
    route: RankRoute
    landed: int  # tokens [0, landed) are valid in ``data``
    total_tokens: int | None  # None until the first round landed
    aux: np.ndarray | None
    resume_rounds: int
    data: Embedding | None  # ``total_tokens`` rows, the first ``landed`` filled


@dataclass
class _Round:
    start: int  # first token this round's blocks hold
    block_ids: list[int]


def _copy_rounds(pool: BufferPool, rounds: list[_Round], out: Embedding, block_size: int, end: int) -> None:
    """Copy tokens ``[0, end)`` of ``rounds`` from ``pool`` into ``out``."""
    for rnd in rounds:
        n = min(len(rnd.block_ids) * block_size, end - rnd.start)
        if n > 0:
            pool.read_into(rnd.block_ids[: -(-n // block_size)], out, rnd.start, n)


class EmbeddingReceiver:
    """One request's receiving end. Thread-safe; status updates arrive on the manager's thread."""

    def __init__(self, manager: EmbeddingReceiverManager, bootstrap_addr: str, room: int, route: RankRoute) -> None:
        self._m, self.bootstrap_addr, self.room, self.route = manager, bootstrap_addr, room, route
        self.phase = ReceiverPhase.CREATED
        self.state = RoomState()
        self._changed = threading.Condition(manager._lock)  # notified on every status change
        self.total_tokens: int | None = None
        self.resume_rounds = 0
        # when the encoder had the embedding (it announced the total, or a fork's first round
        # landed): before it, the room waits for the encoder; after it, the wire works
        self.sending_at: float | None = None
        self._rounds: list[_Round] = []  # rounds whose blocks are still in the pool
        self._round_end = 0  # tokens that have landed once the current round succeeds
        self._out: Embedding | None = None  # assembly target, created early only by a spill or a restore
        self._spilled = 0  # tokens [0, _spilled) already copied into _out
        self._aux = None
        self._aborted_at = 0.0
        self._failure_noted = False  # counted in the manager's FailingPeers
        # The reference fork's strategy, kept only to measure against (scripts/bench_resume.py):
        # copy every partial round out of the pool and concatenate all copies at the end.
        self.clone_concat = False
        self._clones: list[Embedding] = []
        self._last_progress = self._m.clock()
        self.peer_name = f"encode peer {bootstrap_addr} (rank {route.rank_ip}:{route.rank_port})"

    def _move(self, phase: ReceiverPhase) -> None:
        self.phase = checked_move(TRANSITIONS, self.phase, phase, f"room {self.room}")

    # ---- BaseKVReceiver-like API ----------------------------------------------------------

    def init(self, block_ids: list[int]) -> None:
        """Send the 7-frame init with the first allocation (``allocated = len * block_size``)."""
        m = self._m
        with m._lock:
            if self.phase == R.CLOSED:  # e.g. its peer was declared dead meanwhile
                m.allocator.free(block_ids)
                return
            if self.phase != R.CREATED or not block_ids:
                raise ValueError(f"room {self.room}: init needs blocks and may be called once")
            self._rounds.append(_Round(0, list(block_ids)))
            self._round_end = len(block_ids) * m.config.block_size
            self.state.advance(KVPoll.WaitingForInput)
            self._move(R.WAITING)
        m._send(self, self._round_frames(block_ids, None), register=True)

    def poll(self) -> KVPoll:
        return self.state.status

    def failure_exception(self) -> None:
        if self.state.status == KVPoll.Failed:
            raise self.state.failure(self.room)

    def remaining_tokens(self) -> int:
        assert self.total_tokens is not None
        return self.total_tokens - self._round_end

    def try_resume(self) -> bool:
        """After a partial round (or early, or after a wake): allocate for the rest (or as much as
        is free) and resume.

        When no block is free at all, this room's received blocks are spilled to host memory
        to make room, so a full pool can always make progress. Returns False when it must be
        retried later (nothing could be allocated).
        """
        with self._m._lock:
            if self.phase not in (R.PARTIAL, R.EARLY, R.RESTORED):
                return False
            early = self.phase == R.EARLY
            m, bs = self._m, self._m.config.block_size
            if self.total_tokens is None:  # restored before anything landed: start over from 0
                need = m.config.default_allocate_blocks
            else:
                need = -(-self.remaining_tokens() // bs)
            if self.clone_concat and self._rounds:
                self._clones.append(self._clone_rounds_locked())
            free = m.allocator.free_blocks
            if free == 0 and self._rounds and not early:  # never spill a round still being written
                self._spill_locked()
                free = m.allocator.free_blocks
            blocks = m.allocator.allocate(min(need, free)) if free else None
            if blocks is None:
                return False
            start = self._round_end
            self._rounds.append(_Round(start, blocks))
            self._round_end = start + len(blocks) * bs
            if early:  # progress stays where it is until the current round lands
                m.stats["early_resumes"] += 1
            else:
                self.state.advance(KVPoll.WaitingForInput, start)
            self.resume_rounds += 1
            self._last_progress = self._m.clock()
            self._move(R.WAITING)
        m._send(self, self._round_frames(blocks, start))
        return True

    def assemble(self) -> Embedding:
        """After ``Success``: the whole embedding, contiguous and in token order, assembled once.
        :class:`TransferFailure` when the room failed since (a cancel between the poll and here).

        When the received blocks are one run of consecutive ids (the usual case), the result
        is a zero-copy view into the pool and those blocks return on ``Embedding.release()``;
        otherwise every round is copied into a new array and the blocks return at once. That
        copy (75 MB for a 4K image) runs after the room is closed, outside the manager's lock:
        statuses of other rooms are not held up by it.
        """
        rounds: list[_Round] = []  # to copy once the lock is released
        with self._m._lock:
            if self.phase != R.LANDED:
                if self.state.status == KVPoll.Failed:  # cancelled or failed after its Success was read
                    raise self.state.failure(self.room)
                raise RuntimeError(f"room {self.room}: cannot assemble in phase {self.phase.name}")
            assert self.total_tokens is not None and self._aux is not None
            m, bs = self._m, self._m.config.block_size
            used = [b for rnd in self._rounds
                    for b in rnd.block_ids[: max(0, -(-(self.total_tokens - rnd.start) // bs))]]
            if self._clones:  # reference strategy: concatenate the copies of every round
                parts = self._clones + [self._clone_rounds_locked()]
                out = Embedding(np.concatenate([p.embeddings for p in parts]), np.concatenate([p.fill_ids for p in parts]),
                                np.concatenate([p.mrope_positions for p in parts], axis=1), parts[0].aux.copy(),
                                m.pool.hidden_size, m.pool.dtype)
            elif self._out is None and (out := m.pool.view(used, self.total_tokens)) is not None:
                held = set(used)
                m.allocator.free([b for rnd in self._rounds for b in rnd.block_ids if b not in held])
                out.release_fn = lambda: m.allocator.free(used)
                self._rounds = []
            else:  # the room closes with no round: its blocks are this call's until copied
                out = self._out or Embedding.empty(self.total_tokens, m.pool.hidden_size, m.pool.dtype)
                rounds, self._rounds, pool = self._rounds, [], m.pool
            out.aux[:] = self._aux
            self._close()
        if rounds:
            try:
                _copy_rounds(pool, rounds, out, bs, self.total_tokens)
            finally:
                m.allocator.free([b for rnd in rounds for b in rnd.block_ids])
        return out

    def abort(self, kind: FailureKind = FailureKind.CANCELLED, reason: str = "aborted by the language side") -> None:
        """Fail at once and tell the encoder. Blocks the encoder may still be writing come back
        with its ack (or when it is found gone, or after the ack timeout); others at once."""
        m = self._m
        with m._lock:
            if self.phase in (R.CLOSED, R.ABORTING) or not self.state.fail(kind, reason):
                return
            extended = self.route.extended
            self._note_failure()
            if self.phase in (_MAYBE_IN_FLIGHT if extended else _FORK_OWES_A_ROUND):
                self._move(R.ABORTING)
                self._aborted_at = self._m.clock()
                self._notify()
            else:
                self._close()
        if extended:
            m._send(self, AbortMsg(self.room, m.config.host, m.rank_port, m.generation).encode())

    def suspend(self) -> None:
        """Ask the encoder to write nothing more for this room (sleep); its ack ends SUSPENDING.
        A fork encoder is not asked: the status of the round it owes ends SUSPENDING."""
        with self._m._lock:
            if self.phase == R.RESTORED:  # the encoder still holds it suspended: nothing to ask
                self._move(R.SUSPENDED)
                return
            if self.phase not in (R.WAITING, R.EARLY, R.PARTIAL):
                return
            owes_a_round = self.phase == R.WAITING
            self._move(R.SUSPENDING)
            m = self._m
            if not self.route.extended:
                if not owes_a_round:
                    self._move(R.SUSPENDED)
                    self._notify()
                return
        m._send(self, SuspendMsg(self.room, m.config.host, m.rank_port, m.generation).encode())

    def checkpoint(self) -> ReceiverCheckpoint:
        """After the suspend ack: keep what landed in host memory and give every block back."""
        with self._m._lock:
            if self.phase != R.SUSPENDED:
                raise RuntimeError(f"room {self.room}: cannot checkpoint in phase {self.phase.name}")
            if self.state.status == KVPoll.Transferring:
                assert self.total_tokens is not None
                landed = min(self._round_end, self.total_tokens)
            else:  # a round asked for but never written, or restored and not resumed yet
                landed = max(self.state.progress.sent_tokens, self._spilled)
            if landed and self._out is None:
                assert self.total_tokens is not None
                self._out = Embedding.empty(self.total_tokens, self._m.pool.hidden_size, self._m.pool.dtype)
            if landed:
                self._copy_rounds_into(self._out, landed)
            self._close()
            return ReceiverCheckpoint(self.room, self.bootstrap_addr, self.route, landed, self.total_tokens,
                                      self._aux, self.resume_rounds, self._out if landed else None)

    def wait(self, timeout: float) -> KVPoll:
        """Block until the status changes (or ``timeout``); returns the status then."""
        with self._m._lock:
            before = self.state.progress
            if not before.terminal:
                self._changed.wait_for(lambda: self.state.progress != before or self.phase == R.EARLY, timeout)
            return self.state.status

    # ---- internals (manager lock held) -------------------------------------------------------

    def _round_frames(self, block_ids: list[int], resume_from: int | None) -> list[bytes]:
        """The 7-frame init (``resume_from`` None) or the 8-frame resume of one round."""
        m = self._m
        allocated = len(block_ids) * m.config.block_size
        if resume_from is None:
            msg = InitMsg(self.room, m.config.host, m.rank_port, m.transport.session_id, tuple(block_ids), 1, allocated)
        else:
            msg = ResumeMsg(self.room, m.config.host, m.rank_port, m.transport.session_id, tuple(block_ids), 1,
                            resume_from, allocated)
        return msg.encode()

    def _rebind(self, route: RankRoute) -> None:
        """The encoder restarted at ``route``: ask it again for the round it owes this room.

        A round that starts at token 0 is asked for with an init, a later one with a resume;
        a restarted encoder restores exactly those two kinds of room from its checkpoint.
        """
        self.route = route
        self.peer_name = f"encode peer {self.bootstrap_addr} (rank {route.rank_ip}:{route.rank_port})"
        self._last_progress = self._m.clock()
        if self.phase != R.WAITING:
            return  # nothing requested: the next try_resume goes to the new rank
        start = self.state.progress.sent_tokens
        pending = next((rnd for rnd in self._rounds if rnd.start == start), None)
        if pending is not None:
            self._m._send(self, self._round_frames(pending.block_ids, start or None))

    def _copy_rounds_into(self, out: Embedding, upto: int | None = None) -> None:
        """Copy the rounds still in the pool into ``out``, tokens below ``upto`` (default: all)."""
        assert self.total_tokens is not None
        _copy_rounds(self._m.pool, self._rounds, out, self._m.config.block_size,
                     self.total_tokens if upto is None else upto)

    def _clone_rounds_locked(self) -> Embedding:
        """Copy the rounds in the pool into a new embedding of just their tokens; free their blocks."""
        assert self.total_tokens is not None
        first, bs = self._rounds[0].start, self._m.config.block_size
        end = min(self._round_end, self.total_tokens)
        clone = Embedding.empty(end - first, self._m.pool.hidden_size, self._m.pool.dtype)
        for rnd in self._rounds:
            n = min(len(rnd.block_ids) * bs, end - rnd.start)
            self._m.pool.read_into(rnd.block_ids[: -(-n // bs)], clone, rnd.start - first, n)
        self._free_rounds()
        return clone

    def _spill_locked(self) -> None:
        """Copy the received rounds into the (early) assembly target and free their blocks."""
        assert self.total_tokens is not None
        if self._out is None:
            self._out = Embedding.empty(self.total_tokens, self._m.pool.hidden_size, self._m.pool.dtype)
        self._copy_rounds_into(self._out)
        self._free_rounds()
        self._m.stats["spilled_tokens"] += self._round_end - self._spilled
        self._spilled = self._round_end

    def _free_rounds(self) -> None:
        self._m.allocator.free([b for rnd in self._rounds for b in rnd.block_ids])
        self._rounds = []

    def _note_failure(self) -> None:
        """Count a failed room against its encoder once, as soon as it failed (for /health)."""
        if self.state.status == KVPoll.Failed and not self._failure_noted:
            self._failure_noted = True
            self._m.failing.failed(self.bootstrap_addr, self.state.kind, self.state.reason)

    def _close(self) -> None:
        """Give back every block still held and forget the room."""
        self._note_failure()
        self._free_rounds()
        self._move(R.CLOSED)
        self._m._forget(self)
        self._notify()

    def _on_status(self, msg: StatusMsg) -> None:
        if msg.status == KVPoll.Failed:  # the encoder stopped writing: the blocks are safe to free
            if self.state.status != KVPoll.Failed:
                kind, text = parse_wire_reason(msg.reason)
                self.state.fail(kind, f"{self.peer_name} failed the room: {text}")
            self._close()
            return
        if self.phase == R.ABORTING and not self.route.extended:  # the fork's last write landed
            self._m.stats["fork_abort_settled"] += 1
            self._close()
            return
        if self.phase not in (R.WAITING, R.EARLY, R.SUSPENDING):
            return  # aborting, or a status that is late for its round
        if msg.total_tokens is not None:
            self._on_total(msg.total_tokens)
            return
        if msg.status not in (KVPoll.Transferring, KVPoll.Success):
            return
        if msg.sent_tokens is not None and msg.sent_tokens > self._round_end:
            self._fail_bad(f"status says {msg.sent_tokens} tokens sent, only {self._round_end} allocated")
            return
        self.sending_at = self.sending_at or time.monotonic()
        if self._aux is None:  # the first round carried aux: read the total from it
            self._aux = self._m.pool.aux[self._rounds[0].block_ids[0]].copy()
            total = int(self._aux[0])
            if total <= 0 or self.total_tokens not in (None, total):
                self._fail_bad(f"aux reports {total} total tokens (announced: {self.total_tokens})")
                return
            self.total_tokens = total
        assert self.total_tokens is not None
        landed = msg.sent_tokens if msg.sent_tokens is not None else min(self._round_end, self.total_tokens)
        if msg.status == KVPoll.Success:
            if landed != self.total_tokens:
                self._fail_bad(f"Success after {landed} of {self.total_tokens} tokens")
                return
            self.state.advance(KVPoll.Success, landed)
            self._move(R.LANDED)
            self._m.failing.succeeded(self.bootstrap_addr)
        else:
            if landed >= self.total_tokens:
                self._fail_bad(f"Transferring although all {self.total_tokens} tokens were allocated")
                return
            if self._round_end > landed:  # the next round was asked for early and is under way
                self.state.advance(KVPoll.WaitingForInput, landed)
            else:
                self.state.advance(KVPoll.Transferring, self.state.progress.sent_tokens)
                if self.phase != R.SUSPENDING:
                    self._move(R.PARTIAL)
                elif not self.route.extended:  # the fork's round landed: nothing is in flight
                    self._move(R.SUSPENDED)
        self._last_progress = self._m.clock()
        self._notify()

    def _on_total(self, total: int) -> None:
        """The encoder announced the total as the first round started: allow an early resume."""
        if self.total_tokens is not None:
            return
        self.total_tokens = total
        self.sending_at = self.sending_at or time.monotonic()
        if (self.phase == R.WAITING and len(self._rounds) == 1 and self._round_end < total
                and not self.clone_concat):
            self._move(R.EARLY)
        self._notify()

    def _fail_bad(self, what: str) -> None:
        self._m.stats["bad_status"] += 1
        self.abort(FailureKind.PROTOCOL, f"{self.peer_name} sent an inconsistent status: {what}")

    def _notify(self) -> None:
        self._changed.notify_all()
        self._m._any_change.notify_all()
        self._m.on_change()


class EmbeddingReceiverManager:
    def __init__(self, config: ConnectorConfig, transport: Transport, pool: BufferPool,
                 allocator: BlockAllocator, generation: int | None = None,
                 on_change: Callable[[], None] = lambda: None, rank_port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``on_change`` is called (cheaply, under the manager lock) whenever a room's status changes.
        ``rank_port``: listen there for statuses (a restart continuing rooms its encoders know by
        that endpoint), or on a random port (0, or when it is taken). ``clock`` is what the
        rooms' timeouts (waiting, abort ack, sleep) and the encoder probes' interval are measured
        by; tests drive it by hand."""
        if pool.block_size != config.block_size or pool.hidden_size != config.hidden_size:
            raise ValueError("pool geometry does not match the connector config")
        self.config, self.transport, self.pool, self.allocator = config, transport, pool, allocator
        self.on_change, self.clock = on_change, clock
        self.generation = generation if generation is not None else time.time_ns() & (2**63 - 1)
        self.stats: collections.Counter[str] = collections.Counter()
        self.rejections = Rejections(log)
        self.failing = FailingPeers()  # encoders whose rooms keep failing, for /health
        self._lock = threading.RLock()
        self._rooms: dict[int, EmbeddingReceiver] = {}
        self._registered: set[tuple[str, int]] = set()  # encode ranks that have our register
        self._ranks: set[tuple[str, int]] = set()  # every encode rank we sent to: the only ones a pong goes to
        self.encoders = EncoderPeers(config.heartbeat_interval, config.secret)
        self._any_change = threading.Condition(self._lock)
        transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
        self._context = zmq.Context()
        self._push = PushSockets(self._context, config.secret)
        self._pull = PullLoop(self._context, config.host, self._on_message, "language-connector-pull",
                              self.rejections, config.secret, rank_port)
        self.rank_port = self._pull.port
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="language-peer-watch", daemon=True)
        self._watcher.start()

    def resolve(self, bootstrap_addr: str, room: int) -> Future:
        """The encode rank serving ``room`` (a future: cached, or one lookup per peer at a time).
        Fails with ``ConnectionError`` naming the peer."""
        return self.encoders.resolve(bootstrap_addr, room)

    def create_receiver(self, bootstrap_addr: str, room: int, route: RankRoute | None = None) -> EmbeddingReceiver:
        """A receiver for ``room`` at the given (or looked-up, blocking) route."""
        if route is None:
            route = self.resolve(bootstrap_addr, room).result()
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already receiving")
            receiver = EmbeddingReceiver(self, bootstrap_addr, room, route)
            self._rooms[room] = receiver
            return receiver

    def dead_peer(self, bootstrap_addr: str) -> str:
        """Why the encoder at ``bootstrap_addr`` was declared dead ("" while it is not)."""
        return self.encoders.peer(bootstrap_addr).dead

    def abandon(self, bootstrap_addr: str, room: int, route: RankRoute | None = None) -> None:
        """A request with no receiver is gone: tell the encoder (at once when its route is known,
        else once a lookup finds it) so it drops any encode of the room. Nothing waits for the
        answer: no block is involved."""
        frames = AbortMsg(room, self.config.host, self.rank_port, self.generation).encode()
        if route is not None:
            if route.extended:  # a fork encoder takes no abort; its encode request times out there
                self._send_to(route, frames)
        else:
            self.resolve(bootstrap_addr, room).add_done_callback(
                lambda found: found.exception() or not found.result().extended or self._send_to(found.result(), frames))

    def active_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    def fork_rounds_owed(self) -> list[int]:
        """Rooms a reference-fork encoder may still write into (a sleep must wait for them)."""
        with self._lock:
            return [r.room for r in self._rooms.values() if not r.route.extended and r.phase in _FORK_OWES_A_ROUND | {
                R.ABORTING}]

    # ---- sleep ------------------------------------------------------------------------------

    def suspend_all(self, receivers: list[EmbeddingReceiver], timeout: float) -> None:
        """Suspend rooms with their encoders; wait for every ack (rooms that miss it are aborted)."""
        for receiver in receivers:
            receiver.suspend()
        with self._lock:
            settled = lambda r: r.phase in (R.SUSPENDED, R.LANDED, R.CLOSED, R.ABORTING)  # noqa: E731
            if not self._wait(lambda: all(settled(r) for r in receivers), timeout):
                silent = [r for r in receivers if not settled(r)]
                for r in silent:
                    r.abort(FailureKind.TIMEOUT, f"{r.peer_name} did not acknowledge the suspend within {timeout:g}s")
            # Blocks of aborted rooms come back with the ack or its timeout; the pool can only be
            # released after that.
            self._wait(lambda: not any(r.phase == R.ABORTING for r in receivers), self.config.abort_ack_timeout + 1)

    def _wait(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._any_change.wait(min(left, 0.05))
        return True

    def detach_pool(self) -> None:
        """Deregister the pool (sleep). Every block must be back."""
        with self._lock:
            if not self.allocator.all_free():
                raise RuntimeError(f"cannot release the pool: {self.allocator.num_blocks - self.allocator.free_blocks} "
                                   "blocks still in use")
            self.transport.unregister([b.ctypes.data for b in self.pool.buffers])

    def attach_pool(self, pool: BufferPool, allocator: BlockAllocator) -> None:
        """Register a new pool (wake) under a new generation; encoders get a fresh register."""
        with self._lock:
            self.pool, self.allocator = pool, allocator
            self.transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
            self.generation = (self.generation + 1) & (2**63 - 1)
            self._registered.clear()

    def restore(self, ckpt: ReceiverCheckpoint) -> EmbeddingReceiver:
        """A receiver that continues a checkpointed room: call ``try_resume`` to send its resume."""
        with self._lock:
            if ckpt.room in self._rooms:
                raise ValueError(f"room {ckpt.room} is already receiving")
            peer = self.encoders.peer(ckpt.bootstrap_addr)
            peer.route = peer.route or ckpt.route
            if ckpt.route.incarnation:  # a new encoder process answers with another one: rebind then
                peer.incarnation = peer.incarnation or ckpt.route.incarnation
            r = EmbeddingReceiver(self, ckpt.bootstrap_addr, ckpt.room, ckpt.route)
            r.total_tokens, r._aux, r.resume_rounds = ckpt.total_tokens, ckpt.aux, ckpt.resume_rounds
            r._out, r._spilled, r._round_end = ckpt.data, ckpt.landed, ckpt.landed
            r._move(R.RESTORED)
            self._rooms[ckpt.room] = r
            return r

    def allocate_waiting(self, n: int, deadline: float) -> list[int] | None:
        """Allocate ``min(n, pool size)`` blocks, waiting for frees until ``deadline``."""
        n = min(n, self.allocator.num_blocks)
        while (blocks := self.allocator.allocate(n)) is None:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)
        return blocks

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(timeout=10)
        self.encoders.close()
        self._pull.close()
        self._push.close()
        self._context.term()
        self.transport.unregister([b.ctypes.data for b in self.pool.buffers])

    # ---- sending ---------------------------------------------------------------------------

    def _register_msg(self) -> RegisterMsg:
        return RegisterMsg(self.config.host, self.rank_port, self.transport.session_id, self.pool.base_ptrs,
                           self.generation, self.pool.num_blocks, self.pool.item_lens)

    def _send(self, receiver: EmbeddingReceiver, frames: list[bytes], register: bool = False) -> None:
        if not self._send_to(receiver.route, frames, register):
            with self._lock:  # the encoder never got it; an aborting room still waits for its ack
                if receiver.phase not in (R.CLOSED, R.ABORTING):
                    receiver.state.fail(FailureKind.PEER_UNREACHABLE, f"cannot reach {receiver.peer_name}")
                    receiver._close()

    def _send_to(self, route: RankRoute, frames: list[bytes], register: bool = False) -> bool:
        """Send to an encode rank, registering with it first (the first time, or always with
        ``register``: an init re-registers, which mends a registration a stranger replaced while
        we had no rooms there); False when it cannot take messages."""
        key = (route.rank_ip, route.rank_port)
        try:
            with self._lock:
                if register or key not in self._registered:
                    self._push.send(route.rank_ip, route.rank_port, self._register_msg().encode())
                    self._registered.add(key)
                    self._ranks.add(key)
            self._push.send(route.rank_ip, route.rank_port, frames)
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot reach encode rank %s:%d: %s", route.rank_ip, route.rank_port, exc)
            return False

    def _forget(self, receiver: EmbeddingReceiver) -> None:
        if self._rooms.get(receiver.room) is receiver:
            del self._rooms[receiver.room]

    # ---- receiving -------------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = decode_language_bound(frames)
        except ProtocolError as exc:
            self.rejections.reject("malformed", str(exc))
            return
        if isinstance(msg, PingMsg):  # on the socket our other messages to that rank use: ordered after them
            with self._lock:
                known = (msg.endpoint, msg.port) in self._ranks
            if known:  # never to an address a stranger names (it may be a fork encoder, or no one)
                self._push.try_send(msg.endpoint, msg.port, PongMsg(self.transport.session_id, msg.seq,
                                                                           self.generation).encode())
            else:
                self.rejections.reject("not_owner", f"ping from {msg.endpoint}:{msg.port}, no encode rank of ours")
            return
        with self._lock:
            receiver = self._rooms.get(msg.room)
            if receiver is None:  # usually a late status of a room that ended
                self.rejections.reject("unknown_room", f"message for room {msg.room}", logging.DEBUG)
                return
            if isinstance(msg, SuspendAckMsg):
                if msg.generation == self.generation and receiver.phase == R.SUSPENDING:
                    receiver._move(R.SUSPENDED)
                    receiver._notify()
                elif receiver.phase in _MAYBE_IN_FLIGHT:
                    # Suspended there on a SUSPEND we never sent: it would write nothing more until
                    # we resumed it, which we would not know to do. Give it up (the abort ends it there).
                    self.stats["foreign_suspend"] += 1
                    receiver.abort(FailureKind.ABORTED, f"{receiver.peer_name} suspended the room on a SUSPEND "
                                                        "this worker did not send")
                else:
                    self.stats["stale_message"] += 1
                return
            if isinstance(msg, AbortAckMsg):
                if msg.generation == self.generation and receiver.phase == R.ABORTING:
                    self.stats["abort_acked"] += 1
                    receiver._close()
                elif receiver.phase in _MAYBE_IN_FLIGHT:
                    # The encoder gave the room up on an ABORT we never sent (a stranger named our
                    # endpoint): it is gone there, and an ack comes only with nothing in flight.
                    self.stats["foreign_abort"] += 1
                    receiver.state.fail(FailureKind.ABORTED, f"{receiver.peer_name} ended the room on an ABORT "
                                                             "this worker did not send")
                    receiver._close()
                else:
                    self.stats["stale_message"] += 1
                return
            receiver._on_status(msg)

    # ---- peer watch and timeouts ------------------------------------------------------------------

    def _watch(self) -> None:
        interval = self.config.heartbeat_interval
        next_beat = self.clock() + interval
        while not self._stop.wait(min(0.25, interval)):
            now = self.clock()
            self._check_timeouts(now)
            if now >= next_beat:
                next_beat = now + interval
                with self._lock:
                    addrs = {r.bootstrap_addr for r in self._rooms.values()}
                self.encoders.probe(addrs, self._on_probe)

    def _check_timeouts(self, now: float) -> None:
        with self._lock:
            for receiver in list(self._rooms.values()):
                peer = self.encoders.peer(receiver.bootstrap_addr)
                if receiver.phase == R.ABORTING:
                    hold = self.config.abort_ack_timeout if receiver.route.extended else self.config.fork_abort_hold
                    if now - receiver._aborted_at > hold:
                        log.warning("room %d: no %s from %s within %gs; its blocks are freed", receiver.room,
                                    "ABORT_ACK" if receiver.route.extended else "status", receiver.peer_name, hold)
                        receiver._close()
                elif peer.asleep_since is not None:
                    if now - peer.asleep_since > self.config.max_sleep:
                        receiver.abort(FailureKind.TIMEOUT,
                                       f"{receiver.peer_name} slept longer than {self.config.max_sleep:g}s")
                elif (receiver.phase in (R.WAITING, R.EARLY)
                      and now - receiver._last_progress > self.config.waiting_timeout):
                    receiver.abort(FailureKind.TIMEOUT, f"no data from {receiver.peer_name} within "
                                                        f"{self.config.waiting_timeout:g}s")

    def _on_probe(self, addr: str, probe: Probe) -> None:
        """One health probe's answer: a sleeping peer is alive (its rooms wait up to ``max_sleep``);
        one that answers as a new process gets every outstanding request of our rooms again;
        ``heartbeat_max_failures`` failures in a row and it is dead."""
        if probe.ok:
            self._note_health(addr, probe.text, probe.incarnation)
            return
        with self._lock:
            peer = self.encoders.peer(addr)
            if probe.gone:  # no process: nothing can write into our blocks any more
                for receiver in [r for r in self._rooms.values() if r.bootstrap_addr == addr]:
                    if receiver.phase == R.ABORTING:
                        receiver._close()
            if peer.durable:  # restarting from its checkpoint: its rooms wait (up to max_sleep)
                self.stats["durable_peer_unreachable"] += 1
                return
            peer.misses += 1
            if peer.misses >= self.config.heartbeat_max_failures:
                self._declare_dead(addr, f"{peer.misses} heartbeats missed ({probe.why})", probe.gone)

    def _note_health(self, addr: str, text: str, incarnation: str | None) -> None:
        peer = self.encoders.peer(addr)
        with self._lock:
            peer.misses, peer.dead = 0, ""
            if text.startswith("SLEEPING"):
                peer.asleep_since = peer.asleep_since or self.clock()
                if text.startswith("SLEEPING checkpointed") and not peer.durable:
                    self.stats["durable_sleepers_seen"] += 1
                peer.durable = text.startswith("SLEEPING checkpointed")
                return
            peer.durable = False
            if peer.asleep_since is not None:
                peer.asleep_since = None
                for receiver in self._rooms.values():
                    if receiver.bootstrap_addr == addr:
                        receiver._last_progress = self.clock()
            known = peer.incarnation = peer.incarnation or incarnation
        if incarnation and known != incarnation:
            self._rebind(addr, incarnation)

    def _rebind(self, addr: str, incarnation: str) -> None:
        """Point the rooms of a restarted encoder at its new rank and repeat what it owes them."""
        with self._lock:
            room = next((r.room for r in self._rooms.values() if r.bootstrap_addr == addr), 0)
        old = self.encoders.forget_route(addr)
        # Not waited for here: this runs on the pool the lookup needs.
        self.resolve(addr, room).add_done_callback(functools.partial(self._rebound, addr, incarnation, old))

    def _rebound(self, addr: str, incarnation: str, old: RankRoute | None, lookup: Future) -> None:
        try:
            route = lookup.result()
        except ConnectionError as exc:  # asked again at the next probe
            log.warning("encode peer %s restarted but its route is not readable yet: %s", addr, exc)
            return
        with self._lock:  # rooms created meanwhile took the old route: they are in this list too
            rooms = [r for r in self._rooms.values() if r.bootstrap_addr == addr and not r.state.progress.terminal]
            self.encoders.peer(addr).incarnation = route.incarnation or incarnation
            self._drop_rank(old)
            for receiver in rooms:
                receiver._rebind(route)
        self.stats["peer_restarted"] += 1
        log.warning("encode peer %s restarted (rank now %s:%d); %d rooms asked again",
                    addr, route.rank_ip, route.rank_port, len(rooms))

    def _drop_rank(self, route: RankRoute | None) -> None:
        """Forget a rank that is no more (lock held): a new one at that address gets a fresh register."""
        if route is not None:
            self._registered.discard((route.rank_ip, route.rank_port))
            self._push.drop(route.rank_ip, route.rank_port)

    def _declare_dead(self, addr: str, why: str, gone: bool) -> None:
        """Fail every unfinished room of the peer (lock held). A peer whose process is gone writes
        nothing more, so its rooms' blocks come back at once; one that only stopped answering
        (frozen, cut off) may still write when it comes back, so its rooms are aborted and their
        blocks wait for its ack (it handles our abort before it answers a ping again, so it
        starts no new write for them), for it to be found gone, or for the ack timeout."""
        peer = self.encoders.peer(addr)
        peer.misses, peer.incarnation, peer.dead = 0, None, why
        if gone:  # a restarted process has another rank: look it up again
            self._drop_rank(self.encoders.forget_route(addr))
        for receiver in [r for r in self._rooms.values() if r.bootstrap_addr == addr]:
            reason = f"{receiver.peer_name} is dead: {why}"
            if receiver.phase in _MAYBE_IN_FLIGHT and not gone:
                receiver.abort(FailureKind.PEER_DEAD, reason)
            elif receiver.phase not in (R.LANDED, R.CLOSED) and (gone or receiver.phase != R.ABORTING):
                receiver.state.fail(FailureKind.PEER_DEAD, reason)
                receiver._close()
        self.stats["peer_dead"] += 1
        log.error("encode peer %s declared dead: %s", addr, why)


def receive_embedding(manager: EmbeddingReceiverManager, bootstrap_addr: str, room: int,
                      timeout: float = 300.0, first_blocks: int | None = None,
                      clone_concat: bool = False) -> tuple[Embedding, EmbeddingReceiver]:
    """Receive one room start to finish: default allocation, init, resumes, assemble.

    Blocking convenience for scripts and tests; the language worker drives the same steps
    from its queues. ``first_blocks`` overrides the default allocation and ``clone_concat``
    switches to the reference fork's strategy (both for benchmarks). Raises
    :class:`TransferFailure` on failure or timeout (aborting the room).
    """
    deadline = time.monotonic() + timeout
    receiver = manager.create_receiver(bootstrap_addr, room)
    receiver.clone_concat = clone_concat
    blocks = manager.allocate_waiting(first_blocks or manager.config.default_allocate_blocks, deadline)
    if blocks is None:
        receiver.abort(FailureKind.TIMEOUT, "no free blocks for the default allocation")
        receiver.failure_exception()
    receiver.init(blocks)
    return finish_receiving(receiver, deadline - time.monotonic()), receiver


def finish_receiving(receiver: EmbeddingReceiver, timeout: float) -> Embedding:
    """Drive an inited receiver to ``Success`` (resuming after each partial round) and assemble.

    Raises :class:`TransferFailure` on failure or timeout (aborting the room).
    """
    deadline = time.monotonic() + timeout
    while (status := receiver.poll()) != KVPoll.Success:
        if status == KVPoll.Failed:
            receiver.failure_exception()
        left = deadline - time.monotonic()
        if left <= 0:
            receiver.abort(FailureKind.TIMEOUT, f"room not done within {timeout:g}s")
            receiver.failure_exception()
        if receiver.try_resume():
            continue
        receiver.wait(min(left, 0.05 if status == KVPoll.Transferring else 1.0))
    return receiver.assemble()
