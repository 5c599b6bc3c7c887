"""Language side of the connector: init, poll, resume rounds, assemble once, abort.

One :class:`EmbeddingReceiverManager` per language worker owns the destination pool, its
allocator, the transport, the PULL socket for statuses and abort acks, and the heartbeat.
Each request gets an :class:`EmbeddingReceiver` (SGLang's ``BaseKVReceiver`` shape).

Block ownership: blocks passed to ``init``/``resume`` belong to the receiver from then on.
They come back to the allocator when the embedding is assembled, or when the room failed and
no peer can still write into them (a status ``Failed`` from the encoder, its ``ABORT_ACK``,
or the peer declared dead by heartbeat or ack timeout).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import requests
import zmq

from connector.allocator import BlockAllocator
from connector.bootstrap import INCARNATION_HEADER, RankRoute, fetch_route
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
    decode_language_bound,
)
from connector.poll import KVPoll, RoomState, TransferFailure
from connector.transport import Transport
from connector.zmq_link import PullLoop, PushSockets

log = logging.getLogger(__name__)


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


class EmbeddingReceiver:
    """One request's receiving end. Thread-safe; status updates arrive on the manager's thread."""

    def __init__(self, manager: EmbeddingReceiverManager, bootstrap_addr: str, room: int, route: RankRoute) -> None:
        self._m, self.bootstrap_addr, self.room, self.route = manager, bootstrap_addr, room, route
        self.state = RoomState()
        self._changed = threading.Condition(manager._lock)  # notified on every status change
        self.total_tokens: int | None = None
        self.resume_rounds = 0
        self._rounds: list[_Round] = []  # rounds whose blocks are still in the pool
        self._round_end = 0  # tokens that have landed once the current round succeeds
        self._out: Embedding | None = None  # assembly target, created early only by spill()
        self._spilled = 0  # tokens [0, _spilled) already copied into _out
        self._aux = None
        self._blocks_owned = True  # False once the blocks went back to the allocator
        self._awaiting_ack_since: float | None = None
        self._suspend_acked = False  # the encoder confirmed: nothing of this room is or will be in flight
        self._needs_resume = False  # restored after sleep: continue with a resume, not an init
        # The reference fork's strategy, kept only to measure against (scripts/bench_resume.py):
        # copy every partial round out of the pool and concatenate all copies at the end.
        self.clone_concat = False
        self._clones: list[Embedding] = []
        self._early_ok = False  # the total is known while the first round is written: resume now
        self._last_progress = time.monotonic()
        self.peer_name = f"encode peer {bootstrap_addr} (rank {route.rank_ip}:{route.rank_port})"

    # ---- BaseKVReceiver-like API ----------------------------------------------------------

    def init(self, block_ids: list[int]) -> None:
        """Send the 7-frame init with the first allocation (``allocated = len * block_size``)."""
        m = self._m
        with m._lock:
            if self._rounds or not block_ids:
                raise ValueError(f"room {self.room}: init needs blocks and may be called once")
            self._rounds.append(_Round(0, list(block_ids)))
            self._round_end = len(block_ids) * m.config.block_size
            if self.state.status == KVPoll.Failed:  # e.g. its peer was declared dead meanwhile
                self._release_failed()
                return
            self.state.advance(KVPoll.WaitingForInput)
        m._send(self, self._round_frames(block_ids, None))

    def poll(self) -> KVPoll:
        return self.state.status

    def failure_exception(self) -> None:
        if self.state.status == KVPoll.Failed:
            raise TransferFailure(f"room {self.room}: {self.state.reason}")

    def remaining_tokens(self) -> int:
        assert self.total_tokens is not None
        return self.total_tokens - self._round_end

    def try_resume(self) -> bool:
        """After a partial round: allocate for the rest (or as much as is free) and resume.

        When no block is free at all, this room's received blocks are spilled to host memory
        to make room, so a full pool can always make progress. Returns False when it must be
        retried later (nothing could be allocated).
        """
        with self._m._lock:
            restored = self._needs_resume and self.state.status == KVPoll.Bootstrapping
            early = self._early_ok and self.state.status == KVPoll.WaitingForInput
            self._early_ok = False
            if self.state.status != KVPoll.Transferring and not restored and not early:
                return False
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
            self._needs_resume = False
            self._last_progress = time.monotonic()
        m._send(self, self._round_frames(blocks, start))
        return True

    def assemble(self) -> Embedding:
        """After ``Success``: the whole embedding, contiguous and in token order, assembled once.

        When the received blocks are one run of consecutive ids (the usual case), the result
        is a zero-copy view into the pool and those blocks return on ``Embedding.release()``;
        otherwise every round is copied into a new array and the blocks return at once.
        """
        with self._m._lock:
            if self.state.status != KVPoll.Success or not self._blocks_owned:
                raise RuntimeError(f"room {self.room}: cannot assemble in state {self.state.status.name}")
            assert self.total_tokens is not None and self._aux is not None
            m, bs = self._m, self._m.config.block_size
            used = [b for rnd in self._rounds
                    for b in rnd.block_ids[: max(0, -(-(self.total_tokens - rnd.start) // bs))]]
            if self._clones:  # reference strategy: concatenate the copies of every round
                parts = self._clones + [self._clone_rounds_locked()]
                out = Embedding(np.concatenate([p.embeddings for p in parts]), np.concatenate([p.fill_ids for p in parts]),
                                np.concatenate([p.mrope_positions for p in parts], axis=1), parts[0].aux.copy(),
                                m.pool.hidden_size, m.pool.dtype)
                self._blocks_owned = False
                out.aux[:] = self._aux
                m._forget(self)
                return out
            out = m.pool.view(used, self.total_tokens) if self._out is None else None
            if out is not None:
                held = set(used)
                m.allocator.free([b for rnd in self._rounds for b in rnd.block_ids if b not in held])
                out.release_fn = lambda: m.allocator.free(used)
                self._blocks_owned, self._rounds = False, []
            else:
                out = self._out or Embedding.empty(self.total_tokens, m.pool.hidden_size, m.pool.dtype)
                self._copy_rounds_into(out)
                self._free_blocks_locked()
            out.aux[:] = self._aux
            m._forget(self)
            return out

    def abort(self, reason: str = "aborted by the language side") -> None:
        """Fail at once; blocks are freed when the encoder acknowledges (or is declared dead)."""
        with self._m._lock:
            if not self.state.fail(reason):
                return
            self._awaiting_ack_since = time.monotonic()
            self._notify()
            m = self._m
            m._send(self, AbortMsg(self.room, m.config.host, m.rank_port, m.generation).encode())

    def suspend(self) -> None:
        """Ask the encoder to write nothing more for this room (sleep); the ack sets ``_suspend_acked``."""
        with self._m._lock:
            if self.state.progress.terminal:
                return
            m = self._m
            m._send(self, SuspendMsg(self.room, m.config.host, m.rank_port, m.generation).encode())

    def checkpoint(self) -> ReceiverCheckpoint:
        """After the suspend ack: keep what landed in host memory and give every block back."""
        with self._m._lock:
            status = self.state.status
            if status in (KVPoll.Success, KVPoll.Failed) or not (self._suspend_acked or self._needs_resume):
                raise RuntimeError(f"room {self.room}: cannot checkpoint in state {status.name}")
            if status == KVPoll.Transferring:
                assert self.total_tokens is not None
                landed = min(self._round_end, self.total_tokens)
            elif self._needs_resume:
                landed = self._spilled
            else:  # the current round was never written
                landed = self.state.progress.sent_tokens
            if landed and self._out is None:
                assert self.total_tokens is not None
                self._out = Embedding.empty(self.total_tokens, self._m.pool.hidden_size, self._m.pool.dtype)
            if landed:
                self._copy_rounds_into(self._out, landed)
            self._free_blocks_locked()
            self._m._forget(self)
            return ReceiverCheckpoint(self.room, self.bootstrap_addr, self.route, landed, self.total_tokens,
                                      self._aux, self.resume_rounds, self._out if landed else None)

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
        self._last_progress = time.monotonic()
        if self.state.status != KVPoll.WaitingForInput:
            return  # nothing requested: the next try_resume goes to the new rank
        start = self.state.progress.sent_tokens
        pending = next((rnd for rnd in self._rounds if rnd.start == start), None)
        if pending is not None:
            self._m._send(self, self._round_frames(pending.block_ids, start or None))

    def _copy_rounds_into(self, out: Embedding, upto: int | None = None) -> None:
        """Copy the rounds still in the pool into ``out``, tokens below ``upto`` (default: all)."""
        bs = self._m.config.block_size
        assert self.total_tokens is not None
        end = self.total_tokens if upto is None else upto
        for rnd in self._rounds:
            n = min(len(rnd.block_ids) * bs, end - rnd.start)
            if n > 0:
                self._m.pool.read_into(rnd.block_ids[: -(-n // bs)], out, rnd.start, n)

    def _clone_rounds_locked(self) -> Embedding:
        """Copy the rounds in the pool into a new embedding of just their tokens; free their blocks."""
        assert self.total_tokens is not None
        first, bs = self._rounds[0].start, self._m.config.block_size
        end = min(self._round_end, self.total_tokens)
        clone = Embedding.empty(end - first, self._m.pool.hidden_size, self._m.pool.dtype)
        for rnd in self._rounds:
            n = min(len(rnd.block_ids) * bs, end - rnd.start)
            self._m.pool.read_into(rnd.block_ids[: -(-n // bs)], clone, rnd.start - first, n)
        self._m.allocator.free([b for rnd in self._rounds for b in rnd.block_ids])
        self._rounds = []
        return clone

    def _spill_locked(self) -> None:
        """Copy the received rounds into the (early) assembly target and free their blocks."""
        assert self.total_tokens is not None
        if self._out is None:
            self._out = Embedding.empty(self.total_tokens, self._m.pool.hidden_size, self._m.pool.dtype)
        self._copy_rounds_into(self._out)
        self._m.allocator.free([b for rnd in self._rounds for b in rnd.block_ids])
        self._m.stats["spilled_tokens"] += self._round_end - self._spilled
        self._spilled = self._round_end
        self._rounds = []

    def _free_blocks_locked(self) -> None:
        if self._blocks_owned:
            self._blocks_owned = False
            self._m.allocator.free([b for rnd in self._rounds for b in rnd.block_ids])
            self._rounds = []

    def _on_status(self, msg: StatusMsg) -> None:
        if self.state.status == KVPoll.Failed:
            if msg.status == KVPoll.Failed:  # the encoder stopped writing: blocks are safe to free
                self._release_failed()
            return
        if msg.status == KVPoll.Failed:
            self.state.fail(f"{self.peer_name} reported failure: {msg.reason or 'no reason given'}")
            self._release_failed()
            return
        if msg.total_tokens is not None:
            self._on_total(msg.total_tokens)
            return
        if msg.status not in (KVPoll.Transferring, KVPoll.Success):
            return
        if msg.sent_tokens is not None and msg.sent_tokens > self._round_end:
            self._fail_bad(f"status says {msg.sent_tokens} tokens sent, only {self._round_end} allocated")
            return
        if self._aux is None:  # the first round carried aux: read the total from it
            first_block = self._rounds[0].block_ids[0] if self._rounds else None
            if first_block is None:
                return
            self._aux = self._m.pool.aux[first_block].copy()
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
        else:
            if landed >= self.total_tokens:
                self._fail_bad(f"Transferring although all {self.total_tokens} tokens were allocated")
                return
            if self._round_end > landed:  # the next round was asked for early and is under way
                self.state.advance(KVPoll.WaitingForInput, landed)
            else:
                self.state.advance(KVPoll.Transferring, self.state.progress.sent_tokens)
        self._last_progress = time.monotonic()
        self._notify()

    def _on_total(self, total: int) -> None:
        """The encoder announced the total as the first round started: allow an early resume."""
        if self.total_tokens is not None:
            return
        self.total_tokens = total
        self._early_ok = (self.state.status == KVPoll.WaitingForInput and len(self._rounds) == 1
                          and self._round_end < total and not self._needs_resume and not self.clone_concat)
        self._notify()

    def _fail_bad(self, what: str) -> None:
        self._m.stats["bad_status"] += 1
        self.abort(f"{self.peer_name} sent an inconsistent status: {what}")

    def _release_failed(self) -> None:
        self._free_blocks_locked()
        self._m._forget(self)
        self._notify()

    def _notify(self) -> None:
        self._changed.notify_all()
        self._m._any_change.notify_all()
        self._m.on_change()

    def wait(self, timeout: float) -> KVPoll:
        """Block until the status changes (or ``timeout``); returns the status then."""
        with self._m._lock:
            before = self.state.progress
            if not before.terminal:
                self._changed.wait_for(lambda: self.state.progress != before or self._early_ok, timeout)
            return self.state.status


class EmbeddingReceiverManager:
    def __init__(self, config: ConnectorConfig, transport: Transport, pool: BufferPool,
                 allocator: BlockAllocator, generation: int | None = None,
                 on_change: Callable[[], None] = lambda: None) -> None:
        """``on_change`` is called (cheaply, under the manager lock) whenever a room's status changes."""
        if pool.block_size != config.block_size or pool.hidden_size != config.hidden_size:
            raise ValueError("pool geometry does not match the connector config")
        self.config, self.transport, self.pool, self.allocator = config, transport, pool, allocator
        self.on_change = on_change
        self.generation = generation if generation is not None else time.time_ns() & (2**63 - 1)
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.RLock()
        self._rooms: dict[int, EmbeddingReceiver] = {}
        self._routes: dict[str, RankRoute] = {}  # bootstrap addr -> encode rank
        self._registered: set[tuple[str, int]] = set()  # encode ranks that have our register
        self._heartbeat_misses: collections.Counter[str] = collections.Counter()
        self._sleeping_peers: dict[str, float] = {}  # bootstrap addr -> when it was first seen asleep
        self._durable_peers: set[str] = set()  # asleep with their rooms on disk: they may restart meanwhile
        self._incarnations: dict[str, str] = {}  # bootstrap addr -> the encoder process our rooms are bound to
        self._any_change = threading.Condition(self._lock)
        transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
        self._context = zmq.Context()
        self._push = PushSockets(self._context)
        self._pull = PullLoop(self._context, config.host, self._on_message, "language-connector-pull")
        self.rank_port = self._pull.port
        self._stop = threading.Event()
        self._http = requests.Session()
        self._heartbeat = threading.Thread(target=self._watch, name="language-heartbeat", daemon=True)
        self._heartbeat.start()

    def create_receiver(self, bootstrap_addr: str, room: int) -> EmbeddingReceiver:
        """Look up the encode rank (cached per bootstrap address) and register with it once."""
        with self._lock:
            if room in self._rooms:
                raise ValueError(f"room {room} is already receiving")
            route = self._routes.get(bootstrap_addr)
        if route is None:
            route = fetch_route(bootstrap_addr, room)
        with self._lock:
            if room in self._rooms:  # taken while the route was looked up
                raise ValueError(f"room {room} is already receiving")
            self._routes[bootstrap_addr] = route
            if route.incarnation:
                self._incarnations.setdefault(bootstrap_addr, route.incarnation)
            receiver = EmbeddingReceiver(self, bootstrap_addr, room, route)
            self._rooms[room] = receiver
            return receiver

    def active_rooms(self) -> int:
        with self._lock:
            return len(self._rooms)

    # ---- sleep ------------------------------------------------------------------------------

    def suspend_all(self, receivers: list[EmbeddingReceiver], timeout: float) -> None:
        """Suspend rooms with their encoders; wait for every ack (rooms that miss it are aborted)."""
        for receiver in receivers:
            receiver.suspend()
        with self._lock:
            done = lambda: all(r._suspend_acked or r.state.progress.terminal for r in receivers)  # noqa: E731
            if not self._wait(done, timeout):
                silent = [r for r in receivers if not (r._suspend_acked or r.state.progress.terminal)]
                for r in silent:
                    r.abort(f"timeout: {r.peer_name} did not acknowledge the suspend within {timeout:g}s")
                # Their blocks come back with the abort's ack or its timeout; the pool can only be
                # released after that.
                self._wait(lambda: not any(r._blocks_owned for r in silent), self.config.abort_ack_timeout + 1)

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
            self._routes.setdefault(ckpt.bootstrap_addr, ckpt.route)
            if ckpt.route.incarnation:  # a new encoder process answers with another one: rebind then
                self._incarnations.setdefault(ckpt.bootstrap_addr, ckpt.route.incarnation)
            r = EmbeddingReceiver(self, ckpt.bootstrap_addr, ckpt.room, ckpt.route)
            r.total_tokens, r._aux, r.resume_rounds = ckpt.total_tokens, ckpt.aux, ckpt.resume_rounds
            r._out, r._spilled, r._round_end, r._needs_resume = ckpt.data, ckpt.landed, ckpt.landed, True
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
        self._heartbeat.join(timeout=10)
        self._pull.close()
        self._push.close()
        self._context.term()
        self.transport.unregister([b.ctypes.data for b in self.pool.buffers])

    # ---- sending ---------------------------------------------------------------------------

    def _register_msg(self) -> RegisterMsg:
        return RegisterMsg(self.config.host, self.rank_port, self.transport.session_id, self.pool.base_ptrs,
                           self.generation, self.pool.num_blocks, self.pool.item_lens)

    def _send(self, receiver: EmbeddingReceiver, frames: list[bytes]) -> None:
        route = receiver.route
        key = (route.rank_ip, route.rank_port)
        try:
            with self._lock:
                if key not in self._registered:
                    self._push.send(route.rank_ip, route.rank_port, self._register_msg().encode())
                    self._registered.add(key)
            self._push.send(route.rank_ip, route.rank_port, frames)
        except zmq.ZMQError as exc:
            with self._lock:
                receiver.state.fail(f"cannot reach {receiver.peer_name}: {exc}")
                receiver._release_failed()

    def _forget(self, receiver: EmbeddingReceiver) -> None:
        if self._rooms.get(receiver.room) is receiver:
            del self._rooms[receiver.room]

    # ---- receiving -------------------------------------------------------------------------

    def _on_message(self, frames: list[bytes]) -> None:
        try:
            msg = decode_language_bound(frames)
        except ProtocolError as exc:
            self.stats["bad_message"] += 1
            log.warning("dropping malformed status message: %s", exc)
            return
        with self._lock:
            receiver = self._rooms.get(msg.room)
            if receiver is None:
                self.stats["unknown_room"] += 1
                log.debug("message for unknown room %d dropped", msg.room)
                return
            if isinstance(msg, SuspendAckMsg):
                if msg.generation == self.generation:
                    receiver._suspend_acked = True
                    receiver._notify()
                else:
                    self.stats["stale_message"] += 1
                return
            if isinstance(msg, AbortAckMsg):
                if msg.generation == self.generation and receiver.state.status == KVPoll.Failed:
                    self.stats["abort_acked"] += 1
                    receiver._release_failed()
                else:
                    self.stats["stale_message"] += 1
                return
            receiver._on_status(msg)

    # ---- heartbeat and timeouts -----------------------------------------------------------------

    def _watch(self) -> None:
        interval = self.config.heartbeat_interval
        next_beat = time.monotonic() + interval
        while not self._stop.wait(min(0.25, interval)):
            now = time.monotonic()
            self._check_timeouts(now)
            if now >= next_beat:
                next_beat = now + interval
                self._beat()

    def _check_timeouts(self, now: float) -> None:
        with self._lock:
            for receiver in list(self._rooms.values()):
                since = receiver._awaiting_ack_since
                if since is not None and now - since > self.config.abort_ack_timeout:
                    log.warning("room %d: no ABORT_ACK from %s within %gs; declaring it dead for this room",
                                receiver.room, receiver.peer_name, self.config.abort_ack_timeout)
                    receiver._release_failed()
                elif receiver.bootstrap_addr in self._sleeping_peers:
                    asleep_for = now - self._sleeping_peers[receiver.bootstrap_addr]
                    if asleep_for > self.config.max_sleep:
                        receiver.abort(f"timeout: {receiver.peer_name} slept longer than {self.config.max_sleep:g}s")
                elif (receiver.state.status == KVPoll.WaitingForInput
                      and now - receiver._last_progress > self.config.waiting_timeout):
                    receiver.abort(f"timeout: no data from {receiver.peer_name} within "
                                          f"{self.config.waiting_timeout:g}s")

    def _beat(self) -> None:
        with self._lock:
            addrs = {r.bootstrap_addr for r in self._rooms.values() if r.state.status != KVPoll.Failed}
        for addr in addrs:
            base = addr if addr.startswith("http") else f"http://{addr}"
            try:
                resp = self._http.get(f"{base}/health", timeout=self.config.heartbeat_interval)
                ok, why = resp.status_code == 200, f"HTTP {resp.status_code}"
            except requests.RequestException as exc:
                ok, why = False, type(exc).__name__
            if ok:
                self._heartbeat_misses.pop(addr, None)
                self._note_health(addr, resp.text, resp.headers.get(INCARNATION_HEADER))
                continue
            if addr in self._durable_peers:  # restarting from its checkpoint: its rooms wait (up to max_sleep)
                self.stats["durable_peer_unreachable"] += 1
                continue
            self._heartbeat_misses[addr] += 1
            if self._heartbeat_misses[addr] >= self.config.heartbeat_max_failures:
                self._declare_dead(addr, f"{self._heartbeat_misses[addr]} heartbeats missed ({why})")

    def _note_health(self, addr: str, text: str, incarnation: str | None) -> None:
        """A sleeping encoder is alive: its rooms wait (up to ``max_sleep``) instead of timing out.

        One that answers awake as a new process (a restart, maybe from its checkpoint) gets
        every outstanding request of our rooms again.
        """
        sleeping = text.startswith("SLEEPING")
        with self._lock:
            if sleeping:
                self._sleeping_peers.setdefault(addr, time.monotonic())
                if text.startswith("SLEEPING checkpointed"):
                    if addr not in self._durable_peers:
                        self.stats["durable_sleepers_seen"] += 1
                    self._durable_peers.add(addr)
                else:
                    self._durable_peers.discard(addr)
                return
            self._durable_peers.discard(addr)
            if self._sleeping_peers.pop(addr, None) is not None:
                for receiver in self._rooms.values():
                    if receiver.bootstrap_addr == addr:
                        receiver._last_progress = time.monotonic()
            known = self._incarnations.setdefault(addr, incarnation) if incarnation else None
        if known is not None and known != incarnation:
            self._rebind(addr, incarnation)

    def _rebind(self, addr: str, incarnation: str) -> None:
        """Point the rooms of a restarted encoder at its new rank and repeat what it owes them."""
        with self._lock:
            room = next((r.room for r in self._rooms.values() if r.bootstrap_addr == addr), 0)
        try:
            route = fetch_route(addr, room)
        except ConnectionError as exc:  # asked again at the next heartbeat
            log.warning("encode peer %s restarted but its route is not readable yet: %s", addr, exc)
            return
        with self._lock:  # rooms created meanwhile took the old route: they are in this list too
            rooms = [r for r in self._rooms.values() if r.bootstrap_addr == addr and not r.state.progress.terminal]
            self._incarnations[addr] = route.incarnation or incarnation
            old = self._routes.get(addr)
            self._routes[addr] = route
            if old is not None:
                self._registered.discard((old.rank_ip, old.rank_port))
                self._push.drop(old.rank_ip, old.rank_port)
            for receiver in rooms:
                receiver._rebind(route)
        self.stats["peer_restarted"] += 1
        log.warning("encode peer %s restarted (rank now %s:%d); %d rooms asked again",
                    addr, route.rank_ip, route.rank_port, len(rooms))

    def _declare_dead(self, addr: str, why: str) -> None:
        with self._lock:
            self._heartbeat_misses.pop(addr, None)
            self._incarnations.pop(addr, None)
            route = self._routes.pop(addr, None)
            if route is not None:
                self._registered.discard((route.rank_ip, route.rank_port))
                self._push.drop(route.rank_ip, route.rank_port)
            for receiver in [r for r in self._rooms.values() if r.bootstrap_addr == addr]:
                receiver.state.fail(f"{receiver.peer_name} is dead: {why}")
                receiver._release_failed()
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
        receiver.abort("timeout: no free blocks for the default allocation")
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
            receiver.abort(f"timeout: room not done within {timeout:g}s")
            receiver.failure_exception()
        if receiver.try_resume():
            continue
        receiver.wait(min(left, 0.05 if status == KVPoll.Transferring else 1.0))
    return receiver.assemble()
