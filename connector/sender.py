"""Encode side of the connector: the manager that runs the rooms' state machines.

One :class:`EmbeddingSenderManager` per encode worker owns the source pool, its allocator, the
host staging budget, the transport, the PULL socket and the worker threads. Each request gets
an :class:`EmbeddingSender` (SGLang's ``BaseKVSender`` shape: ``send``, ``poll``,
``failure_exception``, ``abort``) plus ``admit`` and ``delivered`` for flow control.

A room's life is :mod:`connector.sender_rooms` (its phases, their one transition table, and
``SenderRoom.on``, the only place a phase changes): ``Bootstrapping`` until every destination
sent its init; the embedding arrives in host memory (``send``) and a placer thread copies it
into pool blocks (:mod:`connector.placement` picks what moves next); then one round of
``min(remaining, allocated)`` tokens is written at a time -> ``Transferring`` (partial: wait
for a resume) or ``Success``. This module turns what happens (a message, a landed write, a
copy, the clock) into events for the room and applies the effects the room returns: it owns
the sockets, threads and locks. Who may act on a room (registry, ownership) is checked here,
before an event is made; :mod:`connector.language_peers` keeps the registry and heartbeats.

Locks, in this order only: the manager's ``_lock`` (rooms, peers, staging), then the
allocator's and a room state's own (leaves; the staging budget has none: it is used under
``_lock``). Rows are copied between host memory and blocks outside it (the placer, a sleep's
``detach_pool``); the room is marked moving meanwhile, so its blocks stay until the copy ends.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from connector import sender_rooms as ev
from connector.addressing import plan_round
from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.failures import FailureKind, wire_reason
from connector.language_peers import LanguagePeer, LanguagePeers, PeerKey
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
from connector.placement import PlacementQueue, copy_out
from connector.poll import KVPoll
from connector.rejections import Rejections
from connector.sender_rooms import Destination, SenderPhase, SenderRoom, Timeouts, World, Write, embedding_nbytes
from connector.staging import ByteBudget
from connector.transport import TransferError, Transport, WriteUnsettled
from connector.write_workers import WriteWorkers
from connector.zmq_link import PullLoop, PushSockets

log = logging.getLogger(__name__)

P = SenderPhase
_ENDED_GRACE_S = 60.0  # how long a finished room is remembered for late aborts and inits
_MAX_ENDED = 65_536  # ended rooms remembered at most (a flood of refusals cannot grow memory)
# A write that fails is made once more before its room fails: the first write to a peer after a
# partition heals can go over a connection that peer closed meanwhile, and fail where a new one
# succeeds. The same bytes to the same blocks, still the room's: a late byte of the first changes
# nothing.
WRITE_ATTEMPTS = 2
# A write given up on while Mooncake still holds parts of it keeps its room draining (source
# blocks held, Failed status and abort ack not sent) until they settle, or this long: a connect
# Mooncake made into a cut link fails after TCP's SYN retries (127 s at Linux's defaults).
HELD_WRITE_MAX_S = 180.0


@dataclass
class SenderRoomCheckpoint:
    """A room kept over sleep: its whole source embedding (aux included) and how much was sent."""

    room: int
    sent_tokens: int
    data: Embedding
    destinations: int  # required_dst_info_num of its init; 0 before any init arrived


@dataclass
class _Answer:
    """What the manager keeps of a room for its encode request, beside the state machine."""

    delivered: Future = field(default_factory=Future)  # None once every destination has it all
    first_write_at: float | None = None  # time.monotonic() as the first round's write began


@dataclass
class _HeldWrite:
    """A write given up on whose parts Mooncake still holds: its room waits until they settle."""

    room: SenderRoom
    write: Write
    error: str
    settled: Callable[[], bool]
    since: float  # the manager's clock


class EmbeddingSender:
    """One request's sending end; cheap, all work happens in the manager."""

    def __init__(self, manager: EmbeddingSenderManager, room: SenderRoom, answer: _Answer) -> None:
        self._manager, self._r, self._answer, self.room = manager, room, answer, room.room

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
        return self._answer.delivered

    def poll(self) -> KVPoll:
        return self._r.state.status

    @property
    def sent_tokens(self) -> int:
        return self._r.state.progress.sent_tokens

    @property
    def first_write_at(self) -> float | None:
        """``time.monotonic()`` when the first byte of this room started moving (None before)."""
        return self._answer.first_write_at

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
        self.timeouts = Timeouts(config.bootstrap_timeout, config.resume_timeout, config.max_sleep)
        self.stats: collections.Counter[str] = collections.Counter()
        self.rejections = Rejections(log)
        self.failing = FailingPeers()  # language peers whose rooms keep failing, for /health
        self.staging = ByteBudget(config.staging_bytes)
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a write settled or data moved
        self._rooms: dict[int, SenderRoom] = {}
        self._answers: dict[int, _Answer] = {}  # beside each room of _rooms
        self._ended: collections.OrderedDict[int, float] = collections.OrderedDict()  # room -> when it ended
        self._held_writes: list[_HeldWrite] = []
        self._to_place = PlacementQueue()  # data in host memory waiting for blocks
        self._paused = False  # this worker sleeps: no write or placement starts, no timeout fires
        self._stop = threading.Event()
        transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
        self._context = zmq.Context()
        self._push = PushSockets(self._context, config.secret)
        self._pull = PullLoop(self._context, config.host, self._on_message, "encode-connector-pull", self.rejections,
                              config.secret)
        self.rank_port = self._pull.port
        self.peers = LanguagePeers(self._push, config.public_host, self.rank_port, config.heartbeat_interval,
                                   config.heartbeat_max_failures, self.clock)
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
            elif not r.claimable:
                raise ValueError(f"room {room} is already in use")
            self._dispatch(r, ev.Claimed())
            return EmbeddingSender(self, r, self._answers[room])

    def refuse(self, room: int, kind: FailureKind, reason: str) -> None:
        """Fail ``room`` for an encode request that ends before it got a sender (asleep, bad
        input): its destinations, now or when their init comes, get ``Failed`` with the reason."""
        with self._lock:
            r = self._rooms.get(room) or self._new_room(room)
            if not r.claimed:  # a room another request owns is not this request's to fail
                self._dispatch(r, ev.Fail(kind, reason))

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
                    "waiting_for_blocks": self._to_place.waiting_for_blocks()}

    # ---- sleep ------------------------------------------------------------------------------

    def pause(self, timeout: float = 60.0) -> None:
        """Start no new write or placement and wait until none is under way (this worker sleeps).
        Refused at once while Mooncake holds a write given up on (it may take minutes to settle)."""
        with self._lock:
            if self._held_writes:
                rooms = ", ".join(str(held.room.room) for held in self._held_writes)
                raise TimeoutError(f"Mooncake still holds writes given up on (rooms {rooms}): they settle once "
                                   f"their link returns or its connect fails, within {HELD_WRITE_MAX_S:g}s")
            self._paused = True
            busy = lambda: any(r.in_flight or r.moving for r in self._rooms.values())  # noqa: E731
            if not self._changed.wait_for(lambda: not busy(), timeout):
                self._unpause()  # stay awake and go on
                raise TimeoutError(f"writes still in flight after {timeout:g}s")

    def abort_all(self, kind: FailureKind, reason: str) -> None:
        with self._lock:
            for r in list(self._rooms.values()):
                self._dispatch(r, ev.Fail(kind, reason))

    def detach_pool(self) -> int:
        """Copy every room's source data to host memory, free the blocks, deregister the pool.
        Call after :meth:`pause`. Returns the bytes kept in host memory. The copies run outside
        the lock, as the placer's do (a room that ends meanwhile leaves its blocks to its copy)."""
        with self._lock:
            moves = [(r, r.src_blocks, r.total_tokens) for r in self._rooms.values()
                     if r.src_blocks is not None and not r.moving]
            for r, _, _ in moves:
                self._dispatch(r, ev.MoveStarted())
        copies = [copy_out(self.pool, blocks, num_tokens) for _, blocks, num_tokens in moves]
        with self._lock:
            for (r, _, _), data in zip(moves, copies, strict=True):
                self._dispatch(r, ev.TakenOut(data))
            self.transport.unregister([b.ctypes.data for b in self.pool.buffers])
            return sum(embedding_nbytes(r.staged) for r in self._rooms.values() if r.live and r.staged is not None)

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
            for saved in restored:
                self._dispatch(self._new_room(saved.room), ev.Restored(saved.data, saved.sent_tokens,
                                                                       saved.destinations))
            for r in list(self._rooms.values()):
                self._dispatch(r, ev.Woken())
            self._unpause()

    def _unpause(self) -> None:
        """Let writes and placements start again, beginning with those held back (lock held)."""
        self._paused = False
        for r in list(self._rooms.values()):
            self._dispatch(r, ev.Kick())
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

    # ---- running a room's state machine (lock held) ----------------------------------------------

    def _new_room(self, room: int) -> SenderRoom:
        r = self._rooms[room] = SenderRoom(room, self.timeouts, deadline=self.clock() + self.config.bootstrap_timeout)
        self._answers[room] = _Answer()
        return r

    def _world(self, r: SenderRoom, event: ev.Event) -> World:
        if isinstance(event, ev.Tick):  # a timeout check needs only the time (it runs every 0.25 s)
            return World(self.clock(), self._paused)
        peers = r.peers() | ({event.dst.peer} if isinstance(event, ev.Init | ev.Resume) else set())
        return World(self.clock(), self._paused, frozenset(p for p in peers if self.peers.writable(p)))

    def _dispatch(self, r: SenderRoom, event: ev.Event) -> None:
        """Give ``event`` to the room and do what it asks, in order."""
        effects = r.on(event, self._world(r, event))
        for effect in effects:
            self._apply(r, effect)
        if effects or not isinstance(event, ev.Tick):  # a quiet tick wakes no waiter
            self._changed.notify_all()

    def _apply(self, r: SenderRoom, effect: ev.Effect) -> None:
        match effect:
            case ev.SendStatus(host, port, status):
                self._push.try_send(host, port, self._status_frames(host, port, status))
            case ev.SendAck(host, port, ack):
                self._send_ack(host, port, ack)
            case ev.AnnounceJoined(d):
                self._announce(d, StatusMsg(r.room, KVPoll.WaitingForInput, 0))
            case ev.AnnounceTotal(d):
                self._announce(d, StatusMsg(r.room, KVPoll.WaitingForInput, 0, "", r.total_tokens))
            case ev.StartWrite(write):
                self._writers.submit((r, write))
            case ev.FreeBlocks(block_ids):
                self.allocator.free(block_ids)
            case ev.WantBlocks():
                self._to_place.add(r)
            case ev.StagingSettle(nbytes):
                self.staging.settle(r.room, nbytes)
            case ev.StagingCharge(nbytes):
                self.staging.charge(r.room, nbytes)
            case ev.StagingPromote():
                self.staging.promote(r.room)
            case ev.StagingRelease(error):
                self.staging.release(r.room, error)
            case ev.Delivered(failure):
                answer = self._answers[r.room]
                if failure is None:
                    log.info("room %d delivered", r.room)
                    answer.delivered.set_result(None)
                else:
                    answer.delivered.set_exception(failure)
            case ev.RoomFailed(kind, reason):
                self.stats[f"failed:{kind.value}"] += 1
                log.warning("room %d failed: %s", r.room, reason)
            case ev.PeerFailed(peer, kind, reason, joined):
                self.failing.failed(peer, kind, reason, joined)
            case ev.PeerSucceeded(peer):
                self.failing.succeeded(peer)
            case ev.Confirm(peers):
                for peer in peers:
                    self.peers.confirm(peer)
            case ev.Count(stat, n):
                self.stats[stat] += n
            case ev.Ended():
                self._ended[r.room] = self.clock()
                self._ended.move_to_end(r.room)
                while len(self._ended) > _MAX_ENDED:
                    self._drop(self._ended.popitem(last=False)[0])

    def _announce(self, dst: Destination, status: StatusMsg) -> None:
        """A status of our extensions (the room is real; its total): fork peers never get it."""
        if self.peers.speaks_ours(dst.peer):
            self._push.try_send(dst.endpoint, dst.port, status.encode())

    def _send_ack(self, host: str, port: int, ack: AbortAckMsg | SuspendAckMsg) -> None:
        """Only to a peer that speaks our extensions (a stranger may name a fork peer's address
        in an abort; that peer's receiving thread would die on the ack)."""
        if self.peers.speaks_ours_at(host, port):
            self._push.try_send(host, port, ack.encode())

    def _drop(self, room: int) -> None:
        self._rooms.pop(room, None)
        self._answers.pop(room, None)

    def _status_frames(self, host: str, port: int, msg: StatusMsg) -> list[bytes]:
        """Our status frames for our peers; the fork's two for any other (unknown ones included)."""
        return msg.encode(extended=self.peers.speaks_ours_at(host, port))

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
            if r.live and self.pool.blocks_for(embedding.num_tokens) > self.allocator.num_blocks:
                raise ValueError(f"{embedding.num_tokens} tokens need more blocks than the pool's "
                                 f"{self.allocator.num_blocks}")
            self._dispatch(r, ev.Handover(embedding))

    def _abort_local(self, r: SenderRoom, kind: FailureKind, reason: str) -> None:
        with self._lock:
            self._dispatch(r, ev.Fail(kind, reason))

    # ---- placement: host memory <-> pool blocks ------------------------------------------------

    def _placer(self) -> None:
        """Runs the copies :mod:`connector.placement` picks, one at a time, outside the lock."""
        while not self._stop.is_set():
            with self._lock:
                move = None if self._paused else self._to_place.next_move(self.allocator, self.pool,
                                                                          self._rooms.values())
                if move is None:
                    self._changed.wait(0.5)
                    continue
                r = move.room
                self._dispatch(r, ev.MoveStarted())
                staged, total = r.staged, r.total_tokens
            if move.placing:
                self.pool.write(list(move.blocks), staged)
                done: ev.Event = ev.Placed(move.blocks)
            else:
                done = ev.TakenOut(copy_out(self.pool, move.blocks, total))
            with self._lock:
                if not move.placing and r.live:
                    self.stats["evicted"] += 1
                self._dispatch(r, done)

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
            elif isinstance(msg, AbortMsg | SuspendMsg):
                self._on_control(msg)
            else:
                self._on_round_request(msg)

    # Who may act on a room. Without the shared secret nothing on the wire proves who sent a
    # message, so these checks hold against peers that do not know a victim's endpoint, and
    # keep honest peers from acting on each other's rooms; the secret is what keeps strangers out.

    def _may_control(self, r: SenderRoom | None, host: str, port: int) -> bool:
        """An abort or suspend from ``host:port`` may act on the room: it comes from the room's
        destination, or, for a room nobody has asked for yet (or one restored from this
        worker's checkpoint, whose destinations are not known), from a registered peer. A
        language worker restarted from its checkpoint listens at its old endpoint again."""
        if r is not None and r.dsts:
            return r.owned_by(host, port)
        return self.peers.registered_at(host, port)

    def _answer_undecodable(self, frames: list[bytes], reason: str) -> None:
        """A bad init/resume still names its room and reply address where those frames parse;
        the room fails only when that address is the room's own destination."""
        try:
            room, host, port = int(frames[0]), frames[1].decode("ascii"), int(frames[2])
        except (ValueError, IndexError, UnicodeDecodeError):
            return
        if 0 <= room < 2**63 and 0 < port < 65536:
            status = StatusMsg(room, KVPoll.Failed, 0, wire_reason(FailureKind.PROTOCOL, f"rejected message: {reason}"))
            with self._lock:
                r = self._rooms.get(room)
                if r is not None and r.owned_by(host, port):
                    self._dispatch(r, ev.Fail(FailureKind.PROTOCOL, f"bad message from {host}:{port}: {reason}",
                                              notify=False))
                    self._dispatch(r, ev.Refused(host, port, status))
                else:  # a stranger's answer need not wait for the room's writes
                    self._push.try_send(host, port, self._status_frames(host, port, status))

    def _on_register(self, msg: RegisterMsg) -> None:
        mismatch = ""
        if len(msg.base_ptrs) < 4:
            mismatch = f"peer registered {len(msg.base_ptrs)} buffers, need 4"
        elif msg.item_lens is not None and tuple(msg.item_lens[:4]) != self.pool.item_lens:
            mismatch = (f"pool layout mismatch: peer item lengths {msg.item_lens[:4]} vs ours "
                        f"{self.pool.item_lens} (block size or hidden size differ)")
        busy = lambda: {d.peer for r in self._rooms.values() if r.live for d in r.dsts}  # noqa: E731
        known = self.peers.registered_at(msg.endpoint, msg.dst_port)
        refused = self.peers.register(msg, mismatch, busy)
        if refused:
            limit = refused.endswith("all with live rooms")
            self.rejections.reject("register_limit" if limit else "register_conflict", refused)
        elif mismatch:
            log.warning("language peer %s: %s", msg.session_id, mismatch)
        elif not known:
            log.info("language peer registered: zmq=tcp://%s:%d mooncake=%s generation %s", msg.endpoint, msg.dst_port,
                     msg.session_id, msg.generation)

    def _on_pong(self, msg: PongMsg) -> None:
        outcome = self.peers.on_pong(msg)
        if outcome is None:
            return
        for why in outcome.refused:
            self.rejections.reject("register_takeover", why)
        for (session, host, port), gone in outcome.dropped:  # not the session living at that endpoint (any more)
            name = f"{host}:{port}"
            if gone.order > outcome.order:
                self.rejections.reject("register_takeover", f"session {session} registered for {name}, "
                                                             f"where {msg.session_id} answers: dropped")
            for r in list(self._rooms.values()):
                if any(d.peer == (session, host, port) for d in r.dsts) and r.phase != P.SUSPENDED:
                    self._dispatch(r, ev.Fail(FailureKind.PEER_FAILED, f"language peer {name} restarted",
                                              notify=False))
        if outcome.confirmed:
            for r in list(self._rooms.values()):
                if any(d.peer == outcome.answering for d in r.dsts):
                    self._dispatch(r, ev.Kick())

    def _on_control(self, msg: AbortMsg | SuspendMsg) -> None:
        """An abort, or a suspend (the language side goes to sleep), from a room's owner."""
        r = self._rooms.get(msg.room)
        what = "abort" if isinstance(msg, AbortMsg) else "suspend"
        if not self._may_control(r, msg.endpoint, msg.dst_port):
            self.rejections.reject("not_owner", f"{what} of room {msg.room} from {msg.endpoint}:{msg.dst_port}, "
                                                "which does not own it")
            return
        if isinstance(msg, AbortMsg):
            if r is None:  # aborted before this worker heard of the room: its encode request will fail
                r = self._new_room(msg.room)
            elif not r.live and r.state.status == KVPoll.Success:
                # Its last round landed and its /encode answered 200 while the abort was on its
                # way (the language side stopping, or its client gone): say so, nothing to undo.
                self.stats["aborted_after_delivery"] += 1
                log.info("room %d: aborted by language peer %s:%d after its embedding was delivered", msg.room,
                         msg.endpoint, msg.dst_port)
            self._dispatch(r, ev.Abort(msg))
        elif r is None:
            self._send_ack(msg.endpoint, msg.dst_port, SuspendAckMsg(msg.room, msg.generation))
        else:
            self._dispatch(r, ev.Suspend(msg))

    def _on_round_request(self, msg: InitMsg | ResumeMsg) -> None:
        """An init or resume. One that cannot be served is answered ``Failed``; it also fails the
        room when its sender owns the room (or, for an init, when nobody has asked for it yet),
        so the blocks held for it come back at once and its ``/encode`` fails with the reason."""
        r = self._rooms.get(msg.room)
        kind, reason, owner = self._check_round_request(r, msg)
        if not reason:
            dst = Destination(msg.endpoint, msg.dst_port, msg.session_id, msg.block_ids, msg.allocated_tokens)
            if isinstance(msg, InitMsg):
                self._dispatch(r if r is not None else self._new_room(msg.room), ev.Init(dst, msg.required_dst_info_num))
            else:
                assert r is not None
                self._dispatch(r, ev.Resume(dst, msg.sent_tokens))
            return
        what = "init" if isinstance(msg, InitMsg) else "resume"
        detail = f"{what} of room {msg.room} from {msg.endpoint}:{msg.dst_port} (session {msg.session_id}): {reason}"
        self.rejections.reject("refused_round" if owner else "unregistered_session" if not self.peers.addresses_of(
            msg.session_id) else "not_owner", detail)
        status = StatusMsg(msg.room, KVPoll.Failed, 0, wire_reason(kind, reason))
        if owner:
            if r is None:
                r = self._new_room(msg.room)  # a tombstone: the encode request that comes fails at once
            self._dispatch(r, ev.Fail(kind, detail, notify=False))
            self._dispatch(r, ev.Refused(msg.endpoint, msg.dst_port, status))
        else:
            self._push.try_send(msg.endpoint, msg.dst_port, self._status_frames(msg.endpoint, msg.dst_port, status))

    def _check_round_request(self, r: SenderRoom | None, msg: InitMsg | ResumeMsg) -> tuple[FailureKind, str, bool]:
        """``(kind, why it is refused, whether its sender may fail the room)``; no reason: serve it."""
        pools = self.peers.pools((msg.session_id, msg.endpoint, msg.dst_port))
        if not pools:  # (where else it registered is not told: the reason goes back to the sender)
            return (FailureKind.PROTOCOL, f"session {msg.session_id} never registered from "
                                          f"{msg.endpoint}:{msg.dst_port}", False)
        # An init may fail a room nobody has asked for yet; a resume only one of its sender's rooms
        # (any registered peer's for a room restored from this worker's checkpoint: it has none).
        if isinstance(msg, InitMsg):
            owner = r is None or not r.dsts
        else:
            owner = r is not None and (r.owned_by(msg.endpoint, msg.dst_port)
                                       or (r.phase == P.SUSPENDED and not r.dsts))
            if r is not None and not owner:  # before any check that would tell a stranger its progress
                return FailureKind.PROTOCOL, f"resume for room {msg.room} from a peer that did not init it", False
        # Until its endpoint settles which pool is its own, the request is served if one fits.
        refusals = [self._pool_refusal(p, msg) for p in pools]
        if all(refusals):
            kind, reason = refusals[0]
            return kind, reason, owner
        if isinstance(msg, ResumeMsg):
            reason = (f"resume for unknown or finished room {msg.room}" if r is None
                      else r.resume_refusal(msg.session_id, msg.sent_tokens))
            return FailureKind.PROTOCOL, reason, owner
        return FailureKind.PROTOCOL, "", owner

    def _pool_refusal(self, peer: LanguagePeer, msg: InitMsg | ResumeMsg) -> tuple[FailureKind, str] | None:
        """Why ``msg``'s blocks cannot be written into ``peer``'s pool (None: they can)."""
        if peer.mismatch:
            return FailureKind.MISMATCH, peer.mismatch
        try:
            check_blocks(msg.block_ids, msg.allocated_tokens, self.config.block_size, peer.num_blocks)
        except ProtocolError as exc:
            return exc.kind, str(exc)
        return None

    # ---- writes ----------------------------------------------------------------------------

    def _run_write(self, job: tuple[SenderRoom, Write]) -> None:
        r, write = job
        answer = self._answers.get(r.room)
        if answer is not None and answer.first_write_at is None:
            answer.first_write_at = time.monotonic()
        try:
            error = "" if r.phase == P.DRAINING else self._write_round(write)
        except WriteUnsettled as exc:
            log.warning("room %d: %s; its blocks, Failed status and abort ack wait until they settle", r.room, exc)
            with self._lock:  # the room fails now (its /encode is answered) but stays in flight
                self.stats["writes_held"] += 1
                self._held_writes.append(_HeldWrite(r, write, str(exc), exc.settled, self.clock()))
                self._dispatch(r, ev.Fail(FailureKind.TRANSFER, str(exc)))
            return
        except Exception as exc:  # a bug or an engine error fails the room, never this worker
            log.exception("room %d: write failed unexpectedly", r.room)
            error = f"write failed unexpectedly: {type(exc).__name__}: {exc}"
        with self._lock:
            self._dispatch(r, ev.WriteLanded(write, error))

    def _write_round(self, write: Write) -> str:
        bs, start = self.config.block_size, write.start
        tokens = write.end - start  # the same for every destination: the smallest allocation
        for d in write.dsts:
            peer = self.peers.get(d.peer)
            if peer is None:
                return f"language peer session {d.session_id} at {d.endpoint}:{d.port} is gone"
            try:  # the pool its endpoint answered for: the request may have been checked against a claim
                check_blocks(d.block_ids, d.allocated_tokens, bs, peer.num_blocks)
            except ProtocolError as exc:
                return f"language peer {d.endpoint}:{d.port}: {exc}"
            if peer.mismatch:
                return f"language peer {d.endpoint}:{d.port}: {peer.mismatch}"
            plan = plan_round(list(write.src_blocks[start // bs:]), list(d.block_ids), tokens, bs,
                              self.pool.base_ptrs, peer.base_ptrs, self.pool.item_lens, with_aux=start == 0)
            for attempt in range(1, WRITE_ATTEMPTS + 1):
                try:
                    self.transport.write(d.session_id, plan.src_addrs, plan.dst_addrs, plan.lengths)
                    break
                except WriteUnsettled as exc:  # not again: the bytes would queue behind those still held
                    raise WriteUnsettled(f"transfer to language peer {d.endpoint}:{d.port} failed: {exc}",
                                         exc.settled) from exc
                except TransferError as exc:
                    with self._lock:  # not again into a peer gone or declared dead meanwhile
                        writable = self.peers.get(d.peer) is not None and self.peers.writable(d.peer)
                    if attempt == WRITE_ATTEMPTS or self._stop.is_set() or not writable:
                        return f"transfer to language peer {d.endpoint}:{d.port} failed: {exc}"
                    log.warning("write to language peer %s:%d failed (%s); writing it once more", d.endpoint, d.port,
                                exc)
            self.stats["bytes_sent"] += plan.nbytes
        return ""

    # ---- timeouts and liveness -------------------------------------------------------------------

    def _housekeeping(self) -> None:
        next_beat = self.clock() + self.config.heartbeat_interval
        while not self._stop.wait(0.25):
            now = self.clock()
            with self._lock:
                self._expire_ended(now)
                self._settle_held_writes(now)
                if self._paused:
                    continue
                for r in [r for r in self._rooms.values() if r.live]:  # ended rooms have no wait to time out
                    self._dispatch(r, ev.Tick())
                if now >= next_beat:
                    next_beat = now + self.config.heartbeat_interval
                    self._beat()

    def _settle_held_writes(self, now: float) -> None:
        """End the wait of each held write whose parts settled (or that waited too long)."""
        for held in list(self._held_writes):
            try:
                settled = held.settled()
            except Exception:  # an engine error: this thread must go on (heartbeats, timeouts)
                log.exception("room %d: cannot tell whether a held write settled", held.room.room)
                settled = False
            if settled:
                log.info("room %d: the write given up on has settled", held.room.room)
            elif now - held.since > HELD_WRITE_MAX_S:
                log.error("room %d: Mooncake still holds parts of a write given up %.0f s ago; its blocks are freed "
                          "and its abort acked regardless", held.room.room, now - held.since)
            else:
                continue
            self._held_writes.remove(held)
            self._dispatch(held.room, ev.WriteLanded(held.write, held.error))

    def _expire_ended(self, now: float) -> None:
        while self._ended and now - next(iter(self._ended.values())) > _ENDED_GRACE_S:
            room, _ = self._ended.popitem(last=False)
            r = self._rooms.get(room)
            if r is not None and not r.live and r.phase != P.DRAINING:
                self._drop(room)

    def _beat(self) -> None:
        # A session whose rooms are all suspended may be a language worker restarting from its
        # checkpoint: those rooms wait (up to max_sleep), as its peers' rooms wait for it.
        joins = {r.room: _first_joins(r) for r in self._rooms.values() if r.live and r.phase != P.SUSPENDED}
        latest: dict[PeerKey, float] = {}  # each session with live rooms: the latest time it joined one
        for room_joins in joins.values():
            for peer, at in room_joins.items():
                latest[peer] = max(latest.get(peer, at), at)
        for dead in self.peers.beat(latest):
            session, host, port = dead.key
            name = f"{host}:{port}"
            spared = {room for room, room_joins in joins.items()
                      if room_joins.get(dead.key, 0.0) > dead.missed_ping_sent}
            log.error("language peer %s (session %s) declared dead: %s%s", name, session, dead.why,
                      f"; rooms {sorted(spared)[:8]} were joined after the last missed ping left: the next ping "
                      f"decides for them" if spared else "")
            self.stats["peer_dead"] += 1
            why = f"language peer {name} is dead: {dead.why}"
            for r in list(self._rooms.values()):
                if r.room not in spared and any(d.peer == dead.key for d in r.dsts):
                    self._dispatch(r, ev.Fail(FailureKind.PEER_DEAD, why))


def _first_joins(r: SenderRoom) -> dict[PeerKey, float]:
    """When each session among ``r``'s destinations joined it (several destinations of one
    session, as the fork's ranks may be: the first)."""
    joins: dict[PeerKey, float] = {}
    for d in r.dsts:
        joins[d.peer] = min(joins.get(d.peer, d.joined), d.joined)
    return joins
