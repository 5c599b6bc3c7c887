"""Language side of the connector: init, poll, resume rounds, assemble once, abort.

One :class:`EmbeddingReceiverManager` per language worker owns the destination pool, its
allocator, the transport, the PULL socket for statuses, acks and pings, and the watch over its
encode peers (:mod:`connector.encoder_peers`). Each request gets an
:class:`EmbeddingReceiver` (SGLang's ``BaseKVReceiver`` shape): the handle of one
:class:`~connector.receiver_rooms.ReceiverRoom`, the pure state machine whose
``on(event, world)`` is the only place a room's phase changes (every allowed change is in
``connector.receiver_rooms.TRANSITIONS``). The handle and the manager turn what happens
(a call, a message, a probe, a tick) into an event, hand it to the room with the world it
decides by (``EmbeddingReceiver._world``: the clock, its encoder's sleep, the limits), and
apply the effects it returns: send a frame, free or copy blocks, count, wake waiters. Neither
touches a room's fields otherwise; block ownership is described in :mod:`connector.receiver_rooms`.

Locks, in this order only: the manager's ``_lock`` (every room's phase and the rooms table),
then the allocator's and a room state's own (leaves: they call nothing back). A room's frames
are sent once the handle released the lock (still under it where the caller holds it: a
message, a probe or a tick of the manager's threads). No copy of an embedding's rows runs under
the manager's lock: an assembly's and a checkpoint's run after their room closed, a spill's once
its rounds left the room (a checkpoint of that room waits for it). Only the reference fork's
strategy (``clone_concat``, kept to measure against) copies under it, as the fork does.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import zmq

from connector import receiver_rooms as ev
from connector.allocator import BlockAllocator
from connector.bootstrap import RankRoute
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.encoder_peers import EncoderPeers, Probe
from connector.failures import FailureKind
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
from connector.receiver_rooms import FORK_OWES_A_ROUND, TRANSITIONS, ReceiverPhase, ReceiverRoom, Round
from connector.rejections import Rejections
from connector.transport import Transport
from connector.zmq_link import PullLoop, PushSockets

log = logging.getLogger(__name__)

__all__ = ["TRANSITIONS", "EmbeddingReceiver", "EmbeddingReceiverManager", "ReceiverCheckpoint", "ReceiverPhase",
           "finish_receiving", "receive_embedding"]

R = ReceiverPhase


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


def _copy_rounds(pool: BufferPool, rounds: tuple[Round, ...], out: Embedding, block_size: int, end: int) -> None:
    """Copy tokens ``[0, end)`` of ``rounds`` from ``pool`` into ``out``."""
    for rnd in rounds:
        n = min(len(rnd.block_ids) * block_size, end - rnd.start)
        if n > 0:
            pool.read_into(list(rnd.block_ids[: -(-n // block_size)]), out, rnd.start, n)


def _blocks(rounds: tuple[Round, ...]) -> list[int]:
    return [b for rnd in rounds for b in rnd.block_ids]


def _peer_name(bootstrap_addr: str, route: RankRoute) -> str:
    return f"encode peer {bootstrap_addr} (rank {route.rank_ip}:{route.rank_port})"


class EmbeddingReceiver:
    """One request's receiving end: the handle of its :class:`ReceiverRoom` (``machine``).
    Thread-safe; status updates arrive on the manager's thread.

    Every call takes the manager's lock, hands the room an event and applies the effects it
    returns; frames go out once the lock is released. Allocation stays here (how many blocks
    are free decides a resume's size and a spill); the room decides every phase.
    """

    def __init__(self, manager: EmbeddingReceiverManager, bootstrap_addr: str, room: int, route: RankRoute) -> None:
        self._m, self.bootstrap_addr, self.room, self.route = manager, bootstrap_addr, room, route
        self.created = manager.clock()  # a heartbeat probe started before this says nothing of this room
        self.machine = ReceiverRoom(room, manager.config.block_size, route.extended, _peer_name(bootstrap_addr, route),
                                    last_progress=self.created)
        self._changed = threading.Condition(manager._lock)  # notified on every status change
        self._out: Embedding | None = None  # assembly target, created early only by a spill or a restore
        # The reference fork's strategy (clone_concat), kept only to measure against
        # (scripts/bench_resume.py): copies of every partial round, concatenated at the end.
        self._clones: list[Embedding] = []
        self._spilling = False  # a spill's copy into _out runs (outside the lock)

    # ---- what the room says (read-only) -----------------------------------------------------

    @property
    def phase(self) -> ReceiverPhase:
        return self.machine.phase

    @property
    def state(self) -> RoomState:
        return self.machine.state

    @property
    def total_tokens(self) -> int | None:
        return self.machine.total_tokens

    @property
    def resume_rounds(self) -> int:
        return self.machine.resume_rounds

    @property
    def sending_at(self) -> float | None:
        """When the encoder had the embedding (``time.monotonic()``; it announced the total, or a
        fork's first round landed): before it, the room waits for the encoder; after it, the wire works."""
        return self.machine.sending_at

    @property
    def peer_name(self) -> str:
        return self.machine.peer_name

    @property
    def clone_concat(self) -> bool:
        """The reference fork's strategy (benchmarks): copy every partial round out of the pool
        and concatenate all copies at the end. Set before ``init``."""
        return self.machine.clone_concat

    @clone_concat.setter
    def clone_concat(self, value: bool) -> None:
        self.machine.clone_concat = value

    # ---- BaseKVReceiver-like API ----------------------------------------------------------

    def init(self, block_ids: list[int]) -> None:
        """Send the 7-frame init with the first allocation (``allocated = len * block_size``)."""
        self.handle(ev.Init(tuple(block_ids)))

    def poll(self) -> KVPoll:
        return self.machine.state.status

    def failure_exception(self) -> None:
        if self.machine.state.status == KVPoll.Failed:
            raise self.machine.state.failure(self.room)

    def remaining_tokens(self) -> int:
        assert self.machine.total_tokens is not None
        return self.machine.total_tokens - self.machine.round_end

    def try_resume(self) -> bool:
        """After a partial round (or early, or after a wake): allocate for the rest (or as much as
        is free) and resume.

        When no block is free at all, this room's received blocks are spilled to host memory
        to make room, so a full pool can always make progress. Returns False when it must be
        retried later (nothing could be allocated).
        """
        m, room = self._m, self.machine
        spilled: list[ev.CopyOut] = []
        with m._lock:
            if not room.resumable:
                return False
            if room.clone_concat:  # the reference strategy, measured as the fork runs it
                self._copy_out(self._apply(room.on(ev.Clone(), self._world()))[1])
            if m.allocator.free_blocks == 0:  # the room spills only rounds nothing is written into
                spilled = self._apply(room.on(ev.Spill(), self._world()))[1]
                self._spilling = bool(spilled)
        if spilled:  # these rounds left the room: copied outside the lock (a 4K image is 75 MB)
            try:
                self._copy_out(spilled)
            finally:
                with m._lock:
                    self._spilling = False
                    self._notify()
        with m._lock:
            if not room.resumable:  # failed meanwhile
                return False
            need, free = room.blocks_needed(m.config.default_allocate_blocks), m.allocator.free_blocks
            blocks = m.allocator.allocate(min(need, free)) if free else None
            if blocks is None:
                return False
            sends, _ = self._apply(room.on(ev.Resumed(tuple(blocks)), self._world()))
        self._send(sends)
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
        m, room, bs = self._m, self.machine, self._m.config.block_size
        rounds: tuple[Round, ...] = ()  # to copy once the lock is released
        with m._lock:
            _, copies = self._apply(room.on(ev.Assemble(), self._world()))  # raises when it cannot
            (given,) = copies
            total, pool = room.total_tokens, m.pool
            assert total is not None and room.aux is not None
            if self._clones:  # reference strategy: concatenate the copies of every round
                parts = self._clones + [self._clone(given)]
                m.allocator.free(_blocks(given.rounds))
                out = Embedding(np.concatenate([p.embeddings for p in parts]), np.concatenate([p.fill_ids for p in parts]),
                                np.concatenate([p.mrope_positions for p in parts], axis=1), parts[0].aux.copy(),
                                m.pool.hidden_size, m.pool.dtype)
            elif self._out is None and (out := m.pool.view(used := room.used_blocks(given.rounds), total)) is not None:
                held = set(used)
                m.allocator.free([b for b in _blocks(given.rounds) if b not in held])
                out.release_fn = lambda: m.allocator.free(used)
            else:  # the room closed with no round: its blocks are this call's until copied
                out = self._out or Embedding.empty(total, m.pool.hidden_size, m.pool.dtype)
                rounds = given.rounds
            out.aux[:] = room.aux
        if rounds:
            try:
                _copy_rounds(pool, rounds, out, bs, given.upto)
            finally:
                m.allocator.free(_blocks(rounds))
        return out

    def abort(self, kind: FailureKind = FailureKind.CANCELLED, reason: str = "aborted by the language side") -> bool:
        """Fail at once and tell the encoder. Blocks the encoder may still be writing come back
        with its ack (or when it is found gone, or ``unacked_block_hold`` past the ack timeout);
        others at once.
        Returns whether the whole embedding had arrived when the abort took effect (the encoder
        was told it landed): decided under the lock that orders it with the last round's status."""
        return self.handle(ev.Abort(kind, reason)) == KVPoll.Success

    def suspend(self) -> None:
        """Ask the encoder to write nothing more for this room (sleep); its ack ends SUSPENDING.
        A fork encoder is not asked: the status of the round it owes ends SUSPENDING."""
        self.handle(ev.Suspend())

    def checkpoint(self) -> ReceiverCheckpoint:
        """After the suspend ack: keep what landed in host memory and give every block back."""
        room = self.machine
        with self._m._lock:
            self._changed.wait_for(lambda: not self._spilling)  # its rows go to the same host memory
            _, copies = self._apply(room.on(ev.Checkpoint(), self._world()))  # closed: nothing else touches it now
        self._copy_out(copies)  # outside the lock
        landed = copies[0].upto
        return ReceiverCheckpoint(self.room, self.bootstrap_addr, self.route, landed, room.total_tokens,
                                  room.aux, room.resume_rounds, self._out if landed else None)

    def wait(self, timeout: float) -> KVPoll:
        """Block until the status changes (or ``timeout``); returns the status then."""
        room = self.machine
        with self._m._lock:
            before = room.state.progress
            if not before.terminal:
                self._changed.wait_for(lambda: room.state.progress != before or room.phase == R.EARLY, timeout)
            return room.state.status

    # ---- events from the manager ------------------------------------------------------------

    def handle(self, event: ev.Event) -> KVPoll:
        """Hand the room ``event`` and apply what it says (frames once the lock is released);
        returns the room's status just before the event took effect."""
        with self._m._lock:
            before = self.machine.state.status
            sends, copies = self._apply(self.machine.on(event, self._world()))
        assert not copies, f"{event} gave rounds away"
        self._send(sends)
        return before

    def _world(self) -> ev.World:
        """What the room's decisions read outside it, now: the manager's clock, when its encoder was
        seen asleep, the limits in force (manager lock held)."""
        m, c = self._m, self._m.config
        return ev.World(now=m.clock(), asleep_since=m.encoders.peer(self.bootstrap_addr).asleep_since,
                        abort_ack_timeout=c.abort_ack_timeout, seconds_per_block=sum(m.pool.item_lens) / c.min_link_rate,
                        unacked_block_hold=c.unacked_block_hold, fork_abort_hold=c.fork_abort_hold,
                        max_sleep=c.max_sleep, waiting_timeout=c.waiting_timeout, join_timeout=c.join_timeout)

    def on_status(self, msg: StatusMsg) -> None:
        """A status from the encoder (manager lock held). Until the room has its aux row, the
        first round's first block holds it: read it along."""
        room, aux = self.machine, None
        if room.aux is None and room.rounds and msg.status in (KVPoll.Transferring, KVPoll.Success):
            aux = self._m.pool.aux[room.rounds[0].block_ids[0]].copy()
        self.handle(ev.StatusIn(msg.status, msg.sent_tokens, msg.total_tokens, msg.reason, aux, time.monotonic()))

    def rebind(self, route: RankRoute) -> None:
        """The encoder restarted at ``route``: ask it again for the round it owes this room."""
        self.route = route
        self.handle(ev.Rebound(route.extended, _peer_name(self.bootstrap_addr, route)))

    def restore(self, ckpt: ReceiverCheckpoint) -> None:
        """Continue the checkpointed room (a new receiver, manager lock held)."""
        self._out = ckpt.data
        self.handle(ev.Restore(ckpt.total_tokens, ckpt.aux, ckpt.resume_rounds, ckpt.landed))

    # ---- applying effects ---------------------------------------------------------------------

    def _apply(self, effects: list[ev.Effect]) -> tuple[list[ev.Effect], list[ev.CopyOut]]:
        """Apply what needs the manager's lock (held); return the frames to send and the rounds
        given out (for the caller to copy and free)."""
        m = self._m
        sends: list[ev.Effect] = []
        copies: list[ev.CopyOut] = []
        for eff in effects:
            if isinstance(eff, (ev.SendRound, ev.SendAbort, ev.SendSuspend)):
                sends.append(eff)
            elif isinstance(eff, ev.CopyOut):
                copies.append(eff)
            elif isinstance(eff, ev.FreeBlocks):
                m.allocator.free(list(eff.block_ids))
            elif isinstance(eff, ev.Notify):
                self._notify()
            elif isinstance(eff, ev.NoteFailure):
                m.failing.failed(self.bootstrap_addr, eff.kind, eff.reason, eff.joined)
            elif isinstance(eff, ev.NoteSuccess):
                m.failing.succeeded(self.bootstrap_addr)
            elif isinstance(eff, ev.Count):
                m.stats[eff.stat] += eff.n
            elif isinstance(eff, ev.Forget):
                m._forget(self)
            elif isinstance(eff, ev.Warn):
                log.warning("%s", eff.text)
            else:
                raise AssertionError(f"unknown effect {eff}")
        return sends, copies

    def _send(self, sends: list[ev.Effect]) -> None:
        """Send the room's frames; one that cannot go fails the room (``SendFailed``)."""
        m = self._m
        for eff in sends:
            if isinstance(eff, ev.SendRound):
                frames, register = self._round_frames(eff.block_ids, eff.start), eff.register
            elif isinstance(eff, ev.SendAbort):
                frames, register = AbortMsg(self.room, m.config.public_host, m.rank_port, m.generation).encode(), False
            else:
                frames, register = SuspendMsg(self.room, m.config.public_host, m.rank_port, m.generation).encode(), False
            if not m._send_to(self.route, frames, register):
                self.handle(ev.SendFailed())

    def _round_frames(self, block_ids: tuple[int, ...], resume_from: int | None) -> list[bytes]:
        """The 7-frame init (``resume_from`` None) or the 8-frame resume of one round."""
        m = self._m
        allocated = len(block_ids) * m.config.block_size
        if resume_from is None:
            msg = InitMsg(self.room, m.config.public_host, m.rank_port, m.transport.session_id, tuple(block_ids), 1, allocated)
        else:
            msg = ResumeMsg(self.room, m.config.public_host, m.rank_port, m.transport.session_id, tuple(block_ids), 1,
                            resume_from, allocated)
        return msg.encode()

    def _copy_out(self, copies: list[ev.CopyOut]) -> None:
        """Copy rounds a spill, clone or checkpoint gave out into host memory, then free their
        blocks. A spill's and a checkpoint's run outside the lock (the rounds left the room; a
        checkpoint waits for a spill of its room to end: both write ``_out``)."""
        m = self._m
        for given in copies:
            try:
                if given.into == "clone":
                    self._clones.append(self._clone(given))
                elif given.upto:  # a spill, or a checkpoint of what landed
                    if self._out is None:
                        assert self.machine.total_tokens is not None
                        self._out = Embedding.empty(self.machine.total_tokens, m.pool.hidden_size, m.pool.dtype)
                    _copy_rounds(m.pool, given.rounds, self._out, m.config.block_size, given.upto)
            finally:
                m.allocator.free(_blocks(given.rounds))

    def _clone(self, given: ev.CopyOut) -> Embedding:
        """A new embedding of just the tokens of ``given``'s rounds (below ``upto``)."""
        m, bs = self._m, self._m.config.block_size
        first = given.rounds[0].start
        clone = Embedding.empty(given.upto - first, m.pool.hidden_size, m.pool.dtype)
        for rnd in given.rounds:
            n = min(len(rnd.block_ids) * bs, given.upto - rnd.start)
            m.pool.read_into(list(rnd.block_ids[: -(-n // bs)]), clone, rnd.start - first, n)
        return clone

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
        # Pools deregistered while aborted rooms' writes might still land in them, kept allocated
        # until then (the manager's clock), so that no later allocation takes their addresses.
        self._retired_pools: list[tuple[BufferPool, float]] = []
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
        frames = AbortMsg(room, self.config.public_host, self.rank_port, self.generation).encode()
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
            return [r.room for r in self._rooms.values() if not r.route.extended and r.phase in FORK_OWES_A_ROUND | {
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
            # Blocks of aborted rooms come back with the ack; past its timeout they are released
            # with the pool (detach_pool).
            self._wait(lambda: not any(r.phase == R.ABORTING and not r.machine.unacked for r in receivers),
                       self.config.longest_abort_hold(self.pool.nbytes) + 1)

    def _wait(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._any_change.wait(min(left, 0.05))
        return True

    def only_unacked_blocks_out(self) -> bool:
        """Every block is free but those of aborted rooms past their ack wait (``detach_pool`` frees them)."""
        with self._lock:
            return self.allocator.free_blocks + self._unacked_blocks() == self.allocator.num_blocks

    def _unacked_blocks(self) -> int:
        return sum(len(rnd.block_ids) for r in self._rooms.values() if r.machine.unacked for rnd in r.machine.rounds)

    def detach_pool(self) -> None:
        """Deregister the pool (sleep). Every block must be back, but those of aborted rooms past
        their ack wait: they come back now, and the pool's memory is kept (unused) for
        ``unacked_block_hold``, so a late write of their encoder lands where nobody reads."""
        with self._lock:
            if not self.only_unacked_blocks_out():
                raise RuntimeError(f"cannot release the pool: {self.allocator.num_blocks - self.allocator.free_blocks} "
                                   "blocks still in use")
            self.transport.unregister([b.ctypes.data for b in self.pool.buffers])
            unacked = [r for r in self._rooms.values() if r.machine.unacked]
            if unacked:
                self._retired_pools.append((self.pool, self.clock() + self.config.unacked_block_hold))
            for receiver in unacked:
                receiver.handle(ev.PoolReleased())

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
            r.restore(ckpt)
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
        return RegisterMsg(self.config.public_host, self.rank_port, self.transport.session_id, self.pool.base_ptrs,
                           self.generation, self.pool.num_blocks, self.pool.item_lens)

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
            if isinstance(msg, SuspendAckMsg):  # an ack of another generation's SUSPEND is foreign
                receiver.handle(ev.SuspendAck(msg.generation == self.generation))
            elif isinstance(msg, AbortAckMsg):
                receiver.handle(ev.AbortAck(msg.generation == self.generation))
            else:
                receiver.on_status(msg)

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
                self.encoders.probe(addrs, functools.partial(self._on_probe, started=now))

    def _check_timeouts(self, now: float) -> None:
        with self._lock:
            self._retired_pools = [(pool, until) for pool, until in self._retired_pools if until > now]
            for receiver in list(self._rooms.values()):
                receiver.handle(ev.Tick())

    def _on_probe(self, addr: str, probe: Probe, started: float) -> None:
        """One health probe's answer: a sleeping peer is alive (its rooms wait up to ``max_sleep``);
        one that answers as a new process gets every outstanding request of our rooms again;
        ``heartbeat_max_failures`` failures in a row and it is dead (``started``: when this probe
        was sent, which decides the rooms it speaks for)."""
        if probe.ok:
            self._note_health(addr, probe.text, probe.incarnation)
            return
        with self._lock:
            peer = self.encoders.peer(addr)
            if probe.gone:  # no process: nothing can write into our blocks any more
                for receiver in [r for r in self._rooms.values() if r.bootstrap_addr == addr]:
                    receiver.handle(ev.PeerGone())
            if peer.durable:  # restarting from its checkpoint: its rooms wait (up to max_sleep)
                self.stats["durable_peer_unreachable"] += 1
                return
            peer.misses += 1
            if peer.misses >= self.config.heartbeat_max_failures:
                self._declare_dead(addr, f"{peer.misses} heartbeats missed ({probe.why})", probe.gone, started)

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
                for receiver in list(self._rooms.values()):
                    if receiver.bootstrap_addr == addr:
                        receiver.handle(ev.PeerWoke())
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
                receiver.rebind(route)
            # The old process is gone (another holds its port): no write of it can land any more,
            # and the acks of the rooms aborted there will never come.
            for receiver in [r for r in self._rooms.values() if r.bootstrap_addr == addr and r.phase == R.ABORTING]:
                receiver.handle(ev.PeerGone())
        self.stats["peer_restarted"] += 1
        log.warning("encode peer %s restarted (rank now %s:%d); %d rooms asked again",
                    addr, route.rank_ip, route.rank_port, len(rooms))

    def _drop_rank(self, route: RankRoute | None) -> None:
        """Forget a rank that is no more (lock held): a new one at that address gets a fresh register."""
        if route is not None:
            self._registered.discard((route.rank_ip, route.rank_port))
            self._push.drop(route.rank_ip, route.rank_port)

    def _declare_dead(self, addr: str, why: str, gone: bool, probed_at: float) -> None:
        """Fail the peer's unfinished rooms (lock held). A peer whose process is gone writes
        nothing more, so its rooms' blocks come back at once; one that only stopped answering
        (frozen, cut off) may still write when it comes back, so its rooms are aborted and their
        blocks wait for its ack (it handles our abort before it answers a ping again, so it
        starts no new write for them, and acks once none of its writes can land), for it to be
        found gone, or past the ack timeout for ``unacked_block_hold``.

        A room created after the last missed probe was sent (``probed_at``) is not failed with
        the others unless the process is gone: that probe may have timed out in a cut that has
        healed since. The next probe decides for it (one more miss and it fails too)."""
        peer = self.encoders.peer(addr)
        rooms = [r for r in self._rooms.values() if r.bootstrap_addr == addr]
        failed = rooms if gone else [r for r in rooms if r.created <= probed_at]
        spared = len(rooms) - len(failed)
        peer.misses = self.config.heartbeat_max_failures - 1 if spared else 0
        peer.incarnation, peer.dead = None, why
        if gone:  # a restarted process has another rank: look it up again
            self._drop_rank(self.encoders.forget_route(addr))
        for receiver in failed:
            receiver.handle(ev.PeerDead(why, gone))
        self.stats["peer_dead"] += 1
        log.error("encode peer %s declared dead: %s%s", addr, why,
                  f" ({spared} room(s) created since the last probe was sent wait for the next)" if spared else "")


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
