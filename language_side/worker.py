"""The language worker: route lookup -> prealloc queue -> transfer queue -> consumer.

A request moves through ``RequestPhase`` (transitions in ``TRANSITIONS``):

* resolving: its encoder's route is looked up beside the scheduler (cached per peer, one
  lookup per peer at a time), so a peer that does not answer holds up nobody else;
* queued: requests wait in arrival order for the default allocation (block-aligned), then
  send their init. At most ``max_queued_requests`` resolve or wait (more get 503 at once),
  each at most ``queue_timeout`` (then 503);
* transferring: each room is polled; after a partial round the rest is allocated and resumed
  (resumes go before new admissions: a room being received never waits for a new one); on
  ``Success`` the embedding is assembled once;
* consuming: the consumer runs on its own thread, so digesting one embedding never delays
  another's resume.

One scheduler thread drives the queues, woken by status changes (no busy polling). A client
that disconnects (or ``/abort_request``) cancels its request in any phase: the encoder is told
and its blocks come back.

Sleep (``preserve_state=true``) suspends every room with its encoder, keeps what landed in host
memory (and on disk with a checkpoint folder), and releases the pool; wake checks a disk
checkpoint, re-creates the pool under a new generation and continues every request from where
it stood, in queue order. (SGLang's server pauses and resumes its own generations around these:
``sglang_ext/language_server.py``.)
"""

from __future__ import annotations

import collections
import enum
import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from connector import (
    BlockAllocator,
    BufferPool,
    ConnectorConfig,
    Embedding,
    EmbeddingReceiver,
    EmbeddingReceiverManager,
    FailureKind,
    KVPoll,
    RankRoute,
    TransferFailure,
    checked_move,
    health_status,
    pool_blocks,
    worker_transport,
)
from connector import (
    checkpoint as checkpoint_files,
)
from language_side import checkpoint
from language_side.checkpoint import SavedRequest
from language_side.consumers import Consumer, DigestConsumer
from worker_infra.metrics import WorkerMetrics
from worker_infra.sleep import SleepGate

log = logging.getLogger(__name__)


class RequestPhase(enum.Enum):
    RESOLVING = "resolving"  # looking up the encoder's route
    QUEUED = "queued"  # waiting, in order, for the default allocation
    TRANSFERRING = "transferring"  # inited: rounds and resumes until the embedding is assembled
    CONSUMING = "consuming"  # the consumer has the embedding
    SAVED = "saved"  # kept over a sleep
    DONE = "done"
    FAILED = "failed"


Q = RequestPhase
TRANSITIONS: dict[RequestPhase, frozenset[RequestPhase]] = {
    Q.RESOLVING: frozenset({Q.QUEUED, Q.SAVED, Q.FAILED}),
    Q.QUEUED: frozenset({Q.TRANSFERRING, Q.SAVED, Q.FAILED}),
    Q.TRANSFERRING: frozenset({Q.CONSUMING, Q.SAVED, Q.FAILED}),
    Q.CONSUMING: frozenset({Q.DONE, Q.FAILED}),
    Q.SAVED: frozenset({Q.RESOLVING, Q.TRANSFERRING, Q.FAILED}),
    Q.DONE: frozenset(),
    Q.FAILED: frozenset(),
}


# Of the pool, what rooms named by clients (the two-request flow) may hold before their encoder
# says it has them: the rest stays for the rooms this server sends to its encoders itself
CLIENT_ROOM_SHARE = 0.5


@dataclass
class _Request:
    rid: str
    bootstrap_addr: str
    room: int
    phase: RequestPhase = RequestPhase.RESOLVING
    future: Future = field(default_factory=Future)
    arrived_at: float = field(default_factory=time.monotonic)
    queued_at: float = field(default_factory=time.monotonic)
    route: RankRoute | None = None
    receiver: EmbeddingReceiver | None = None
    init_at: float = 0.0
    saved: SavedRequest | None = None  # while the worker sleeps
    restored_from_disk: bool = False  # no client yet: the next /generate with this rid attaches
    named_by_client: bool = False  # the two-request flow: a client named the room, which may not exist

    @property
    def unclaimed(self) -> bool:
        """A client-named room holding blocks that its encoder has not said it has (yet):
        perhaps one made up."""
        return (self.named_by_client and self.phase == Q.TRANSFERRING
                and not (self.receiver is not None and self.receiver.machine.heard))

    def move(self, phase: RequestPhase) -> None:
        self.phase = checked_move(TRANSITIONS, self.phase, phase, f"request {self.rid}")


class LanguageWorker:
    def __init__(self, config: ConnectorConfig, consumer: Consumer | None = None, checkpoint_dir: str | None = None,
                 queue_while_sleeping: bool = False) -> None:
        self.config, self.consumer, self.checkpoint_dir = config, consumer or DigestConsumer(), checkpoint_dir
        self.pool: BufferPool | None = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
        self.allocator: BlockAllocator | None = BlockAllocator(config.num_blocks)
        self.transport = worker_transport(config)
        self._wake = threading.Event()
        restarting = bool(checkpoint_dir) and checkpoint_files.exists(checkpoint_dir, checkpoint.ROLE)
        self.receivers = EmbeddingReceiverManager(config, self.transport, self.pool, self.allocator,
                                                  on_change=self._wake.set, rank_port=checkpoint.stored_zmq_port(
                                                      checkpoint_dir) if restarting else 0)
        self.gate = SleepGate("language", queue_while_sleeping, config.max_sleep)
        self._lock = threading.Lock()
        self._step = threading.Lock()  # held by the scheduler per step; sleep takes it to stop the queues
        self._requests: dict[str, _Request] = {}  # every request not finished, by rid
        self._prealloc: collections.deque[_Request] = collections.deque()
        self._transfer: list[_Request] = []
        self._saved: list[_Request] | None = None  # the in-memory checkpoint while asleep
        self._disk_error = ""  # why the last sleep's checkpoint did not reach the disk
        self._consumers = ThreadPoolExecutor(1, thread_name_prefix="language-consumer")
        self.metrics = WorkerMetrics("language", lambda: pool_blocks(self.allocator), self._queues,
                                     self.receivers.rejections.snapshot)
        self._stop = threading.Event()
        if restarting:
            self._release_pool()  # a checkpoint waits on disk: boot asleep until /wake_up
            self.gate.start_asleep()
        self._thread = threading.Thread(target=self._run, name="language-scheduler", daemon=True)
        self._thread.start()

    # ---- API ---------------------------------------------------------------------------------

    def submit(self, rid: str, bootstrap_addr: str, room: int, named_by_client: bool = False) -> Future:
        """Queue a request; the future resolves to the reply body or raises :class:`TransferFailure`.
        ``named_by_client``: the two-request flow's room, which a client named: such rooms that
        their encoder has not claimed hold at most :data:`CLIENT_ROOM_SHARE` of the pool between
        them (more wait in the queue, the others pass them), so made-up rooms cannot take every
        block for their join wait."""
        with self._lock:
            existing = self._requests.get(rid)
            if existing is not None and existing.restored_from_disk and existing.room == room:
                existing.restored_from_disk = False  # a client for a request restored from disk
                return existing.future
            if existing is not None:
                raise TransferFailure(FailureKind.CONFLICT, f"request {rid!r} is already in progress")
            if any(r.room == room for r in self._requests.values()):
                raise TransferFailure(FailureKind.CONFLICT, f"bootstrap_room {room} is already in use by another request")
            try:
                self.gate.check_admission()
                waiting = sum(1 for r in self._requests.values() if r.phase in (Q.RESOLVING, Q.QUEUED))
                if waiting >= self.config.max_queued_requests:
                    raise TransferFailure(FailureKind.OVERLOADED, f"{waiting} requests are queued "
                                                                  f"(limit {self.config.max_queued_requests})")
            except TransferFailure as exc:  # refused: the encoder drops the room too
                self.receivers.abandon(bootstrap_addr, room)
                self.metrics.failure(exc.kind)
                raise
            req = self._requests[rid] = _Request(rid, bootstrap_addr, room, named_by_client=named_by_client)
        self._resolve(req)
        return req.future

    def _client_share_left(self) -> bool:
        """Whether a client-named room may have its default allocation now: while such rooms not
        claimed yet hold less than their share (one always may). Lock held."""
        per_room = min(self.config.default_allocate_blocks, self.config.num_blocks)
        held = per_room * sum(r.unclaimed for r in self._transfer)
        return held == 0 or held + per_room <= int(self.config.num_blocks * CLIENT_ROOM_SHARE)

    def cancel(self, rid: str, reason: str) -> bool:
        """The client of ``rid`` went away or aborted it: end it in whatever phase it is."""
        with self._lock:
            req = self._requests.get(rid)
            if req is None or req.phase in (Q.CONSUMING, Q.DONE, Q.FAILED):
                return False
            phase = req.phase
            if req.receiver is not None:
                req.receiver.abort(FailureKind.CANCELLED, reason)
            if self._saved is not None and req in self._saved:
                self._saved.remove(req)
        self.metrics.cancelled(phase.value)
        self._fail(req, FailureKind.CANCELLED, reason)
        return True

    def health(self) -> dict:
        free, total = pool_blocks(self.allocator)
        failing = self.receivers.failing.report()
        return {"status": health_status(self.gate.is_sleeping(), failing), "role": "language",
                "state": self.gate.state.value, "free_blocks": free, "num_blocks": total, **self._queues(),
                "failing_encoders": failing}

    def _queues(self) -> dict[str, int]:
        with self._lock:
            phases = collections.Counter(r.phase for r in self._requests.values())
        return {"resolving": phases[Q.RESOLVING], "queued": phases[Q.QUEUED], "transferring": phases[Q.TRANSFERRING]}

    def is_sleeping(self) -> bool:
        return self.gate.is_sleeping()

    # ---- sleep and wake ------------------------------------------------------------------------

    def sleep(self, level: int = 1, preserve_state: bool = False) -> dict:
        """Stop the queues, keep (or abort) every request, release the pool."""
        start = time.monotonic()
        with self.gate.falling_asleep() as proceed:
            if not proceed:
                return {"changed": False, "is_sleeping": True}
            self._disk_error = ""
            with self._step:
                if owed := self.receivers.fork_rounds_owed():  # their blocks cannot be released yet
                    raise TransferFailure(FailureKind.CONFLICT, f"rooms {owed[:8]} wait for a round from a reference-"
                                                                f"fork encoder, which cannot be told to pause; sleep "
                                                                f"again once it has landed")
                kept_bytes = self._sleep_transfers(preserve_state)
                disk = {}
                if preserve_state and self.checkpoint_dir:
                    written_at = time.monotonic()
                    if (written := self._write_checkpoint()) is not None:
                        kept_bytes = written
                        disk = {"checkpoint_bytes": written,
                                "checkpoint_ms": round((time.monotonic() - written_at) * 1e3, 3)}
        self.metrics.slept(level, preserve_state, time.monotonic() - start, disk.get("checkpoint_bytes", kept_bytes))
        kept = len(self._saved or [])
        log.info("language worker asleep (level %d, preserve_state=%s): %d requests kept, %d bytes", level,
                 preserve_state, kept, kept_bytes)
        reply = {"changed": True, "is_sleeping": True, "kept_requests": kept, "kept_bytes": kept_bytes,
                 "seconds": round(time.monotonic() - start, 4), **disk}
        return {**reply, "checkpoint_error": self._disk_error} if self._disk_error else reply

    def _sleep_transfers(self, preserve_state: bool) -> int:
        """Keep (or abort) every transfer and release the pool; the bytes kept."""
        if preserve_state:
            kept_bytes = self._keep_requests()
        else:
            self._abort_requests(FailureKind.ASLEEP, "the language worker went to sleep (preserve_state=false)")
            kept_bytes = 0
        self._consumers.submit(lambda: None).result()  # consumers hold views into the pool
        self._wait_for_blocks()  # of aborted rooms: they come back with the encoders' acks
        try:
            self._release_pool()
        except RuntimeError as exc:  # a block still out: stay awake; kept requests cannot go on
            for req in self._saved or []:
                self._fail(req, FailureKind.INTERNAL, f"the language worker could not fall asleep: {exc}")
            self._saved = None
            raise
        return kept_bytes

    def _write_checkpoint(self) -> int | None:
        """The kept requests on disk; its size, or None (the reason in ``_disk_error``: they stay in
        host memory only)."""
        written, self._disk_error = checkpoint_files.save_or_explain(self.checkpoint_dir, lambda: checkpoint.save(
            self.checkpoint_dir, self._geometry(), [r.saved for r in self._saved or []], self.receivers.rank_port))
        return written

    def _keep_requests(self) -> int:
        with self._lock:
            active = list(self._transfer)
        self.receivers.suspend_all([r.receiver for r in active], timeout=self.config.abort_ack_timeout)
        kept: list[_Request] = []
        for req in active:
            receiver = req.receiver
            status = receiver.poll()
            if status == KVPoll.Success:  # landed before the suspend took effect: finish it now
                self._finish_or_fail(req, receiver)
            elif status == KVPoll.Failed:
                self._fail(req, receiver.state.kind, receiver.state.reason)
            else:
                with self._lock:  # a cancel cannot come between the checkpoint and the move
                    if req.phase != Q.TRANSFERRING:  # cancelled meanwhile
                        continue
                    try:
                        req.saved = SavedRequest(req.rid, req.bootstrap_addr, req.room, receiver.checkpoint())
                        req.move(Q.SAVED)
                        kept.append(req)
                        continue
                    except RuntimeError:  # it failed after the poll above
                        pass
                self._fail(req, receiver.state.kind or FailureKind.PEER_FAILED, receiver.state.reason)
        with self._lock:
            waiting = [r for r in self._requests.values() if r.phase == Q.RESOLVING] + list(self._prealloc)
            for req in waiting:
                req.saved = SavedRequest(req.rid, req.bootstrap_addr, req.room, None)
                req.move(Q.SAVED)
            # queue order: rooms that were transferring, then the queue as it stood
            self._saved = kept + waiting
            self._prealloc.clear()
            self._transfer.clear()
        return sum(r.saved.transfer.landed * (self.pool.row_bytes + 16) for r in kept if r.saved.transfer)

    def _abort_requests(self, kind: FailureKind, reason: str) -> None:
        """Fail every request; aborted rooms' blocks come back with the encoders' acks."""
        with self._lock:
            requests = [r for r in self._requests.values() if r.phase not in (Q.CONSUMING, Q.DONE, Q.FAILED)]
        for req in requests:
            why = reason
            if req.receiver is not None and req.receiver.abort(kind, reason):  # the encoder delivered it: say so
                why = f"{reason} (its embedding had arrived; the request was not served)"
            self._fail(req, kind, why)

    def _wait_for_blocks(self) -> None:
        """Wait (bounded by the ack timeout) for the blocks of aborted rooms; those whose ack did not
        come within it are freed as the pool is deregistered."""
        deadline = time.monotonic() + self.config.longest_abort_hold(self.pool.nbytes if self.pool else 0) + 2
        while (self.allocator is not None and not self.receivers.only_unacked_blocks_out()
               and time.monotonic() < deadline):
            time.sleep(0.01)

    def _release_pool(self) -> None:
        self.receivers.detach_pool()
        self.pool = self.allocator = None

    def wake_up(self, discard_checkpoint: bool = False) -> dict:
        """Re-create the pool under a new generation and continue every kept request."""
        start = time.monotonic()
        with self.gate.waking() as proceed:
            if not proceed:
                return {"changed": False, "is_sleeping": self.gate.is_sleeping()}
            saved = self._saved
            from_disk = saved is None and bool(self.checkpoint_dir) and not discard_checkpoint \
                and checkpoint_files.exists(self.checkpoint_dir, checkpoint.ROLE)
            if from_disk:
                loaded = checkpoint.load(self.checkpoint_dir, self._geometry())  # CheckpointError: 422
                saved = [_Request(s.rid, s.bootstrap_addr, s.room, Q.SAVED, saved=s, restored_from_disk=True)
                         for s in loaded]
                self._saved = saved  # in memory now: a wake-up that fails below is tried again from here
            self.pool = BufferPool(self.config.num_blocks, self.config.block_size, self.config.hidden_size,
                                   self.config.dtype, prefault=False)
            self.allocator = BlockAllocator(self.config.num_blocks)
            self.receivers.attach_pool(self.pool, self.allocator)
            self.pool.prefault_in_background()
            self._restore(saved or [])
            if self.checkpoint_dir:
                checkpoint_files.remove(self.checkpoint_dir, checkpoint.ROLE)
            self._saved = None
        self._wake.set()
        restored = len(saved or [])
        self.metrics.woke(time.monotonic() - start, restored)
        log.info("language worker awake: %d requests restored%s", restored, " from disk" if from_disk else "")
        return {"changed": True, "is_sleeping": False, "restored_requests": restored,
                "seconds": round(time.monotonic() - start, 4)}

    def _restore(self, saved: list[_Request]) -> None:
        """Kept requests go first, in their order: transfers continue, queued ones queue again
        ahead of what arrived while asleep."""
        resolving = []
        with self._lock:
            arrived = list(self._prealloc)
            self._prealloc.clear()
            for req in saved:
                self._requests[req.rid] = req
                if req.saved.transfer is None:
                    req.move(Q.RESOLVING)
                    resolving.append(req)
                else:
                    req.receiver = self.receivers.restore(req.saved.transfer)
                    req.init_at = time.monotonic()
                    req.move(Q.TRANSFERRING)
                    self._transfer.append(req)
                req.saved = None
        for req in resolving:  # routes are cached: these queue again at once, in order
            self._resolve(req)
        with self._lock:
            for req in arrived:  # their wait for blocks starts now
                req.queued_at = time.monotonic()
            self._prealloc.extend(arrived)

    def _geometry(self) -> dict:
        return {"block_size": self.config.block_size, "hidden_size": self.config.hidden_size,
                "dtype": self.config.dtype}

    # ---- shutdown --------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM/SIGINT: refuse new requests, fail every request (503), tell the encoders."""
        self.gate.stop()
        self._abort_requests(FailureKind.SHUTTING_DOWN, "the language worker is shutting down")

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._consumers.shutdown(wait=True)
        self.receivers.close()
        self.transport.close()

    # ---- route lookup (beside the scheduler) -------------------------------------------------------

    def _resolve(self, req: _Request) -> None:
        self.receivers.resolve(req.bootstrap_addr, req.room).add_done_callback(functools.partial(self._resolved, req))

    def _resolved(self, req: _Request, lookup: Future) -> None:
        error = lookup.exception()
        with self._lock:
            if req.phase != Q.RESOLVING:  # cancelled, or put aside by a sleep, meanwhile
                return
            if error is None:
                req.route, req.queued_at = lookup.result(), time.monotonic()
                req.move(Q.QUEUED)
                self._prealloc.append(req)
        if error is not None:
            self._fail(req, FailureKind.PEER_UNREACHABLE, str(error))
        self._wake.set()

    # ---- scheduler -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            progressed = 0
            with self._step:
                if not self.gate.is_sleeping():
                    try:
                        progressed = self._advance() + self._admit()
                    except Exception:  # never let one request stop the scheduler
                        log.exception("scheduler step failed")
            if not progressed:
                self._wake.wait(0.05)

    def _admit(self) -> int:
        """Give queued requests their default allocation, in order (a client-named room over its
        share is passed), and send their inits."""
        admitted = 0
        while True:
            with self._lock:
                now = time.monotonic()
                expired = next((r for r in self._prealloc if now - r.queued_at > self.config.queue_timeout), None)
                share_left = self._client_share_left()
                req = expired or next((r for r in self._prealloc if share_left or not r.named_by_client), None)
            if req is None:
                return admitted
            if expired:
                self._fail(req, FailureKind.OVERLOADED,
                           f"no free blocks for the default allocation within {self.config.queue_timeout:g}s")
                continue
            if dead := self.receivers.dead_peer(req.bootstrap_addr):  # queued before its encoder died
                self._fail(req, FailureKind.PEER_DEAD, f"encode peer {req.bootstrap_addr} is dead: {dead}")
                continue
            blocks = self.allocator.allocate(min(self.config.default_allocate_blocks, self.allocator.num_blocks))
            if blocks is None:
                return admitted
            with self._lock:
                if req not in self._prealloc:  # cancelled while the blocks were found
                    self.allocator.free(blocks)
                    continue
                self._prealloc.remove(req)
                req.move(Q.TRANSFERRING)  # a cancel from here on fails it; the receiver is aborted below
                self._transfer.append(req)
            try:
                receiver = self.receivers.create_receiver(req.bootstrap_addr, req.room, req.route)
            except ValueError as exc:  # another request's room: not this request's to abort
                self.allocator.free(blocks)
                self._fail(req, FailureKind.CONFLICT, str(exc), tell_encoder=False)
                continue
            with self._lock:
                req.receiver, req.init_at = receiver, time.monotonic()
                cancelled = req.phase == Q.FAILED
            receiver.init(blocks)
            if cancelled:
                receiver.abort(FailureKind.CANCELLED, "cancelled while it was admitted")
            admitted += 1

    def _advance(self) -> int:
        """Resume, finish or fail each transferring request."""
        progressed = 0
        with self._lock:
            active = [r for r in self._transfer if r.receiver is not None]
        for req in active:
            receiver = req.receiver
            status = receiver.poll()
            if req.phase != Q.TRANSFERRING:  # cancelled meanwhile
                continue
            if status in (KVPoll.Transferring, KVPoll.WaitingForInput, KVPoll.Bootstrapping):
                progressed += receiver.try_resume()  # after a round, early (total announced), or restored
            elif status == KVPoll.Success:
                self._finish_or_fail(req, receiver)
                progressed += 1
            elif status == KVPoll.Failed:
                self._fail(req, receiver.state.kind, receiver.state.reason)
                progressed += 1
        return progressed

    def _finish_or_fail(self, req: _Request, receiver: EmbeddingReceiver) -> None:
        """A room that read ``Success``: assemble and finish it, or fail it when it was cancelled
        (or failed) since the poll, which gave its blocks back."""
        try:
            emb = receiver.assemble()
        except TransferFailure as exc:
            self._fail(req, exc.kind, str(exc))
            return
        self._finish(req, emb)

    def _finish(self, req: _Request, emb: Embedding) -> None:
        landed = time.monotonic()
        seconds = landed - req.init_at
        with self._lock:
            if req.phase != Q.TRANSFERRING:  # cancelled after it was assembled
                emb.release()
                return
            req.move(Q.CONSUMING)
            self._transfer.remove(req)
        receiver = req.receiver
        assert receiver is not None

        def consume() -> None:
            try:
                extra = self.consumer.consume(req.rid, emb)
            except Exception as exc:
                log.exception("consumer failed for %s", req.rid)
                self._fail(req, FailureKind.INTERNAL, f"consumer failed: {type(exc).__name__}: {exc}")
                return
            finally:
                emb.release()
            self.metrics.success(emb.num_tokens, emb.embeddings.nbytes, receiver.resume_rounds, seconds)
            with self._lock:
                req.move(Q.DONE)
                self._requests.pop(req.rid, None)
            req.future.set_result({"rid": req.rid, "num_tokens": emb.num_tokens, "resume_rounds": receiver.resume_rounds,
                                   "queue_ms": round((req.init_at - req.arrived_at) * 1e3, 3),
                                   "encoder_wait_ms": round(((receiver.sending_at or req.init_at) - req.init_at) * 1e3, 3),
                                   "transfer_ms": round(seconds * 1e3, 3),
                                   # from the landing to the consumer's end (its wait for the thread included)
                                   "copy_ms": round((time.monotonic() - landed) * 1e3, 3), **extra})

        self._consumers.submit(consume)

    def _fail(self, req: _Request, kind: FailureKind, reason: str, tell_encoder: bool = True) -> None:
        """End a request with ``kind``. One that never sent its init, or is kept over a sleep,
        tells its encoder, so the room's encode request ends too (before any work, if it has not
        started); a room in transfer was aborted by the caller through its receiver."""
        with self._lock:
            if req.phase in (Q.DONE, Q.FAILED):
                return
            abandon = tell_encoder and (req.receiver is None or req.phase == Q.SAVED)  # no receiver to abort
            route = req.route or (req.saved.transfer.route if req.saved and req.saved.transfer else None)
            req.move(Q.FAILED)
            if req in self._transfer:
                self._transfer.remove(req)
            if req in self._prealloc:
                self._prealloc.remove(req)
            self._requests.pop(req.rid, None)
        self.metrics.failure(kind)
        log.warning("rid=%s room=%d failed: %s", req.rid, req.room, reason)
        # failed here before the encoder hears of it: its answer to the caller ("aborted by language
        # peer") must not arrive before this worker's own reason
        req.future.set_exception(TransferFailure(kind, f"request {req.rid}: {kind.value}: {reason}"))
        if abandon:
            self.receivers.abandon(req.bootstrap_addr, req.room, route)
