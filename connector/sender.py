"""Encode side of the connector: stage, place, write rounds, report status.

One :class:`EmbeddingSenderManager` per encode worker owns the source pool, its allocator, the
host staging budget, the transport, the PULL socket and the worker threads. Each request gets
an :class:`EmbeddingSender` (SGLang's ``BaseKVSender`` shape: ``send``, ``poll``,
``failure_exception``, ``abort``) plus ``admit`` and ``delivered`` for flow control.

A room's life (phases and transitions in :mod:`connector.sender_rooms`): ``Bootstrapping``
until every destination sent its init; the embedding arrives in host memory (``send``) and a
placer thread copies it into pool blocks; then one round of ``min(remaining, allocated)``
tokens is written at a time -> ``Transferring`` (partial: wait for a resume) or ``Success``.
Pool blocks are held by rooms a language peer has asked for, or lent to rooms nobody has asked
for yet while they are free, and taken back (copied to host memory) as soon as an asked-for
room needs them: no room waits for blocks held by a room that waits for it
(``docs/flow_control.md``). A room's source blocks are freed once it ended and no write of it
is in flight; aborts are acknowledged only then.

Locks, in this order only: the manager's ``_lock`` (rooms, peers, staging), then the
allocator's and a room state's own (leaves; the staging budget has none: it is used under
``_lock``). The placer copies rows between host memory and blocks outside it; only a sleep's
``detach_pool`` copies under it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import zmq

from connector.addressing import plan_round
from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.failures import FailureKind, TransferFailure, wire_reason
from connector.language_peers import LanguagePeers
from connector.messages import (
    AbortAckMsg,
    AbortMsg,
    InitMsg,
    PongMsg,
    ProtocolError,
    RegisterMsg,
    ResumeMsg,
    StatusMsg,
    SuspendAckMsg,
    SuspendMsg,
    check_blocks,
    decode_encoder_bound,
)
from connector.peer_health import FailingPeers
from connector.poll import KVPoll
from connector.rejections import Rejections
from connector.sender_rooms import Destination, SenderPhase, SenderRoom, Write
from connector.staging import ByteBudget
from connector.transport import TransferError, Transport
from connector.write_workers import WriteWorkers
from connector.zmq_link import PullLoop, PushSockets

log = logging.getLogger(__name__)

P = SenderPhase
_ENDED_GRACE_S = 60.0  # how long a finished room is remembered for late aborts and inits
_MAX_ENDED = 65_536  # ended rooms remembered at most (a flood of refusals cannot grow memory)


@dataclass
class SenderRoomCheckpoint:
    """A room kept over sleep: its whole source embedding (aux included) and how much was sent."""

    room: int
    sent_tokens: int
    data: Embedding
    destinations: int  # required_dst_info_num of its init; 0 before any init arrived


class EmbeddingSender:
    """One request's sending end; cheap, all work happens in the manager."""

    def __init__(self, manager: EmbeddingSenderManager, room: SenderRoom) -> None:
        self._manager, self._r, self.room = manager, room, room.room

    def admit(self, nbytes: int) -> Future:
        """Reserve host memory for the embedding to come; the future completes when granted
        (at once if the room's destinations have asked for it), or fails with the room."""
        return self._manager._admit(self._r, nbytes)

    def send(self, embedding: Embedding) -> None:
        """Hand over the whole embedding (aux set); the manager owns it from here."""
        self._manager._handover(self._r, embedding)

    @property
    def delivered(self) -> Future:
        """Completes once every destination has every token; fails with :class:`TransferFailure`."""
        return self._r.delivered

    def poll(self) -> KVPoll:
        return self._r.state.status

    @property
    def sent_tokens(self) -> int:
        return self._r.state.progress.sent_tokens

    @property
    def first_write_at(self) -> float | None:
        """``time.monotonic()`` when the first byte of this room started moving (None before)."""
        return self._r.first_write_at

    @property
    def phase(self) -> SenderPhase:
        return self._r.phase

    def wait_in_pool(self, timeout: float) -> bool:
        """Block until the embedding is in pool blocks (True), the room ended or time ran out."""
        return self._manager._wait_in_pool(self._r, timeout)

    @property
    def failure_reason(self) -> str:
        return self._r.state.reason

    def failure_exception(self) -> None:
        if self._r.state.status == KVPoll.Failed:
            raise self._r.state.failure(self.room)

    def abort(self, kind: FailureKind, reason: str) -> None:
        self._manager._abort_local(self._r, kind, reason)


class EmbeddingSenderManager:
    def __init__(self, config: ConnectorConfig, transport: Transport, pool: BufferPool,
                 allocator: BlockAllocator, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` is what the rooms' timeouts (bootstrap, resume, sleep) and the heartbeat are
        measured by; tests drive it by hand."""
        if pool.block_size != config.block_size or pool.hidden_size != config.hidden_size:
            raise ValueError("pool geometry does not match the connector config")
        self.config, self.transport, self.pool, self.allocator = config, transport, pool, allocator
        self.clock = clock
        self.stats: collections.Counter[str] = collections.Counter()
        self.rejections = Rejections(log)
        self.failing = FailingPeers()  # language peers whose rooms keep failing, for /health
        self.staging = ByteBudget(config.staging_bytes)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a write settled or data moved
        self._rooms: dict[int, SenderRoom] = {}
        self._ended: collections.OrderedDict[int, float] = collections.OrderedDict()  # room -> when it ended
        self._to_place: collections.deque[SenderRoom] = collections.deque()  # data in host memory, FIFO
        self._paused = False  # this worker sleeps: no write or placement starts, no timeout fires
        self._stop = threading.Event()
        transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
        self._context = zmq.Context()
        self._push = PushSockets(self._context, config.secret)
        self._pull = PullLoop(self._context, config.host, self._on_message, "encode-connector-pull", self.rejections,
                              config.secret)
        self.rank_port = self._pull.port
        self.peers = LanguagePeers(self._push, config.host, self.rank_port, config.heartbeat_interval,
                                   config.heartbeat_max_failures)
        self._writers: WriteWorkers[tuple[SenderRoom, Write]] = WriteWorkers(
            config.transfer_workers, "encode-transfer", self._run_write)
        self._threads = [threading.Thread(target=self._placer, name="encode-placer", daemon=True),
                         threading.Thread(target=self._housekeeping, name="encode-housekeeping", daemon=True)]
        for t in self._threads:
            t.start()

    # ---- API -------------------------------------------------------------------------------

    def create_sender(self, room: int) -> EmbeddingSender:
        """The sending end of ``room`` for one encode request. A room that already failed (its
        destination aborted it, or it was refused) is returned as it is: the caller sees the
        failure. ``ValueError`` when another request owns the room or it finished recently."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                r = self._new_room(room)
            elif r.claimed or r.phase == P.DONE or (r.live and r.has_data):
                raise ValueError(f"room {room} is already in use")
            r.claimed = True
            return EmbeddingSender(self, r)

    def refuse(self, room: int, kind: FailureKind, reason: str) -> None:
        """Fail ``room`` for an encode request that ends before it got a sender (asleep, bad
        input): its destinations, now or when their init comes, get ``Failed`` with the reason."""
        with self._lock:
            r = self._rooms.get(room) or self._new_room(room)
            if not r.claimed:  # a room another request owns is not this request's to fail
                self._fail(r, kind, reason)

    def asked_for(self, room: int) -> bool:
        """Every destination of ``room`` has sent its init: a language worker holds blocks for it."""
        with self._lock:
            r = self._rooms.get(room)
            return r is not None and r.live and r.inited

    def blocks_for(self, num_tokens: int) -> int:
        return self.pool.blocks_for(num_tokens)

    def staged_bytes_for(self, num_tokens: int) -> int:
        """Host memory an embedding of ``num_tokens`` takes while staged (what ``admit`` reserves)."""
        return num_tokens * (self.pool.row_bytes + 4 + 12)  # + an int32 fill id and three int32 M-RoPE positions

    def queue_stats(self) -> dict[str, int]:
        with self._lock:
            return {"staged_bytes": self.staging.used, "staging_waiting": self.staging.waiting,
                    "waiting_for_blocks": sum(1 for r in self._to_place if r.inited)}

    # ---- sleep ------------------------------------------------------------------------------

    def pause(self, timeout: float = 60.0) -> None:
        """Start no new write or placement and wait until none is under way (this worker sleeps)."""
        with self._lock:
            self._paused = True
            busy = lambda: any(r.in_flight or r.moving for r in self._rooms.values())  # noqa: E731
            if not self._changed.wait_for(lambda: not busy(), timeout):
                self._unpause()  # stay awake and go on
                raise TimeoutError(f"writes still in flight after {timeout:g}s")

    def abort_all(self, kind: FailureKind, reason: str) -> None:
        with self._lock:
            for r in list(self._rooms.values()):
                self._fail(r, kind, reason)

    def detach_pool(self) -> int:
        """Copy every room's source data to host memory, free the blocks, deregister the pool.
        Call after :meth:`pause`. Returns the bytes kept in host memory."""
        with self._lock:
            for r in self._rooms.values():
                if r.src_blocks is not None:
                    self._take_out_of_pool(r, self._copy_out(r.src_blocks, r.total_tokens))
            self.transport.unregister([b.ctypes.data for b in self.pool.buffers])
            return sum(_nbytes(r.staged) for r in self._rooms.values() if r.live and r.staged is not None)

    def held_rooms(self) -> list[SenderRoomCheckpoint]:
        """The rooms kept in host memory over a sleep, for a checkpoint on disk."""
        with self._lock:
            return [SenderRoomCheckpoint(r.room, r.state.progress.sent_tokens, r.staged, r.required_dsts)
                    for r in self._rooms.values() if r.live and r.staged is not None]

    def attach_pool(self, pool: BufferPool, allocator: BlockAllocator,
                    restored: list[SenderRoomCheckpoint] = ()) -> None:
        """Register a new pool (after sleep) and let placements and writes start again.

        ``restored`` are rooms from a checkpoint on disk (a restarted worker). Each waits,
        suspended, for the language side's init or resume, which rebinds it to whichever
        language session sends it.
        """
        with self._lock:
            taken = [saved.room for saved in restored if saved.room in self._rooms]
            if taken:
                raise ValueError(f"rooms {taken} are already in use")
            self.transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
            self.pool, self.allocator = pool, allocator
            now = self.clock()
            for saved in restored:
                r = self._new_room(saved.room)
                r.total_tokens, r.staged, r.required_dsts = saved.data.num_tokens, saved.data, saved.destinations
                self.staging.charge(r.room, _nbytes(saved.data))
                if saved.sent_tokens:
                    r.state.advance(KVPoll.Transferring, saved.sent_tokens)
                r.move(P.SUSPENDED)
            for r in self._rooms.values():
                r.deadline = max(r.deadline, now + self.config.resume_timeout)
            self._unpause()

    def _unpause(self) -> None:
        """Let writes and placements start again, beginning with those held back (lock held)."""
        self._paused = False
        for r in list(self._rooms.values()):
            self._maybe_start(r)
        self._changed.notify_all()

    def active_rooms(self) -> int:
        with self._lock:
            return sum(1 for r in self._rooms.values() if r.live)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._changed.notify_all()
        self._writers.close()
        for t in self._threads:
            t.join(timeout=10)
        self.peers.close()
        self._pull.close()
        self._push.close()
        self._context.term()
        self.transport.unregister([b.ctypes.data for b in self.pool.buffers])

    # ---- room bookkeeping (lock held) ----------------------------------------------------------

    def _new_room(self, room: int) -> SenderRoom:
        r = self._rooms[room] = SenderRoom(room, deadline=self.clock() + self.config.bootstrap_timeout,
                                              clock=self.clock)
        return r

    def _admit(self, r: SenderRoom, nbytes: int) -> Future:
        with self._lock:
            if not r.live:
                done: Future = Future()
                done.set_exception(r.state.failure(r.room))
                return done
            return self.staging.request(r.room, nbytes, urgent=r.inited)

    def _wait_in_pool(self, r: SenderRoom, timeout: float) -> bool:
        with self._lock:
            self._changed.wait_for(lambda: r.src_blocks is not None or not r.live, timeout)
            return r.src_blocks is not None

    def _handover(self, r: SenderRoom, embedding: Embedding) -> None:
        with self._lock:
            if r.has_data:
                raise ValueError(f"room {r.room}: send() called twice")
            if not r.live:  # aborted meanwhile: nothing to keep
                self.staging.release(r.room)
                return
            if self.pool.blocks_for(embedding.num_tokens) > self.allocator.num_blocks:
                raise ValueError(f"{embedding.num_tokens} tokens need more blocks than the pool's "
                                 f"{self.allocator.num_blocks}")
            r.staged, r.total_tokens = embedding, embedding.num_tokens
            self.staging.settle(r.room, _nbytes(embedding))
            if r.phase == P.AWAITING_DATA:
                r.move(P.READY)
            self._want_blocks(r)  # asked for or not: an idle pool lends it blocks

    def _maybe_start(self, r: SenderRoom) -> None:
        """Start the room's next round if all it needs is there; ask for blocks if only they lack."""
        if self._paused or r.moving or r.phase not in (P.READY, P.WRITING):
            return
        if r.src_blocks is None:
            self._want_blocks(r)
            return
        if not all(self.peers.may_write(d.session_id) for d in r.dsts):
            return  # a ping is out: its pong starts the round
        write = r.next_round()
        if write is None:
            return
        if r.writes:
            self.stats["pipelined_rounds"] += 1
        r.writes.append(write)
        if r.phase == P.READY:
            r.move(P.WRITING)
        if write.start == 0 and write.end < r.total_tokens and len(r.dsts) == 1:
            self._announce_total(r, r.dsts[0])
        self._writers.submit((r, write))

    def _announce_total(self, r: SenderRoom, d: Destination) -> None:
        """Tell one of our own language peers the total as an oversized first round starts, so it
        can allocate and resume while this round is written (fork peers never get this frame)."""
        if self.peers.speaks_ours(d.session_id):
            self._push.try_send(d.endpoint, d.port, StatusMsg(r.room, KVPoll.WaitingForInput, 0, "",
                                                              r.total_tokens).encode())

    def _fail(self, r: SenderRoom, kind: FailureKind, reason: str, notify: bool = True) -> None:
        """Fail a live room; tell its destinations; end it once nothing is in flight."""
        if not r.live or not r.state.fail(kind, reason):
            return
        self.stats[f"failed:{kind.value}"] += 1
        log.warning("room %d failed: %s", r.room, reason)
        for d in r.dsts:
            self.failing.failed(f"{d.endpoint}:{d.port}", kind, reason)
        if notify:
            status = StatusMsg(r.room, KVPoll.Failed, r.state.progress.sent_tokens, wire_reason(kind, reason))
            for d in r.dsts:
                self._tell_failed(r, d.endpoint, d.port, status)
        r.delivered.set_exception(r.state.failure(r.room))
        self.staging.release(r.room, TransferFailure(kind, reason))
        r.staged = None
        if r.in_flight:
            r.move(P.DRAINING)
            if all(write.done for write in r.writes):  # landed, their statuses held for a pong
                self._settle_writes(r)
        else:
            r.move(P.FAILED)
            self._end(r)

    def _tell_failed(self, r: SenderRoom | None, host: str, port: int, msg: StatusMsg) -> None:
        """Send a Failed status now, or once the room's writes have landed (see held_failures)."""
        frames = self._status_frames(host, port, msg)
        if r is not None and r.in_flight:
            r.held_failures.append((host, port, frames))
        else:
            self._push.try_send(host, port, frames)

    def _status_frames(self, host: str, port: int, msg: StatusMsg) -> list[bytes]:
        """Our status frames for our peers; the fork's two for any other (unknown ones included)."""
        return msg.encode(extended=self.peers.speaks_ours_at(host, port))

    def _send_ack(self, host: str, port: int, frames: list[bytes]) -> None:
        """An abort or suspend ack: only to a peer that speaks our extensions (a stranger may name
        a fork peer's address in an abort; that peer's receiving thread would die on the ack)."""
        if self.peers.speaks_ours_at(host, port):
            self._push.try_send(host, port, frames)

    def _end(self, r: SenderRoom) -> None:
        """The room ended and no write of it is in flight: free its blocks, send what waited."""
        if r.src_blocks is not None and not r.moving:  # a move in progress frees them when it ends
            self.allocator.free(r.src_blocks)
            r.src_blocks = None
            self._changed.notify_all()  # the placer may use them
        for host, port, frames in r.held_failures:  # before any ack, as _settle_writes does
            self._push.try_send(host, port, frames)
        r.held_failures.clear()
        for ack in r.pending_acks:
            self._send_ack(ack.endpoint, ack.dst_port, AbortAckMsg(r.room, ack.generation).encode())
        r.pending_acks.clear()
        self._send_suspend_acks(r)
        self._ended[r.room] = self.clock()
        self._ended.move_to_end(r.room)
        while len(self._ended) > _MAX_ENDED:
            self._rooms.pop(self._ended.popitem(last=False)[0], None)

    def _send_suspend_acks(self, r: SenderRoom) -> None:
        for ack in r.pending_suspend_acks:
            self._send_ack(ack.endpoint, ack.dst_port, SuspendAckMsg(r.room, ack.generation).encode())
        r.pending_suspend_acks.clear()

    def _abort_local(self, r: SenderRoom, kind: FailureKind, reason: str) -> None:
        with self._lock:
            self._fail(r, kind, reason)

    # ---- placement: host memory <-> pool blocks ------------------------------------------------

    def _placer(self) -> None:
        """Copies staged embeddings into pool blocks, and lent blocks back out, one at a time,
        outside the lock (a 4K image is 75 MB)."""
        while not self._stop.is_set():
            with self._lock:
                job = self._next_move()
                if job is None:
                    self._changed.wait(0.5)
                    continue
                r, blocks, placing = job
                r.moving = True
                staged = r.staged
            if placing:
                self.pool.write(blocks, staged)
            else:
                staged = self._copy_out(blocks, r.total_tokens)
            with self._lock:
                r.moving = False
                if placing and r.live and r.staged is staged:
                    r.src_blocks, r.staged = blocks, None
                    self.staging.release(r.room)
                    self.stats["placed"] += 1
                elif placing:  # ended while it was copied in
                    self.allocator.free(blocks)
                elif r.live:
                    self._take_out_of_pool(r, staged)
                    self.stats["evicted"] += 1
                elif r.src_blocks is not None:  # ended while it was copied out: _end left its blocks
                    self.allocator.free(r.src_blocks)
                    r.src_blocks = None
                self._maybe_start(r)
                self._changed.notify_all()

    def _next_move(self) -> tuple[SenderRoom, list[int], bool] | None:
        """The next copy: ``(room, blocks, True)`` places a staged room into ``blocks``;
        ``(room, its blocks, False)`` takes lent blocks back. Rooms a destination asked for come
        first, in order; rooms nobody asked for yet borrow free blocks (so the copy is done by
        the time their init comes) and give them back whenever an asked-for room needs them."""
        if self._paused:
            return None
        self._to_place = collections.deque(r for r in self._to_place if r.live and r.staged is not None
                                           and r.phase != P.SUSPENDED)
        asked = next((r for r in self._to_place if r.inited), None)
        if asked is None:
            head = self._to_place[0] if self._to_place else None
            blocks = self.allocator.allocate(self.pool.blocks_for(head.total_tokens)) if head else None
            if blocks is None:
                return None
            self._to_place.popleft()
            return head, blocks, True
        blocks = self.allocator.allocate(self.pool.blocks_for(asked.total_tokens))
        if blocks is not None:
            self._to_place.remove(asked)
            return asked, blocks, True
        lent = [r for r in self._rooms.values() if _lent(r)]
        if lent:  # newest first: the oldest is the likeliest to be asked for soon
            return lent[-1], lent[-1].src_blocks, False
        return None  # blocks come back as the asked-for rooms finish

    def _want_blocks(self, r: SenderRoom) -> None:
        if r.staged is not None and r not in self._to_place:
            self._to_place.append(r)
            self._changed.notify_all()

    def _copy_out(self, blocks: list[int], num_tokens: int) -> Embedding:
        out = Embedding.empty(num_tokens, self.pool.hidden_size, self.pool.dtype)
        self.pool.read_into(blocks, out, 0, num_tokens)
        out.aux[:] = self.pool.aux[blocks[0]]
        return out

    def _take_out_of_pool(self, r: SenderRoom, data: Embedding) -> None:
        """``data`` (read from the room's blocks) replaces them in host memory (lock held)."""
        self.allocator.free(r.src_blocks)
        r.src_blocks, r.staged = None, data
        self.staging.charge(r.room, _nbytes(data))
        if r.inited and r.phase != P.SUSPENDED:  # asked for: back into blocks as soon as it can
            self._want_blocks(r)
        self._changed.notify_all()

    # ---- control messages ------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = decode_encoder_bound(frames)
        except ProtocolError as exc:
            self.rejections.reject("malformed", str(exc))
            self._answer_undecodable(frames, str(exc))
            return
        with self._lock:
            if isinstance(msg, RegisterMsg):
                self._on_register(msg)
            elif isinstance(msg, PongMsg):
                self._on_pong(msg)
            elif isinstance(msg, AbortMsg):
                self._on_abort(msg)
            elif isinstance(msg, SuspendMsg):
                self._on_suspend(msg)
            else:
                self._on_round_request(msg)

    # Who may act on a room. Without the shared secret nothing on the wire proves who sent a
    # message, so these checks hold against peers that do not know a victim's endpoint, and
    # keep honest peers from acting on each other's rooms; the secret is what keeps strangers out.

    def _owns(self, r: SenderRoom, host: str, port: int) -> bool:
        """``host:port`` is the language endpoint of one of the room's destinations."""
        return any((d.endpoint, d.port) == (host, port) for d in r.dsts)

    def _may_control(self, r: SenderRoom | None, host: str, port: int) -> bool:
        """An abort or suspend from ``host:port`` may act on the room: it comes from the room's
        destination, or, for a room nobody has asked for yet (or one restored from this
        worker's checkpoint, whose destinations are not known), from a registered peer. A
        language worker restarted from its checkpoint listens at its old endpoint again."""
        if r is not None and r.dsts:
            return self._owns(r, host, port)
        return self.peers.registered_at(host, port)

    def _answer_undecodable(self, frames: list[bytes], reason: str) -> None:
        """A bad init/resume still names its room and reply address where those frames parse;
        the room fails only when that address is the room's own destination."""
        try:
            room, host, port = int(frames[0]), frames[1].decode("ascii"), int(frames[2])
        except (ValueError, IndexError, UnicodeDecodeError):
            return
        if 0 <= room < 2**63 and 0 < port < 65536:
            why = wire_reason(FailureKind.PROTOCOL, f"rejected message: {reason}")
            with self._lock:
                r = self._rooms.get(room)
                if r is not None and self._owns(r, host, port):
                    self._fail(r, FailureKind.PROTOCOL, f"bad message from {host}:{port}: {reason}", notify=False)
                else:
                    r = None  # a stranger's answer need not wait for the room's writes
                self._tell_failed(r, host, port, StatusMsg(room, KVPoll.Failed, 0, why))

    def _on_register(self, msg: RegisterMsg) -> None:
        mismatch = ""
        if len(msg.base_ptrs) < 4:
            mismatch = f"peer registered {len(msg.base_ptrs)} buffers, need 4"
        elif msg.item_lens is not None and tuple(msg.item_lens[:4]) != self.pool.item_lens:
            mismatch = (f"pool layout mismatch: peer item lengths {msg.item_lens[:4]} vs ours "
                        f"{self.pool.item_lens} (block size or hidden size differ)")
        busy = lambda: {d.session_id for r in self._rooms.values() if r.live for d in r.dsts}  # noqa: E731
        refused = self.peers.register(msg, mismatch, busy)
        if refused:
            limit = refused.endswith("all with live rooms")
            self.rejections.reject("register_limit" if limit else "register_conflict", refused)
        elif mismatch:
            log.warning("language peer %s: %s", msg.session_id, mismatch)

    def _on_pong(self, msg: PongMsg) -> None:
        outcome = self.peers.on_pong(msg)
        if outcome is None:
            return
        if outcome.refused_claim:
            self.rejections.reject("register_takeover", outcome.refused_claim)
        for session, gone in outcome.dropped:  # not the session living at that endpoint (any more)
            name = f"{gone.endpoint}:{gone.port}"
            if gone.order > outcome.answering.order:
                self.rejections.reject("register_takeover", f"session {session} registered for {name}, "
                                                             f"where {msg.session_id} answers: dropped")
            for r in list(self._rooms.values()):
                if any(d.session_id == session for d in r.dsts) and r.phase != P.SUSPENDED:
                    self._fail(r, FailureKind.PEER_FAILED, f"language peer {name} restarted", notify=False)
        if outcome.confirmed:
            for r in list(self._rooms.values()):
                if any(d.session_id == msg.session_id for d in r.dsts):
                    if r.writes and r.writes[0].done:  # landed while its status waited for this pong
                        self._settle_writes(r)
                    self._maybe_start(r)

    def _on_abort(self, msg: AbortMsg) -> None:
        r = self._rooms.get(msg.room)
        if not self._may_control(r, msg.endpoint, msg.dst_port):
            self.rejections.reject("not_owner", f"abort of room {msg.room} from {msg.endpoint}:{msg.dst_port}, "
                                                "which does not own it")
            return
        ack = AbortAckMsg(msg.room, msg.generation).encode()
        if r is None:  # aborted before this worker heard of the room: its encode request will fail
            r = self._new_room(msg.room)
        if r.phase == P.DRAINING:
            r.pending_acks.append(msg)
        elif not r.live:
            self._send_ack(msg.endpoint, msg.dst_port, ack)
        else:
            r.pending_acks.append(msg)  # sent when the room ends (nothing in flight then)
            self._fail(r, FailureKind.ABORTED, f"aborted by language peer {msg.endpoint}:{msg.dst_port}",
                       notify=False)

    def _on_suspend(self, msg: SuspendMsg) -> None:
        """The language side goes to sleep: write nothing more for the room, ack once idle."""
        r = self._rooms.get(msg.room)
        if r is not None and not self._may_control(r, msg.endpoint, msg.dst_port):
            self.rejections.reject("not_owner", f"suspend of room {msg.room} from {msg.endpoint}:{msg.dst_port}, "
                                                "which does not own it")
            return
        if r is None or not r.live:
            self._send_ack(msg.endpoint, msg.dst_port, SuspendAckMsg(msg.room, msg.generation).encode())
            return
        r.pending_suspend_acks.append(msg)
        if not r.in_flight:
            if r.phase != P.SUSPENDED:
                r.move(P.SUSPENDED)
            self._send_suspend_acks(r)

    def _on_round_request(self, msg: InitMsg | ResumeMsg) -> None:
        """An init or resume. One that cannot be served is answered ``Failed``; it also fails the
        room when its sender owns the room (or, for an init, when nobody has asked for it yet),
        so the blocks held for it come back at once and its ``/encode`` fails with the reason."""
        r = self._rooms.get(msg.room)
        kind, reason, owner = self._check_round_request(r, msg)
        if not reason:
            dst = Destination(msg.endpoint, msg.dst_port, msg.session_id, msg.block_ids, msg.allocated_tokens)
            if isinstance(msg, InitMsg):
                self._on_init(r if r is not None else self._new_room(msg.room), msg, dst)
            else:
                assert r is not None
                self._on_resume(r, msg, dst)
            return
        what = "init" if isinstance(msg, InitMsg) else "resume"
        detail = f"{what} of room {msg.room} from {msg.endpoint}:{msg.dst_port} (session {msg.session_id}): {reason}"
        self.rejections.reject("refused_round" if owner else "unregistered_session" if self.peers.get(
            msg.session_id) is None else "not_owner", detail)
        if owner:
            if r is None:
                r = self._new_room(msg.room)  # a tombstone: the encode request that comes fails at once
            self._fail(r, kind, detail, notify=False)
        self._tell_failed(r if owner else None, msg.endpoint, msg.dst_port, StatusMsg(msg.room, KVPoll.Failed, 0, wire_reason(kind, reason)))

    def _check_round_request(self, r: SenderRoom | None, msg: InitMsg | ResumeMsg) -> tuple[FailureKind, str, bool]:
        """``(kind, why it is refused, whether its sender may fail the room)``; no reason: serve it."""
        peer = self.peers.get(msg.session_id)
        if peer is None:
            return FailureKind.PROTOCOL, f"session {msg.session_id} never registered", False
        if peer.address != (msg.endpoint, msg.dst_port):
            return (FailureKind.PROTOCOL, f"session {msg.session_id} registered from {peer.endpoint}:{peer.port}",
                    False)
        # An init may fail a room nobody has asked for yet; a resume only one of its sender's rooms
        # (any registered peer's for a room restored from this worker's checkpoint: it has none).
        if isinstance(msg, InitMsg):
            owner = r is None or not r.dsts
        else:
            owner = r is not None and (self._owns(r, *peer.address) or (r.phase == P.SUSPENDED and not r.dsts))
            if r is not None and not owner:  # before any check that would tell a stranger its progress
                return FailureKind.PROTOCOL, f"resume for room {msg.room} from a peer that did not init it", False
        if peer.mismatch:
            return FailureKind.MISMATCH, peer.mismatch, owner
        try:
            check_blocks(msg.block_ids, msg.allocated_tokens, self.config.block_size, peer.num_blocks)
        except ProtocolError as exc:
            return exc.kind, str(exc), owner
        reason = self._check_resume(r, msg) if isinstance(msg, ResumeMsg) else ""
        return FailureKind.PROTOCOL, reason, owner

    def _on_init(self, r: SenderRoom, msg: InitMsg, dst: Destination) -> None:
        held = r if self._owns(r, msg.endpoint, msg.dst_port) else None  # see _tell_failed
        if not r.live:  # failed (aborted, refused) or finished: say so, with the reason
            kind = r.state.kind or FailureKind.CONFLICT
            why = r.state.reason or f"room {r.room} already finished"
            self._tell_failed(held, msg.endpoint, msg.dst_port, StatusMsg(r.room, KVPoll.Failed, 0, wire_reason(kind, why)))
            return
        if r.phase == P.SUSPENDED and not r.dsts:  # restored from disk, asked for again from token 0
            r.move(P.BOOTSTRAPPING)
        if r.phase != P.BOOTSTRAPPING or r.inited:
            self._tell_failed(held, msg.endpoint, msg.dst_port, StatusMsg(
                r.room, KVPoll.Failed, 0, wire_reason(FailureKind.CONFLICT, f"room {r.room} already initialised")))
            return
        r.required_dsts = msg.required_dst_info_num
        r.dsts.append(dst)
        if r.inited:
            r.state.advance(KVPoll.WaitingForInput)
            r.move(P.READY if r.has_data else P.AWAITING_DATA)
            self.staging.promote(r.room)
            self._maybe_start(r)
            self._changed.notify_all()  # the placer serves asked-for rooms first

    def _on_resume(self, r: SenderRoom, msg: ResumeMsg, dst: Destination) -> None:
        if r.phase == P.WRITING:  # early resume: its round starts right away
            slot = r.dsts[0]
            slot.block_ids, slot.allocated_tokens, slot.ready = msg.block_ids, msg.allocated_tokens, True
            self._maybe_start(r)
            return
        if r.phase == P.SUSPENDED:  # woken or restarted language side (or encoder): rebind
            r.dsts, r.required_dsts = [dst], 1
        else:
            slot = next(d for d in r.dsts if d.session_id == msg.session_id)
            slot.block_ids, slot.allocated_tokens, slot.ready = msg.block_ids, msg.allocated_tokens, True
        if all(d.ready for d in r.dsts):
            r.state.advance(KVPoll.WaitingForInput, msg.sent_tokens)
            r.move(P.READY if r.has_data else P.AWAITING_DATA)
            self._maybe_start(r)

    def _check_resume(self, r: SenderRoom | None, msg: ResumeMsg) -> str:
        if r is None or not r.live:
            return f"resume for unknown or finished room {msg.room}"
        progress = r.state.progress
        if r.phase == P.SUSPENDED:  # after a sleep: any state, as long as progress agrees
            if max(len(r.dsts), r.required_dsts) > 1:
                return (f"room {msg.room} has {max(len(r.dsts), r.required_dsts)} destinations; "
                        "only one can be resumed after sleep")
            if msg.sent_tokens != progress.sent_tokens:
                return f"resume after sleep at sent_tokens {msg.sent_tokens} != {progress.sent_tokens} already sent"
            return ""
        if not any(d.session_id == msg.session_id for d in r.dsts):
            return f"resume for room {msg.room} from session {msg.session_id}, which did not init it"
        if r.phase == P.WRITING:
            if len(r.writes) == 1 and len(r.dsts) == 1 and msg.sent_tokens == r.round_end < r.total_tokens:
                return ""  # early: it continues where the round being written ends
            return f"resume for room {msg.room} at {msg.sent_tokens} while tokens up to {r.round_end} are being written"
        if r.phase != P.AWAITING_RESUME:
            return f"resume for room {msg.room} in state {progress.status.name}"
        if msg.sent_tokens != progress.sent_tokens:
            return f"resume sent_tokens {msg.sent_tokens} != {progress.sent_tokens} already sent"
        return ""

    # ---- writes ----------------------------------------------------------------------------

    def _run_write(self, job: tuple[SenderRoom, Write]) -> None:
        r, write = job
        if r.first_write_at is None:
            r.first_write_at = time.monotonic()
        try:
            error = "" if r.phase == P.DRAINING else self._write_round(r, write)
        except Exception as exc:  # a bug or an engine error fails the room, never this worker
            log.exception("room %d: write failed unexpectedly", r.room)
            error = f"write failed unexpectedly: {type(exc).__name__}: {exc}"
        with self._lock:
            write.done = True
            if error:
                self._fail(r, FailureKind.TRANSFER, error)
            self._settle_writes(r)
            self._changed.notify_all()

    def _write_round(self, r: SenderRoom, write: Write) -> str:
        assert r.src_blocks is not None
        bs, start = self.config.block_size, write.start
        first_src = start // bs
        tokens = write.end - start  # the same for every destination: the smallest allocation
        for d in write.dsts:
            peer = self.peers.get(d.session_id)
            if peer is None:
                return f"language peer session {d.session_id} is gone"
            plan = plan_round(r.src_blocks[first_src:], list(d.block_ids), tokens, bs, self.pool.base_ptrs,
                              peer.base_ptrs, self.pool.item_lens, with_aux=start == 0)
            try:
                self.transport.write(d.session_id, plan.src_addrs, plan.dst_addrs, plan.lengths)
            except TransferError as exc:
                return f"transfer to language peer {d.endpoint}:{d.port} failed: {exc}"
            self.stats["bytes_sent"] += plan.nbytes
        return ""

    def _settle_writes(self, r: SenderRoom) -> None:
        """Report finished rounds in token order (a round written beside an earlier one waits for
        it), then end the room or go on with what comes next. After a stall of this process a
        round's status also waits for its sessions' pongs: a round that landed after its peer
        gave up on the room must not be reported as delivered (the abort comes first)."""
        if not r.live and r.phase != P.DRAINING:
            return  # ended already (a failed write's _fail settled it)
        while r.writes and r.writes[0].done:
            if r.phase != P.DRAINING and not all(self.peers.may_write(d.session_id) for d in r.writes[0].dsts):
                return  # _on_pong settles it
            write = r.writes.pop(0)
            if r.phase == P.DRAINING:
                continue
            status = KVPoll.Success if write.end >= r.total_tokens else KVPoll.Transferring
            r.state.advance(status, write.end)
            # The resume wait starts before the peer can hear of the round (and answer it).
            r.deadline = self.clock() + self.config.resume_timeout
            # The status goes out before any ack _end sends: a peer that sees the ack must
            # already know how the round ended.
            for d in write.dsts:
                self._push.try_send(d.endpoint, d.port, self._status_frames(d.endpoint, d.port,
                                                                            StatusMsg(r.room, status, write.end)))
        if r.writes:
            return
        if r.phase == P.DRAINING:
            r.move(P.FAILED)
            self._end(r)
        elif r.state.status == KVPoll.Success:
            r.move(P.DONE)
            for d in r.dsts:
                self.failing.succeeded(f"{d.endpoint}:{d.port}")
            r.delivered.set_result(None)
            self._end(r)
        elif r.pending_suspend_acks:
            r.move(P.SUSPENDED)
            self._send_suspend_acks(r)
        elif all(d.ready for d in r.dsts):  # resumed early, but the next round could not start yet
            r.move(P.READY)
            self._maybe_start(r)
        else:
            r.move(P.AWAITING_RESUME)

    # ---- timeouts and liveness -------------------------------------------------------------------

    def _housekeeping(self) -> None:
        next_beat = self.clock() + self.config.heartbeat_interval
        while not self._stop.wait(0.25):
            now = self.clock()
            with self._lock:
                self._expire_ended(now)
                if self._paused:
                    continue
                for r in list(self._rooms.values()):
                    self._check_timeout(r, now)
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval
                    self._beat()

    def _expire_ended(self, now: float) -> None:
        while self._ended and now - next(iter(self._ended.values())) > _ENDED_GRACE_S:
            room, _ = self._ended.popitem(last=False)
            r = self._rooms.get(room)
            if r is not None and not r.live and r.phase != P.DRAINING:
                del self._rooms[room]

    def _check_timeout(self, r: SenderRoom, now: float) -> None:
        if r.phase == P.SUSPENDED:
            if now - r.suspended_at > self.config.max_sleep:
                self._fail(r, FailureKind.TIMEOUT, f"language peer slept longer than {self.config.max_sleep:g}s")
        elif now < r.deadline:
            return
        elif r.phase == P.AWAITING_RESUME:
            self._fail(r, FailureKind.TIMEOUT, f"no resume within {self.config.resume_timeout:g}s")
        elif r.phase in (P.BOOTSTRAPPING, P.AWAITING_DATA):
            what = "init" if r.phase == P.BOOTSTRAPPING else "encoded data"
            self._fail(r, FailureKind.TIMEOUT, f"bootstrap, no {what} within {self.config.bootstrap_timeout:g}s")

    def _beat(self) -> None:
        # A session whose rooms are all suspended may be a language worker restarting from its
        # checkpoint: those rooms wait (up to max_sleep), as its peers' rooms wait for it.
        live = {d.session_id for r in self._rooms.values() if r.live and r.phase != P.SUSPENDED for d in r.dsts}
        for session, why in self.peers.beat(live):
            peer = self.peers.get(session)
            name = f"{peer.endpoint}:{peer.port}" if peer else session
            log.error("language peer %s (session %s) declared dead: %s", name, session, why)
            self.stats["peer_dead"] += 1
            for r in list(self._rooms.values()):
                if any(d.session_id == session for d in r.dsts):
                    self._fail(r, FailureKind.PEER_DEAD, f"language peer {name} is dead: {why}")


def _nbytes(emb: Embedding) -> int:
    return emb.embeddings.nbytes + emb.fill_ids.nbytes + emb.mrope_positions.nbytes


def _lent(r: SenderRoom) -> bool:
    """Blocks held by a room no destination is waiting on: they can be taken back."""
    return (r.src_blocks is not None and not r.moving and not r.in_flight
            and r.phase in (P.BOOTSTRAPPING, P.SUSPENDED))
