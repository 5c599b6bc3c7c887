"""Encode side of the connector: receives init/resume/abort, writes rounds, reports status.

One :class:`EmbeddingSenderManager` per encode worker owns the source pool, its allocator,
the transport, the PULL socket and the transfer worker threads. Each request gets an
:class:`EmbeddingSender` (SGLang's ``BaseKVSender`` shape: ``send``, ``poll``,
``failure_exception``, ``abort``).

A room's life: ``Bootstrapping`` until all ``required_dst_info_num`` inits arrived and the
source blocks were handed over, then ``WaitingForInput`` -> one round of
``min(remaining, allocated)`` tokens -> ``Transferring`` (partial: wait for a resume) or
``Success``. The manager frees the room's source blocks when it ends and no write of it is
in flight; aborts are acknowledged only then.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import zmq

from connector.addressing import plan_round
from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.messages import (
    AbortAckMsg,
    AbortMsg,
    InitMsg,
    ProtocolError,
    RegisterMsg,
    ResumeMsg,
    StatusMsg,
    SuspendAckMsg,
    SuspendMsg,
    check_blocks,
    decode_encoder_bound,
)
from connector.poll import KVPoll, RoomState, TransferFailure
from connector.transport import TransferError, Transport
from connector.zmq_link import PullLoop, PushSockets

log = logging.getLogger(__name__)

_CONCLUDED_GRACE_S = 60.0  # how long a finished room is remembered for late aborts


@dataclass
class _Peer:
    """A language worker that sent ``register`` (keyed by its Mooncake session id)."""

    endpoint: str
    port: int
    base_ptrs: tuple[int, ...]
    generation: int | None
    num_blocks: int | None
    mismatch: str  # why this peer's pool cannot receive from ours; empty when compatible


@dataclass
class _Destination:
    endpoint: str
    port: int
    session_id: str
    block_ids: tuple[int, ...]
    allocated_tokens: int
    ready: bool = True  # has blocks for the round to come


@dataclass
class _Write:
    """One round being written: tokens ``[start, end)`` into each destination's blocks as they
    were when the round started (an early resume may already have replaced them)."""

    start: int
    end: int
    dsts: list[_Destination]
    done: bool = False


@dataclass
class _Room:
    room: int
    state: RoomState = field(default_factory=RoomState)
    required_dsts: int = 0  # 0 until the first init arrives
    dsts: list[_Destination] = field(default_factory=list)
    src_blocks: list[int] | None = None
    total_tokens: int = 0
    writes: list[_Write] = field(default_factory=list)  # in token order; at most two (see _maybe_start)
    pending_acks: list[AbortMsg] = field(default_factory=list)
    deadline: float = 0.0
    concluded_at: float | None = None
    freed: bool = False
    suspended_at: float | None = None  # the language side suspended the room to sleep
    pending_suspend_acks: list[SuspendMsg] = field(default_factory=list)
    held: Embedding | None = None  # source data kept in host memory while this worker sleeps
    # Failed statuses held back while a write of the room is in flight: a peer frees its blocks
    # on Failed, so it must not see one before the last byte has landed.
    held_failures: list[tuple[str, int, StatusMsg]] = field(default_factory=list)
    round_end: int = 0  # sent_tokens once the rounds being written land
    first_write_at: float | None = None  # time.monotonic() as the first round's write began

    @property
    def in_flight(self) -> bool:
        return bool(self.writes)


@dataclass
class SenderRoomCheckpoint:
    """A room kept over sleep: its whole source embedding (aux included) and how much was sent."""

    room: int
    sent_tokens: int
    data: Embedding
    destinations: int  # required_dst_info_num of its init; 0 before any init arrived


class EmbeddingSender:
    """One request's sending end; cheap, all work happens in the manager."""

    def __init__(self, manager: EmbeddingSenderManager, room: int) -> None:
        self._manager, self.room = manager, room

    def send(self, block_ids: list[int], total_tokens: int) -> None:
        """Hand over the source blocks holding ``total_tokens`` tokens (the manager frees them)."""
        self._manager._handover(self.room, block_ids, total_tokens)

    def poll(self) -> KVPoll:
        return self._manager._room(self.room).state.status

    @property
    def sent_tokens(self) -> int:
        return self._manager._room(self.room).state.progress.sent_tokens

    @property
    def first_write_at(self) -> float | None:
        """``time.monotonic()`` when the first byte of this room started moving (None before)."""
        return self._manager._room(self.room).first_write_at

    @property
    def failure_reason(self) -> str:
        return self._manager._room(self.room).state.reason

    def failure_exception(self) -> None:
        state = self._manager._room(self.room).state
        if state.status == KVPoll.Failed:
            raise TransferFailure(f"room {self.room}: {state.reason}")

    def abort(self, reason: str = "aborted by the encode side") -> None:
        self._manager._abort_local(self.room, reason)


class EmbeddingSenderManager:
    def __init__(self, config: ConnectorConfig, transport: Transport, pool: BufferPool,
                 allocator: BlockAllocator) -> None:
        if pool.block_size != config.block_size or pool.hidden_size != config.hidden_size:
            raise ValueError("pool geometry does not match the connector config")
        self.config, self.transport, self.pool, self.allocator = config, transport, pool, allocator
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        self._rooms: dict[int, _Room] = {}
        self._peers: dict[str, _Peer] = {}
        self._work: queue.Queue[tuple[_Room, _Write] | None] = queue.Queue()
        self._stop = threading.Event()
        self._paused = False  # this worker sleeps: no write starts, no timeout fires
        self._idle = threading.Condition(self._lock)  # notified when a write finishes
        transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
        self._context = zmq.Context()
        self._push = PushSockets(self._context)
        self._pull = PullLoop(self._context, config.host, self._on_message, "encode-connector-pull")
        self.rank_port = self._pull.port
        self._threads = [threading.Thread(target=self._transfer_worker, name=f"encode-transfer-{i}", daemon=True)
                         for i in range(config.transfer_workers)]
        self._threads.append(threading.Thread(target=self._housekeeping, name="encode-housekeeping", daemon=True))
        for t in self._threads:
            t.start()

    # ---- API -------------------------------------------------------------------------------

    def create_sender(self, room: int) -> EmbeddingSender:
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.src_blocks is not None:
                raise ValueError(f"room {room} is already in use")
            if r is None:
                self._rooms[room] = _Room(room, deadline=time.monotonic() + self.config.bootstrap_timeout)
        return EmbeddingSender(self, room)

    # ---- sleep ------------------------------------------------------------------------------

    def pause(self, timeout: float = 60.0) -> None:
        """Start no new write and wait until none is in flight (this worker goes to sleep)."""
        with self._lock:
            self._paused = True
            if not self._idle.wait_for(lambda: not any(r.in_flight for r in self._rooms.values()), timeout):
                self._unpause()  # stay awake and go on
                raise TimeoutError(f"writes still in flight after {timeout:g}s")

    def abort_all(self, reason: str) -> None:
        with self._lock:
            for r in list(self._rooms.values()):
                if r.concluded_at is None:
                    self._fail(r, reason)

    def detach_pool(self) -> int:
        """Copy every live room's source data to host memory, free the blocks, deregister the
        pool. Call after :meth:`pause`. Returns the bytes kept."""
        kept = 0
        with self._lock:
            for r in self._rooms.values():
                if r.concluded_at is None and r.src_blocks is not None and not r.freed:
                    r.held = Embedding.empty(r.total_tokens, self.pool.hidden_size, self.pool.dtype)
                    self.pool.read_into(r.src_blocks, r.held, 0, r.total_tokens)
                    r.held.aux[:] = self.pool.aux[r.src_blocks[0]]
                    self.allocator.free(r.src_blocks)
                    r.src_blocks = None
                    kept += r.held.embeddings.nbytes + r.held.fill_ids.nbytes + r.held.mrope_positions.nbytes
            self.transport.unregister([b.ctypes.data for b in self.pool.buffers])
        return kept

    def held_rooms(self) -> list[SenderRoomCheckpoint]:
        """The rooms :meth:`detach_pool` kept, for a checkpoint on disk."""
        with self._lock:
            return [SenderRoomCheckpoint(r.room, r.state.progress.sent_tokens, r.held, r.required_dsts)
                    for r in self._rooms.values() if r.held is not None and r.concluded_at is None]

    def attach_pool(self, pool: BufferPool, allocator: BlockAllocator,
                    restored: list[SenderRoomCheckpoint] = ()) -> None:
        """Register a new pool (after sleep), put the kept data back, let writes start again.

        ``restored`` are rooms from a checkpoint on disk (a restarted worker). Each waits,
        suspended, for the language side's init or resume, which rebinds it to whichever
        language session sends it. Nothing changes unless every room fits in the new pool.
        """
        with self._lock:
            taken = [saved.room for saved in restored if saved.room in self._rooms]
            if taken:
                raise ValueError(f"rooms {taken} are already in use")
            now = time.monotonic()
            rooms = [r for r in self._rooms.values() if r.held is not None]
            for saved in restored:
                r = _Room(saved.room, total_tokens=saved.data.num_tokens, held=saved.data,
                          required_dsts=saved.destinations, suspended_at=now)
                if saved.sent_tokens:
                    r.state.advance(KVPoll.Transferring, saved.sent_tokens)
                rooms.append(r)
            placed = [allocator.allocate(pool.blocks_for(r.held.num_tokens)) for r in rooms]
            if None in placed:
                raise RuntimeError(f"the new pool ({allocator.num_blocks} blocks) cannot hold the "
                                   f"{len(rooms)} rooms kept over sleep")
            self.transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
            self.pool, self.allocator = pool, allocator
            for r, blocks in zip(rooms, placed, strict=True):
                pool.write(blocks, r.held)
                r.src_blocks, r.held = blocks, None
                self._rooms[r.room] = r
            for r in self._rooms.values():
                r.deadline = max(r.deadline, now + self.config.resume_timeout)
            self._unpause()

    def _unpause(self) -> None:
        """Let writes start again, beginning with the rounds held back while paused (lock held)."""
        self._paused = False
        for r in list(self._rooms.values()):
            self._maybe_start(r)

    def active_rooms(self) -> int:
        with self._lock:
            return sum(1 for r in self._rooms.values() if r.concluded_at is None)

    def close(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._work.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._pull.close()
        self._push.close()
        self._context.term()
        self.transport.unregister([b.ctypes.data for b in self.pool.buffers])

    # ---- room bookkeeping --------------------------------------------------------------------

    def _room(self, room: int) -> _Room:
        with self._lock:
            r = self._rooms.get(room)
        if r is None:
            raise KeyError(f"room {room} is unknown or expired")
        return r

    def _handover(self, room: int, block_ids: list[int], total_tokens: int) -> None:
        if total_tokens <= 0 or self.pool.blocks_for(total_tokens) != len(block_ids):
            raise ValueError(f"{total_tokens} tokens need {self.pool.blocks_for(max(total_tokens, 1))} "
                             f"source blocks, got {len(block_ids)}")
        with self._lock:
            r = self._room(room)
            if r.src_blocks is not None:
                raise ValueError(f"room {room}: send() called twice")
            r.src_blocks, r.total_tokens = list(block_ids), total_tokens
            if r.state.status == KVPoll.Failed:
                self._conclude(r)
                return
            self._maybe_start(r)

    def _maybe_start(self, r: _Room) -> None:
        """Queue the next round once every destination is ready and the data is there.

        A destination is ready again while a round is still being written only after an early
        resume; that next round is then written beside it, so no gap separates the two.
        """
        if r.src_blocks is None or not r.required_dsts or len(r.dsts) < r.required_dsts:
            return
        if not all(d.ready for d in r.dsts) or len(r.writes) > 1 or r.state.progress.terminal:
            return
        if self._paused or r.suspended_at is not None:
            return
        start = r.round_end if r.writes else r.state.progress.sent_tokens
        if start >= r.total_tokens:
            return
        for d in r.dsts:
            d.ready = False
        r.round_end = start + min(r.total_tokens - start, min(d.allocated_tokens for d in r.dsts))
        write = _Write(start, r.round_end, [dataclasses.replace(d) for d in r.dsts])
        if r.writes:
            self.stats["pipelined_rounds"] += 1
        r.writes.append(write)
        if start == 0 and r.round_end < r.total_tokens and len(r.dsts) == 1:
            self._announce_total(r, r.dsts[0])
        self._work.put((r, write))

    def _announce_total(self, r: _Room, d: _Destination) -> None:
        """Tell one of our own language peers the total as an oversized first round starts, so it
        can allocate and resume while this round is written (fork peers never get this frame)."""
        peer = self._peers.get(d.session_id)
        if peer is not None and peer.num_blocks is not None:  # registered with our extension frames
            self._status(d.endpoint, d.port, StatusMsg(r.room, KVPoll.WaitingForInput, 0, "", r.total_tokens))

    def _fail(self, r: _Room, reason: str, notify: bool = True) -> None:
        """Fail a room; tell its destinations; free it once nothing is in flight."""
        if not r.state.fail(reason):
            return
        self.stats[f"failed:{reason.split(':')[0]}"] += 1
        log.warning("room %d failed: %s", r.room, reason)
        if notify:
            for d in r.dsts:
                self._tell_failed(r, d.endpoint, d.port, StatusMsg(r.room, KVPoll.Failed, r.state.progress.sent_tokens,
                                                                   reason))
        if not r.in_flight:
            self._conclude(r)

    def _tell_failed(self, r: _Room | None, host: str, port: int, msg: StatusMsg) -> None:
        """Send a Failed status now, or once the room's writes have landed (see held_failures)."""
        if r is not None and r.in_flight:
            r.held_failures.append((host, port, msg))
        else:
            self._status(host, port, msg)

    def _conclude(self, r: _Room) -> None:
        """Called with the lock held when a room ended and no write of it is in flight."""
        if r.concluded_at is None:
            r.concluded_at = time.monotonic()
        if r.src_blocks is not None and not r.freed:
            r.freed = True
            self.allocator.free(r.src_blocks)
        for host, port, msg in r.held_failures:  # before any ack, as _settle_writes does
            self._status(host, port, msg)
        r.held_failures.clear()
        for ack in r.pending_acks:
            self._push_safe(ack.endpoint, ack.dst_port, AbortAckMsg(r.room, ack.generation).encode())
        r.pending_acks.clear()
        self._send_suspend_acks(r)

    def _send_suspend_acks(self, r: _Room) -> None:
        for ack in r.pending_suspend_acks:
            self._push_safe(ack.endpoint, ack.dst_port, SuspendAckMsg(r.room, ack.generation).encode())
        r.pending_suspend_acks.clear()

    def _abort_local(self, room: int, reason: str) -> None:
        with self._lock:
            r = self._rooms.get(room)
            if r is not None:
                self._fail(r, reason)

    def _status(self, host: str, port: int, msg: StatusMsg) -> None:
        self._push_safe(host, port, msg.encode())

    def _push_safe(self, host: str, port: int, frames: list[bytes]) -> None:
        try:
            self._push.send(host, port, frames)
        except zmq.ZMQError as exc:
            log.warning("cannot reach language peer %s:%d: %s", host, port, exc)

    # ---- control messages ------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = decode_encoder_bound(frames)
        except ProtocolError as exc:
            self.stats["bad_message"] += 1
            log.warning("dropping malformed control message: %s", exc)
            self._answer_undecodable(frames, str(exc))
            return
        with self._lock:
            if isinstance(msg, RegisterMsg):
                self._on_register(msg)
            elif isinstance(msg, AbortMsg):
                self._on_abort(msg)
            elif isinstance(msg, SuspendMsg):
                self._on_suspend(msg)
            else:
                self._on_round_request(msg)

    def _answer_undecodable(self, frames: list[bytes], reason: str) -> None:
        """A bad init/resume still names its room and reply address where those frames parse."""
        try:
            room, host, port = int(frames[0]), frames[1].decode("ascii"), int(frames[2])
        except (ValueError, IndexError, UnicodeDecodeError):
            return
        if 0 <= room < 2**63 and 0 < port < 65536:
            with self._lock:
                r = self._rooms.get(room)
                if r is not None and r.concluded_at is None:
                    self._fail(r, f"bad message from {host}:{port}: {reason}", notify=False)
                self._tell_failed(r, host, port, StatusMsg(room, KVPoll.Failed, 0, f"rejected message: {reason}"))

    def _on_register(self, msg: RegisterMsg) -> None:
        mismatch = ""
        if len(msg.base_ptrs) < 4:
            mismatch = f"peer registered {len(msg.base_ptrs)} buffers, need 4"
        elif msg.item_lens is not None and tuple(msg.item_lens[:4]) != self.pool.item_lens:
            mismatch = (f"pool layout mismatch: peer item lengths {msg.item_lens[:4]} vs ours "
                        f"{self.pool.item_lens} (block size or hidden size differ)")
        old_sessions = [s for s, p in self._peers.items()
                        if (p.endpoint, p.port) == (msg.endpoint, msg.dst_port) and s != msg.session_id]
        for session in old_sessions:  # the peer restarted: its old incarnation's rooms are dead
            del self._peers[session]
            for r in list(self._rooms.values()):
                if any(d.session_id == session for d in r.dsts) and r.suspended_at is None:
                    self._fail(r, f"language peer {msg.endpoint}:{msg.dst_port} restarted", notify=False)
        self._peers[msg.session_id] = _Peer(msg.endpoint, msg.dst_port, msg.base_ptrs, msg.generation,
                                            msg.num_blocks, mismatch)
        if mismatch:
            log.warning("language peer %s: %s", msg.session_id, mismatch)

    def _on_abort(self, msg: AbortMsg) -> None:
        r = self._rooms.get(msg.room)
        if r is None:
            self._push_safe(msg.endpoint, msg.dst_port, AbortAckMsg(msg.room, msg.generation).encode())
            return
        r.pending_acks.append(msg)
        self._fail(r, f"aborted by language peer {msg.endpoint}:{msg.dst_port}", notify=False)
        if not r.in_flight:
            self._conclude(r)

    def _on_suspend(self, msg: SuspendMsg) -> None:
        """The language side goes to sleep: write nothing more for the room, ack once idle."""
        r = self._rooms.get(msg.room)
        if r is None or r.concluded_at is not None:
            self._push_safe(msg.endpoint, msg.dst_port, SuspendAckMsg(msg.room, msg.generation).encode())
            return
        r.suspended_at = time.monotonic()
        r.pending_suspend_acks.append(msg)
        if not r.in_flight:
            self._send_suspend_acks(r)

    def _on_round_request(self, msg: InitMsg | ResumeMsg) -> None:
        peer = self._peers.get(msg.session_id)
        reason = ""
        if peer is None:
            reason = f"session {msg.session_id} never registered"
        elif peer.mismatch:
            reason = peer.mismatch
        else:
            try:
                check_blocks(msg.block_ids, msg.allocated_tokens, self.config.block_size, peer.num_blocks)
            except ProtocolError as exc:
                reason = str(exc)
        r = self._rooms.get(msg.room)
        if isinstance(msg, ResumeMsg) and not reason:
            reason = self._check_resume(r, msg)
        if reason:
            self.stats["rejected_message"] += 1
            if r is not None and r.concluded_at is None:
                self._fail(r, reason, notify=False)
            self._tell_failed(r, msg.endpoint, msg.dst_port, StatusMsg(msg.room, KVPoll.Failed, 0, reason))
            return
        dst = _Destination(msg.endpoint, msg.dst_port, msg.session_id, msg.block_ids, msg.allocated_tokens)
        if isinstance(msg, InitMsg):
            if r is None:  # the init came before the encode request: hold it until send()
                r = self._rooms[msg.room] = _Room(msg.room, deadline=time.monotonic() + self.config.bootstrap_timeout)
            if r.state.status != KVPoll.Bootstrapping or r.required_dsts and len(r.dsts) >= r.required_dsts:
                self._tell_failed(r, msg.endpoint, msg.dst_port,
                                  StatusMsg(msg.room, KVPoll.Failed, 0, f"room {msg.room} already initialised"))
                return
            r.required_dsts = msg.required_dst_info_num
            r.suspended_at = None  # a room restored from disk, asked for again from token 0
            r.dsts.append(dst)
            if len(r.dsts) == r.required_dsts:
                r.state.advance(KVPoll.WaitingForInput)
        else:
            assert r is not None
            if r.in_flight and r.suspended_at is None:  # early resume: its round starts right away
                slot = r.dsts[0]
                slot.block_ids, slot.allocated_tokens, slot.ready = msg.block_ids, msg.allocated_tokens, True
                self._maybe_start(r)
                return
            if r.suspended_at is not None:  # woken or restarted language side (or encoder): rebind
                r.suspended_at = None
                r.dsts, r.required_dsts = [dst], 1
            else:
                slot = next(d for d in r.dsts if d.session_id == msg.session_id)
                slot.block_ids, slot.allocated_tokens, slot.ready = msg.block_ids, msg.allocated_tokens, True
            if all(d.ready for d in r.dsts):
                r.state.advance(KVPoll.WaitingForInput, msg.sent_tokens)
        self._maybe_start(r)

    def _check_resume(self, r: _Room | None, msg: ResumeMsg) -> str:
        if r is None or r.concluded_at is not None:
            return f"resume for unknown or finished room {msg.room}"
        progress = r.state.progress
        if r.suspended_at is not None:  # after a sleep: any state, as long as progress agrees
            if max(len(r.dsts), r.required_dsts) > 1:
                return (f"room {msg.room} has {max(len(r.dsts), r.required_dsts)} destinations; "
                        "only one can be resumed after sleep")
            if msg.sent_tokens != progress.sent_tokens:
                return f"resume after sleep at sent_tokens {msg.sent_tokens} != {progress.sent_tokens} already sent"
            return ""
        if not any(d.session_id == msg.session_id for d in r.dsts):
            return f"resume for room {msg.room} from session {msg.session_id}, which did not init it"
        if r.in_flight:
            if len(r.writes) == 1 and len(r.dsts) == 1 and msg.sent_tokens == r.round_end < r.total_tokens:
                return ""  # early: it continues where the round being written ends
            return f"resume for room {msg.room} at {msg.sent_tokens} while tokens up to {r.round_end} are being written"
        if progress.status != KVPoll.Transferring:
            return f"resume for room {msg.room} in state {progress.status.name}"
        if msg.sent_tokens != progress.sent_tokens:
            return f"resume sent_tokens {msg.sent_tokens} != {progress.sent_tokens} already sent"
        return ""

    # ---- transfer workers ------------------------------------------------------------------

    def _transfer_worker(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            r, write = item
            if r.first_write_at is None:
                r.first_write_at = time.monotonic()
            try:
                error = "" if r.state.status == KVPoll.Failed else self._write_round(r, write)
            except Exception as exc:  # a bug or an engine error fails the room, never this worker
                log.exception("room %d: write failed unexpectedly", r.room)
                error = f"write failed unexpectedly: {type(exc).__name__}: {exc}"
            with self._lock:
                write.done = True
                if error:
                    self._fail(r, error)
                self._settle_writes(r)
                self._idle.notify_all()

    def _write_round(self, r: _Room, write: _Write) -> str:
        assert r.src_blocks is not None
        bs, start = self.config.block_size, write.start
        first_src = start // bs
        tokens = write.end - start  # the same for every destination: the smallest allocation
        for d in write.dsts:
            peer = self._peers.get(d.session_id)
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

    def _settle_writes(self, r: _Room) -> None:
        """Report finished rounds in token order (a round written beside an earlier one waits for
        it), then conclude the room or start what comes next."""
        while r.writes and r.writes[0].done:
            write = r.writes.pop(0)
            if r.state.status == KVPoll.Failed:
                continue
            status = KVPoll.Success if write.end >= r.total_tokens else KVPoll.Transferring
            r.state.advance(status, write.end)
            # The status goes out before any ack _conclude sends: a peer that sees the ack must
            # already know how the round ended.
            for d in write.dsts:
                self._status(d.endpoint, d.port, StatusMsg(r.room, status, write.end))
            r.deadline = time.monotonic() + self.config.resume_timeout
        if r.writes:
            return
        if r.state.progress.terminal:
            self._conclude(r)
        else:
            self._send_suspend_acks(r)
            self._maybe_start(r)

    # ---- timeouts --------------------------------------------------------------------------

    def _housekeeping(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:
                for room, r in list(self._rooms.items()):
                    if r.concluded_at is not None:
                        if now - r.concluded_at > _CONCLUDED_GRACE_S:
                            del self._rooms[room]
                        continue
                    if self._paused or r.in_flight:
                        continue
                    if r.suspended_at is not None:
                        if now - r.suspended_at > self.config.max_sleep:
                            self._fail(r, f"timeout: language peer slept longer than {self.config.max_sleep:g}s")
                        continue
                    if now < r.deadline:
                        continue
                    status = r.state.status
                    if status == KVPoll.Transferring:
                        self._fail(r, f"timeout: no resume within {self.config.resume_timeout:g}s")
                    elif status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                        what = "init" if len(r.dsts) < max(r.required_dsts, 1) else "encoded data"
                        self._fail(r, f"timeout: bootstrap, no {what} within {self.config.bootstrap_timeout:g}s")
