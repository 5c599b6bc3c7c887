"""The language worker: prealloc queue -> transfer queue -> consumer.

* prealloc: requests wait in arrival order until the default allocation (block-aligned) is
  free, then send their init;
* transfer: each room is polled; after a partial round the rest is allocated and resumed;
  on ``Success`` the embedding is assembled once and handed to the consumer;
* one scheduler thread drives both queues, woken by status changes (no busy polling); the
  consumer runs on its own thread so digesting one embedding never delays another's resume.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.http_util import HTTPError
from connector.metrics import WorkerMetrics
from connector.mooncake_transport import MooncakeTransport
from connector.poll import KVPoll
from connector.receiver import EmbeddingReceiver, EmbeddingReceiverManager
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


def failure_status(reason: str) -> int:
    return 504 if "timeout" in reason else 502


class LanguageWorker:
    def __init__(self, config: ConnectorConfig, consumer: Consumer | None = None) -> None:
        self.config, self.consumer = config, consumer or DigestConsumer()
        self.pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
        self.allocator = BlockAllocator(config.num_blocks)
        self.transport = MooncakeTransport(config.host, config.protocol, config.ib_device, config.completion)
        self._wake = threading.Event()
        self.receivers = EmbeddingReceiverManager(config, self.transport, self.pool, self.allocator,
                                                  on_change=self._wake.set)
        self.metrics = WorkerMetrics("language", lambda: self.allocator.free_blocks, config.num_blocks)
        self._lock = threading.Lock()
        self._prealloc: collections.deque[_Request] = collections.deque()
        self._transfer: list[_Request] = []
        self._rids: dict[str, _Request] = {}
        self._consumers = ThreadPoolExecutor(1, thread_name_prefix="language-consumer")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="language-scheduler", daemon=True)
        self._thread.start()

    # ---- API ---------------------------------------------------------------------------------

    def submit(self, rid: str, bootstrap_addr: str, room: int) -> Future:
        """Queue a request; the future resolves to the reply body or raises HTTPError."""
        with self._lock:
            if rid in self._rids:
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
        return {"status": "ok", "role": "language", "free_blocks": self.allocator.free_blocks,
                "num_blocks": self.allocator.num_blocks, "queued": queued, "transferring": transferring}

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
            try:
                progressed = self._admit() + self._advance()
            except Exception:  # never let one request stop the scheduler
                log.exception("scheduler step failed")
                progressed = 0
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
            if status == KVPoll.Transferring:
                progressed += receiver.try_resume()
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
