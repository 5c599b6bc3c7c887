"""The language worker: prealloc queue -> transfer queue -> consumer.

* prealloc: requests wait in arrival order until the default allocation (block-aligned) is
  free, then send their init;
* transfer: each room is polled; after a partial round the rest is allocated and resumed;
  on ``Success`` the embedding is assembled once and handed to the consumer;
* one scheduler thread drives both queues, woken by status changes (no busy polling); the
  consumer runs on its own thread so digesting one embedding never delays another's resume.

Sleep (``preserve_state=true``) suspends every room with its encoder, keeps what landed in
host memory (and on disk with a checkpoint folder), and releases the pool; wake re-creates it
under a new generation and continues every request from where it stood, in queue order.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from connector import checkpoint as checkpoint_files
from connector.allocator import BlockAllocator, pool_blocks
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.http_util import HTTPError
from connector.metrics import WorkerMetrics
from connector.mooncake_transport import MooncakeTransport
from connector.poll import KVPoll
from connector.receiver import EmbeddingReceiver, EmbeddingReceiverManager
from connector.sleep import SleepGate
from language_side import checkpoint
from language_side.checkpoint import SavedRequest
from language_side.consumers import Consumer, DigestConsumer

log = logging.getLogger(__name__)


@dataclass
class _Request:
    rid: str
    bootstrap_addr: str
    room: int
    future: Future = field(default_factory=Future)
    queued_at: float = field(default_factory=time.monotonic)
    receiver: EmbeddingReceiver | None = None
    init_at: float = 0.0
    saved: SavedRequest | None = None  # while the worker sleeps
    restored_from_disk: bool = False  # no client yet: the next /generate with this rid attaches


def failure_status(reason: str) -> int:
    return 504 if "timeout" in reason else 502


class LanguageWorker:
    def __init__(self, config: ConnectorConfig, consumer: Consumer | None = None, checkpoint_dir: str | None = None,
                 queue_while_sleeping: bool = False) -> None:
        self.config, self.consumer, self.checkpoint_dir = config, consumer or DigestConsumer(), checkpoint_dir
        self.pool: BufferPool | None = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
        self.allocator: BlockAllocator | None = BlockAllocator(config.num_blocks)
        self.transport = MooncakeTransport(config.host, config.protocol, config.ib_device, config.completion)
        self._wake = threading.Event()
        self.receivers = EmbeddingReceiverManager(config, self.transport, self.pool, self.allocator,
                                                  on_change=self._wake.set)
        self.metrics = WorkerMetrics("language", lambda: pool_blocks(self.allocator))
        self.gate = SleepGate("language", queue_while_sleeping, config.max_sleep)
        self._lock = threading.Lock()
        self._step = threading.Lock()  # held by the scheduler per step; sleep takes it to stop the queues
        self._prealloc: collections.deque[_Request] = collections.deque()
        self._transfer: list[_Request] = []
        self._rids: dict[str, _Request] = {}
        self._saved: list[_Request] | None = None  # the in-memory checkpoint while asleep
        self._disk_error = ""  # why the last sleep's checkpoint did not reach the disk
        self._consumers = ThreadPoolExecutor(1, thread_name_prefix="language-consumer")
        self._stop = threading.Event()
        if checkpoint_dir and checkpoint_files.exists(checkpoint_dir, checkpoint.ROLE):
            self._release_pool()  # a checkpoint waits on disk: boot asleep until /wake_up
            self.gate.start_asleep()
        self._thread = threading.Thread(target=self._run, name="language-scheduler", daemon=True)
        self._thread.start()

    # ---- API ---------------------------------------------------------------------------------

    def submit(self, rid: str, bootstrap_addr: str, room: int) -> Future:
        """Queue a request; the future resolves to the reply body or raises HTTPError."""
        with self._lock:
            existing = self._rids.get(rid)
            if existing is not None and existing.restored_from_disk and existing.room == room:
                existing.restored_from_disk = False  # a client for a request restored from disk
                return existing.future
            self.gate.check_admission()
            if existing is not None:
                raise HTTPError(409, f"request {rid!r} is already in progress")
            if any(r.room == room for r in self._rids.values()):
                raise HTTPError(409, f"bootstrap_room {room} is already in use by another request")
            req = _Request(rid, bootstrap_addr, room)
            self._rids[rid] = req
            self._prealloc.append(req)
        self._wake.set()
        return req.future

    def health(self) -> dict:
        with self._lock:
            queued, transferring = len(self._prealloc), len(self._transfer)
        free, total = pool_blocks(self.allocator)
        return {"status": "sleeping" if self.gate.is_sleeping() else "ok", "role": "language",
                "state": self.gate.state.value, "free_blocks": free, "num_blocks": total, "queued": queued,
                "transferring": transferring}

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
                kept_bytes = self._keep_requests() if preserve_state else self._abort_requests()
                self._consumers.submit(lambda: None).result()  # consumers hold views into the pool
                self._release_pool()
        self.metrics.slept(level, preserve_state, time.monotonic() - start, kept_bytes)
        kept = len(self._saved or [])
        log.info("language worker asleep (level %d, preserve_state=%s): %d requests kept, %d bytes",
                 level, preserve_state, kept, kept_bytes)
        reply = {"changed": True, "is_sleeping": True, "kept_requests": kept, "kept_bytes": kept_bytes,
                 "seconds": round(time.monotonic() - start, 4)}
        return {**reply, "checkpoint_error": self._disk_error} if self._disk_error else reply

    def _keep_requests(self) -> int:
        with self._lock:
            active = list(self._transfer)
        self.receivers.suspend_all([r.receiver for r in active], timeout=self.config.abort_ack_timeout)
        kept: list[_Request] = []
        for req in active:
            receiver = req.receiver
            status = receiver.poll()
            if status == KVPoll.Success:  # landed before the suspend took effect: finish it now
                self._finish(req, receiver.assemble(), time.monotonic() - req.init_at)
            elif status == KVPoll.Failed:
                self._fail(req, failure_status(receiver.state.reason), receiver.state.reason)
            else:
                req.saved = SavedRequest(req.rid, req.bootstrap_addr, req.room, receiver.checkpoint())
                kept.append(req)
        with self._lock:
            for req in self._prealloc:
                req.saved = SavedRequest(req.rid, req.bootstrap_addr, req.room, None)
            # queue order: rooms that were transferring, then the queue as it stood
            self._saved = kept + list(self._prealloc)
            self._prealloc.clear()
            self._transfer.clear()
        kept_bytes = sum(r.saved.transfer.landed * (self.pool.row_bytes + 16) for r in kept if r.saved.transfer)
        if self.checkpoint_dir:
            written, self._disk_error = checkpoint_files.save_or_explain(self.checkpoint_dir, lambda: checkpoint.save(
                self.checkpoint_dir, self._geometry(), [r.saved for r in self._saved]))
            kept_bytes = kept_bytes if written is None else written
        return kept_bytes

    def _abort_requests(self) -> int:
        reason = "the language worker went to sleep (preserve_state=false)"
        with self._lock:
            active, queued = list(self._transfer), list(self._prealloc)
            self._prealloc.clear()
        for req in active:
            req.receiver.abort(reason)
        for req in active + queued:
            self._fail(req, 503, reason)
        deadline = time.monotonic() + self.config.abort_ack_timeout + 2
        while not self.allocator.all_free() and time.monotonic() < deadline:  # blocks return with the acks
            time.sleep(0.01)
        return 0

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
                loaded = checkpoint.load(self.checkpoint_dir, self._geometry())  # CheckpointError: HTTP 422
                saved = [_Request(s.rid, s.bootstrap_addr, s.room, saved=s, restored_from_disk=True) for s in loaded]
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
        with self._lock:
            queued_while_asleep = list(self._prealloc)
            self._prealloc.clear()
            for req in saved:
                self._rids[req.rid] = req
                if req.saved.transfer is None:
                    req.queued_at = time.monotonic()
                    self._prealloc.append(req)
                else:
                    req.receiver = self.receivers.restore(req.saved.transfer)
                    req.init_at = time.monotonic()
                    self._transfer.append(req)
                req.saved = None
            self._prealloc.extend(queued_while_asleep)

    def _geometry(self) -> dict:
        return {"block_size": self.config.block_size, "hidden_size": self.config.hidden_size,
                "dtype": self.config.dtype}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._consumers.shutdown(wait=True)
        self.receivers.close()
        self.transport.close()

    # ---- scheduler -----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            progressed = 0
            with self._step:
                if not self.gate.is_sleeping():
                    try:
                        progressed = self._admit() + self._advance()
                    except Exception:  # never let one request stop the scheduler
                        log.exception("scheduler step failed")
            if not progressed:
                self._wake.wait(0.05)

    def _admit(self) -> int:
        """Give queued requests their default allocation, in order, and send their inits."""
        admitted = 0
        while True:
            with self._lock:
                if not self._prealloc:
                    return admitted
                req = self._prealloc[0]
            if time.monotonic() - req.queued_at > self.config.waiting_timeout:
                self._pop_prealloc(req)
                self._fail(req, 503, f"no free blocks for the default allocation within {self.config.waiting_timeout:g}s")
                continue
            blocks = self.allocator.allocate(min(self.config.default_allocate_blocks, self.allocator.num_blocks))
            if blocks is None:
                return admitted
            self._pop_prealloc(req)
            try:
                req.receiver = self.receivers.create_receiver(req.bootstrap_addr, req.room)
            except (ConnectionError, ValueError) as exc:
                self.allocator.free(blocks)
                self._fail(req, 502 if isinstance(exc, ConnectionError) else 409, str(exc))
                continue
            req.init_at = time.monotonic()
            req.receiver.init(blocks)
            with self._lock:
                self._transfer.append(req)
            admitted += 1

    def _pop_prealloc(self, req: _Request) -> None:
        with self._lock:
            self._prealloc.remove(req)

    def _advance(self) -> int:
        progressed = 0
        with self._lock:
            active = list(self._transfer)
        for req in active:
            receiver = req.receiver
            assert receiver is not None
            status = receiver.poll()
            if status in (KVPoll.Transferring, KVPoll.WaitingForInput, KVPoll.Bootstrapping):
                progressed += receiver.try_resume()  # after a round, early (total announced), or restored
            elif status == KVPoll.Success:
                self._finish(req, receiver.assemble(), time.monotonic() - req.init_at)
                progressed += 1
            elif status == KVPoll.Failed:
                reason = receiver.state.reason
                self._fail(req, failure_status(reason), reason)
                progressed += 1
        return progressed

    def _finish(self, req: _Request, emb: Embedding, seconds: float) -> None:
        self._drop(req)
        receiver = req.receiver
        assert receiver is not None

        def consume() -> None:
            try:
                extra = self.consumer.consume(req.rid, emb)
            except Exception as exc:
                log.exception("consumer failed for %s", req.rid)
                self.metrics.failure("consumer")
                req.future.set_exception(HTTPError(500, f"consumer failed: {type(exc).__name__}: {exc}"))
                return
            finally:
                emb.release()
            self.metrics.success(emb.num_tokens, emb.embeddings.nbytes, receiver.resume_rounds, seconds)
            req.future.set_result({"rid": req.rid, "num_tokens": emb.num_tokens, "resume_rounds": receiver.resume_rounds,
                                   "transfer_ms": round(seconds * 1e3, 3), **extra})

        self._consumers.submit(consume)

    def _fail(self, req: _Request, status: int, reason: str) -> None:
        self._drop(req)
        self.metrics.failure(_reason_label(reason))
        log.warning("rid=%s room=%d failed: %s", req.rid, req.room, reason)
        req.future.set_exception(HTTPError(status, f"request {req.rid}: {reason}"))

    def _drop(self, req: _Request) -> None:
        with self._lock:
            if req in self._transfer:
                self._transfer.remove(req)
            self._rids.pop(req.rid, None)


def _reason_label(reason: str) -> str:
    """A low-cardinality label for the failures metric."""
    for label in ("timeout", "dead", "mismatch", "aborted", "unreachable", "reported failure", "inconsistent",
                  "no free blocks"):
        if label in reason:
            return label.replace(" ", "_")
    return "other"
