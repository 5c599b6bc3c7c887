"""The encode worker: images (or videos, or audio) -> encoder -> host staging -> connector sender -> delivered.

One request (``POST /encode``), each step bounded:

1. admission: at most ``max_queued_requests`` requests between arrival and answer, else 503
   at once (not for a room a language worker already asked for);
2. fetch every image and read its header (400 on bad input); the token count follows from the
   sizes, so an embedding that can never fit the pool is refused (413) before any work, as are
   images that cannot be decoded together within the decode budget;
3. reserve host memory for the embedding (:class:`connector.ByteBudget`): at once
   if a language worker already asked for the room, else in arrival order within the budget,
   waiting at most ``queue_timeout`` (then 503);
4. with the cluster's embedding cache, take the items it holds, or another request here is
   encoding, from there (``shared_encodings``); for the rest, reserve the memory to decode and
   preprocess them (``MediaPolicy.decode_bytes``, in arrival order, at most ``queue_timeout``),
   decode, encode (one forward pass at a time; skipped if the room failed meanwhile), give it
   back, and write what was encoded to the cache. Always after step 3: a request that holds
   decode memory waits for nothing but the encoder, so no wait cycle can form;
5. hand the embedding to the room's sender, which places it in pool blocks and writes it in
   as many rounds as the language side asks for;
6. answer once every destination has every token (200), or with the failure's status: 5xx
   naming the peer, 503 with ``Retry-After`` for capacity. ``"wait_for_delivery": false``
   answers after step 5 instead (``"delivered": false``).

A request that fails or is refused at any step fails its room on both sides (its language peer,
now or when its init comes, gets ``Failed`` with the reason); a client that disconnects
cancels its request the same way. Nothing runs for a room nobody waits for.

Sleep lets running encodes finish, stops every write, keeps each room's embedding in host
memory (``preserve_state=true``) or fails the rooms (``false``), releases the pool and offloads
the weights; the bootstrap server stays up and reports ``SLEEPING`` so peers wait. With a
checkpoint folder the kept rooms also go to disk, ``/health`` says ``SLEEPING checkpointed``
(peers then wait even while this process is gone), and a worker started on that folder boots
asleep and continues those rooms after ``/wake_up``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from PIL import Image
from prometheus_client import Counter

from connector import (
    AUX_INTS,
    DTYPE_SIZES,
    BlockAllocator,
    BootstrapServer,
    BufferPool,
    ByteBudget,
    CheckpointError,
    ConnectorConfig,
    Embedding,
    EmbeddingSender,
    EmbeddingSenderManager,
    FailureKind,
    SenderRoomCheckpoint,
    TransferFailure,
    health_status,
    pool_blocks,
    worker_transport,
)
from connector import (
    checkpoint as checkpoint_files,
)
from embedding_side import checkpoint
from embedding_side.audio import decode_bytes as audio_decode_bytes
from embedding_side.audio import open_audio
from embedding_side.encoders import EncodedImages, VisionEncoder, decode_bytes, tokens_for
from embedding_side.images import ImageInputError, MediaPolicy, decode_image, fetch_image, is_remote, open_image_bytes
from embedding_side.positions import image_positions, sequence_positions
from embedding_side.shared_encodings import SharedEncodings, join_items, rows_of, split_items
from embedding_side.videos import decode_bytes as video_decode_bytes
from embedding_side.videos import open_video
from worker_infra.embedding_store import EmbeddingStore, StoredMedia
from worker_infra.futures import wait_for_future
from worker_infra.heap import give_back_free_pages
from worker_infra.metrics import WorkerMetrics
from worker_infra.sleep import SleepGate, WorkerState

# Idle between requests: the heaps' free pages go back to the system, at most this often.
TRIM_INTERVAL_S = 1.0

log = logging.getLogger(__name__)


async def _unless_failed(sender: EmbeddingSender, work: Future, timeout: float | None = None) -> object:
    """``work``'s result, or the room's failure as soon as the room fails (the worker stops, the
    language peer aborts it): the client is answered then, not when a 4K forward pass ends or a
    memory grant comes. Work not started yet then never starts (a pass under way ends on its own,
    its result going nowhere); TimeoutError when neither came within ``timeout``."""
    finished = asyncio.wrap_future(work)
    failed = asyncio.wrap_future(sender.delivered)  # fails with the room; set only after a send
    for waited in (finished, failed):
        waited.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if nobody awaits it
    try:
        done, _ = await asyncio.wait({finished, failed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()  # not started yet: it never will be
        raise
    if finished not in done:
        work.cancel()
        if failed in done:
            failed.result()  # raises the room's failure
        raise TimeoutError
    return finished.result()


class EncodeWorker:
    def __init__(self, config: ConnectorConfig, encoder: VisionEncoder, bootstrap_port: int,
                 media: MediaPolicy | None = None, queue_while_sleeping: bool = False,
                 checkpoint_dir: str | None = None, store: EmbeddingStore | None = None) -> None:
        if encoder.hidden_size != config.hidden_size:
            raise ValueError(f"encoder output width {encoder.hidden_size} != configured hidden size {config.hidden_size}")
        self.config, self.encoder, self.media = config, encoder, media or MediaPolicy()
        self.checkpoint_dir = checkpoint_dir
        # the cluster's embedding cache, and this worker's items being encoded now (None: neither)
        self.shared = SharedEncodings(store, encoder.fingerprint) if store is not None else None
        self.pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
        self.allocator = BlockAllocator(config.num_blocks)
        self.transport = worker_transport(config)
        self.sender = EmbeddingSenderManager(config, self.transport, self.pool, self.allocator)
        self.gate = SleepGate("encode", queue_while_sleeping, config.max_sleep)
        self._on_disk = False  # asleep with every kept room written to the checkpoint folder
        self.bootstrap = BootstrapServer(config.host, bootstrap_port, health_status=self._bootstrap_health,
                                         secret=config.secret)
        self.bootstrap.put_route(1, 1, config.public_host, self.sender.rank_port, 0)
        self._loaders = ThreadPoolExecutor(4, thread_name_prefix="encode-load")
        # remote images on their own threads: slow servers cannot hold up local files and data: URIs
        self._fetchers = ThreadPoolExecutor(4, thread_name_prefix="encode-fetch")
        # One forward pass at a time (the cores are few), or as many requests as the encoder fuses
        # into one (SGLang's batches whatever its threads have submitted when it starts a pass).
        self._compute = ThreadPoolExecutor(encoder.max_batch, thread_name_prefix="encode-compute")
        self._lock = threading.Lock()
        self._pending: set[str] = set()  # rids between arrival and answer
        self._computing = 0
        self._trimmed_at = 0.0  # time.monotonic() of the last give_back_free_pages
        self.decoding = ByteBudget(self.media.decode_bytes)  # under _lock
        # Notified when an encode's forward pass ends. On the same lock as the check before one
        # starts, so a sleep cannot see none running while one is about to.
        self._idle = threading.Condition(self._lock)
        self.metrics = WorkerMetrics("encode", lambda: pool_blocks(self.allocator), self._queues,
                                     self.sender.rejections.snapshot)
        self.items = Counter("epd_encoder_items", "Images, videos and clips by where their embedding came from: "
                             "encoded here, or reused (the cluster's cache, or a request here encoding it)", ["source"],
                             registry=self.metrics.registry)
        for collector in store.collectors if store is not None else ():
            self.metrics.registry.register(collector)
        self._restart = bool(checkpoint_dir) and checkpoint_files.exists(checkpoint_dir, checkpoint.ROLE)
        if self._restart:  # a checkpoint waits on disk: boot asleep until /wake_up
            self.sender.pause()
            self.sender.detach_pool()
            self.pool = self.allocator = None
            self._on_disk = True
            self.gate.start_asleep()

    def _bootstrap_health(self) -> str:
        if not self.gate.is_sleeping():
            return "OK"
        return "SLEEPING checkpointed" if self._on_disk else "SLEEPING"

    def _queues(self) -> dict[str, int]:
        with self._lock:
            decoding = {"decode_bytes": self.decoding.used, "decode_waiting": self.decoding.waiting}
        return {"pending": len(self._pending), **decoding, **self.sender.queue_stats()}

    # ---- one request -----------------------------------------------------------------------------

    async def encode(self, rid: str, room: int, image_refs: list, wait_for_delivery: object = True,
                     video_refs: list | None = None, audio_refs: list | None = None,
                     cache_salt: str | None = None) -> dict:
        """Encode one request (its images, videos or audio clips: one kind) and deliver it;
        returns the HTTP reply body or raises :class:`TransferFailure` (its kind gives the HTTP
        status). ``cache_salt``: the request's tenant in the cluster's cache (SGLang's field)."""
        start = time.monotonic()
        given = {kind: refs for kind, refs in (("image", image_refs), ("video", video_refs), ("audio", audio_refs))
                 if refs}
        modality, refs = next(iter(given.items()), ("image", image_refs))
        try:
            if len(given) > 1:
                raise TransferFailure(FailureKind.BAD_REQUEST, "a request carries images, videos or audios: one kind")
            if not refs or len(refs) > self.media.max_images:
                raise TransferFailure(FailureKind.BAD_REQUEST,
                                      f"{modality}s must be a list of 1 to {self.media.max_images} references")
            if not all(isinstance(ref, str) for ref in refs):
                raise TransferFailure(FailureKind.BAD_REQUEST,
                                      f"{modality}s must be strings (path, file://, http(s):// or data: URI)")
            if modality not in self.encoder.modalities:
                raise TransferFailure(FailureKind.BAD_REQUEST, f"this encode worker's encoder ({self.encoder.name}) "
                                                               f"takes {' and '.join(self.encoder.modalities)}s only")
            if not isinstance(wait_for_delivery, bool):
                raise TransferFailure(FailureKind.BAD_REQUEST, "wait_for_delivery must be true or false")
            await self.gate.wait_awake()
            self._enter(rid, room)
        except TransferFailure as exc:
            if exc.kind != FailureKind.CONFLICT:  # a duplicate must not fail the request that owns the room
                self.sender.refuse(room, exc.kind, str(exc))
            self.metrics.failure(exc.kind)
            raise
        except asyncio.CancelledError:  # the client went away while it waited for the wake-up
            self.sender.refuse(room, FailureKind.CANCELLED, "the encode request's client went away")
            raise
        try:
            try:
                sender = self.sender.create_sender(room)
            except ValueError as exc:
                raise TransferFailure(FailureKind.CONFLICT, str(exc)) from None
            try:
                reply, encoded_at = await self._encode(rid, sender, modality, refs, cache_salt)
                if wait_for_delivery:
                    await wait_for_future(sender.delivered, lambda: None)
                    reply["send_ms"] = round((time.monotonic() - encoded_at) * 1e3, 3)  # to the last round's ack
            except TransferFailure as exc:
                sender.abort(exc.kind, str(exc))
                raise
            except asyncio.CancelledError:
                self.metrics.cancelled(sender.phase.value)
                sender.abort(FailureKind.CANCELLED, "the encode request's client went away")
                raise
            except Exception as exc:  # a bug or an encoder error: fail the room on both sides too
                log.exception("rid=%s room=%d: encode failed", rid, room)
                failure = TransferFailure(FailureKind.INTERNAL, f"encode failed: {type(exc).__name__}: {exc}")
                sender.abort(failure.kind, str(failure))
                raise failure from exc
        except TransferFailure as exc:
            self.metrics.failure(exc.kind)
            raise
        finally:
            self._leave(rid)
        tokens = reply["num_tokens"]
        self.metrics.success(tokens, tokens * self.config.hidden_size * DTYPE_SIZES[self.config.dtype], 0,
                             time.monotonic() - start)
        return {**reply, "delivered": wait_for_delivery}

    def _enter(self, rid: str, room: int) -> None:
        with self._lock:
            self.gate.check_admission()
            if rid in self._pending:
                raise TransferFailure(FailureKind.CONFLICT, f"request {rid!r} is already being encoded")
            # A room a language worker already holds blocks for is never refused for being one too
            # many: that worker waits on it (docs/flow_control.md).
            if len(self._pending) >= self.config.max_queued_requests and not self.sender.asked_for(room):
                raise TransferFailure(FailureKind.OVERLOADED, f"{len(self._pending)} encode requests are queued "
                                                              f"(limit {self.config.max_queued_requests})")
            self._pending.add(rid)

    def _leave(self, rid: str) -> None:
        with self._lock:
            self._pending.discard(rid)
            idle = not self._pending
        now = time.monotonic()
        if idle and now - self._trimmed_at >= TRIM_INTERVAL_S:
            self._trimmed_at = now
            with contextlib.suppress(RuntimeError):  # closed (the process ends): nothing to give back
                self._loaders.submit(give_back_free_pages)

    async def _encode(self, rid: str, sender: EmbeddingSender, modality: str, refs: list[str],
                      cache_salt: str | None = None) -> tuple[dict, float]:
        """Steps 2 to 5 of the module docstring; returns the reply body and when the embedding
        was ready (``time.monotonic()``)."""
        loop = asyncio.get_running_loop()
        sender.failure_exception()  # aborted by its language peer before it arrived
        try:
            reader = self._fetchers if any(is_remote(ref) for ref in refs) else self._loaders
            items, digests = await loop.run_in_executor(reader, self._open, modality, refs)
        except ImageInputError as exc:
            raise TransferFailure(FailureKind.BAD_REQUEST, str(exc)) from None
        try:
            if modality == "image":
                item_tokens = [tokens_for(image, self.encoder) for image in items]
                decode_needs = [decode_bytes(image, self.encoder.resize) for image in items]
            elif modality == "video":
                samplings = [self.encoder.video_sampling(clip) for clip in items]
                item_tokens = [sampling.tokens for sampling in samplings]
                decode_needs = list(map(video_decode_bytes, items, samplings))
            else:
                item_tokens = [self.encoder.audio_tokens(clip) for clip in items]
                decode_needs = list(map(audio_decode_bytes, items))
        except ValueError as exc:  # e.g. an aspect ratio Qwen refuses, a clip too short to sample
            raise TransferFailure(FailureKind.BAD_REQUEST, f"cannot encode: {exc}") from None
        tokens, decode_need = sum(item_tokens), sum(decode_needs)
        if self.sender.blocks_for(tokens) > self.config.num_blocks:
            raise TransferFailure(FailureKind.TOO_LARGE, f"the embedding needs {self.sender.blocks_for(tokens)} "
                                                         f"blocks ({tokens} tokens); the encode pool has "
                                                         f"{self.config.num_blocks}")
        if decode_need > self.decoding.limit:
            raise TransferFailure(FailureKind.TOO_LARGE, f"decoding these {modality}s takes about {decode_need} "
                                                         f"bytes, over the decode budget of {self.decoding.limit} "
                                                         f"(--decode-memory-bytes); send fewer or smaller ones")
        await self._granted(sender, sender.admit(self.sender.staged_bytes_for(tokens)), lambda: (
            f"no host memory for the embedding within {self.config.queue_timeout:g}s ({self.sender.staging.used} "
            f"of {self.config.staging_bytes} bytes staged)"))
        started = time.monotonic()
        keys = self.shared.keys(modality, digests, cache_salt) if self.shared is not None else []
        reused, claims = await self.shared.reuse(keys, lambda claim: _unless_failed(sender, claim)) if keys else ({}, {})
        todo = [i for i in range(len(items)) if i not in reused or not self._fits(reused[i], item_tokens[i], modality)]
        try:
            encoded = await self._encode_items(sender, modality, [items[i] for i in todo], [refs[i] for i in todo],
                                               sum(decode_needs[i] for i in todo))
            fresh = split_items(encoded, self.encoder.merge_size) if encoded is not None and (claims or reused) else []
            if claims:
                self.shared.settle(claims, [keys[i] for i in todo], fresh)
        finally:
            if claims:
                self.shared.abandon(claims)
        self.items.labels("encoded").inc(len(todo))
        self.items.labels("reused").inc(len(refs) - len(todo))
        if len(todo) < len(refs):  # some reused: the request's items joined in order
            made = dict(zip(todo, fresh, strict=True))
            encoded = join_items([made.get(i) or reused[i] for i in range(len(refs))], self.encoder.hidden_size)
        embedding = self._embedding(modality, encoded)
        if embedding.num_tokens != tokens:  # the staging reserved above was for the tokens foreseen
            # a video whose frames are not what its header says is the input's fault; an image's
            # size (and a clip's length) come from what was decoded, so there it would be this worker's
            raise TransferFailure(FailureKind.BAD_REQUEST if modality == "video" else FailureKind.INTERNAL,
                                  f"the encoder made {embedding.num_tokens} tokens of these {modality}s where their "
                                  f"headers gave {tokens}")
        encoded_at = time.monotonic()  # decode, preprocess and forward pass
        sender.send(embedding)
        log.info("rid=%s room=%d: %d %ss -> %d tokens%s", rid, sender.room, len(refs), modality,
                 embedding.num_tokens, f" ({len(refs) - len(todo)} reused)" if len(todo) < len(refs) else "")
        # On a thread, beside the transfer: 40-60 ms for a 4K image's rows, which would hold up
        # this loop's other requests (and the language side's health probes) meanwhile.
        sha256 = await asyncio.to_thread(embedding.sha256)
        return {"rid": rid, "modality": modality, "num_tokens": embedding.num_tokens,
                "hidden_size": embedding.hidden_size, "dtype": embedding.dtype, "sha256": sha256,
                "grid_thw": [list(g) for g in encoded.grid_thw], **encoded.extras,
                "encode_ms": round((encoded_at - started) * 1e3, 3), "reused": len(refs) - len(todo),
                "preprocessing": self.encoder.fingerprint()}, encoded_at

    async def _encode_items(self, sender: EmbeddingSender, modality: str, items: list, refs: list[str],
                            decode_need: int) -> EncodedImages | None:
        """Decode (images) and encode ``items`` within the decode budget (None: no items)."""
        if not items:
            return None
        with self._lock:
            decode_grant = self.decoding.request(sender.room, decode_need, urgent=False)
        work: Future | None = None  # the decode or forward pass under way on a worker thread
        try:
            await self._granted(sender, decode_grant, lambda: (
                f"no memory to decode the {modality}s within {self.config.queue_timeout:g}s ({self.decoding.used} "
                f"of {self.decoding.limit} decode bytes in use)"))
            if modality == "image":  # a video or audio clip is decoded by the encoder itself
                try:
                    work = self._loaders.submit(self._decode, items, refs)
                    items = await _unless_failed(sender, work)
                except ImageInputError as exc:
                    raise TransferFailure(FailureKind.BAD_REQUEST, str(exc)) from None
            while True:
                work = self._compute.submit(self._run_encoder, sender, modality, items)
                if (encoded := await _unless_failed(sender, work)) is not None:
                    break
                await self.gate.wait_awake()  # it fell asleep before this encode could start
        finally:
            del items  # the decoded pixels go before the budget they were counted in
            release = lambda *_: self._release_decoding(sender.room)  # noqa: E731
            if work is not None and not work.done():  # cancelled meanwhile: the thread still holds the memory
                work.add_done_callback(release)
            else:
                release()
        return encoded

    def _fits(self, item: StoredMedia, tokens: int, modality: str) -> bool:
        """Whether a reused item is what this request's headers foresee: its rows and its grid
        that many tokens, each row this worker's width (else it is encoded again)."""
        merge = 1 if modality == "audio" else self.encoder.merge_size
        width = self.config.hidden_size * DTYPE_SIZES[self.config.dtype]
        return item.rows.shape == (tokens, width) and rows_of(item.grid, merge) == tokens

    def _release_decoding(self, room: int) -> None:
        with self._lock:
            self.decoding.release(room)

    async def _granted(self, sender: EmbeddingSender, grant: Future, why_not: Callable[[], str]) -> None:
        """Wait up to ``queue_timeout`` for a memory grant; 503 with ``why_not()`` after that. A room
        that fails meanwhile (its language peer aborted it or went away, its bootstrap wait ended)
        answers its client at once with that failure, and its place in the queue goes."""
        try:
            await _unless_failed(sender, grant, self.config.queue_timeout)
        except TimeoutError:
            raise TransferFailure(FailureKind.OVERLOADED, why_not()) from None

    def _open(self, modality: str, refs: list[str]) -> tuple[list, list[str]]:
        """Each reference fetched and its header read (images not decoded yet), and the SHA-256
        of each one's bytes (what the cluster's cache keys it by)."""
        if modality == "image":
            fetched = [fetch_image(ref, self.media) for ref in refs]
            items = [open_image_bytes(data, ref, self.media) for data, ref in zip(fetched, refs, strict=True)]
        else:
            items = [(open_video if modality == "video" else open_audio)(ref, self.media) for ref in refs]
            fetched = [clip.data for clip in items]
        digests = [hashlib.sha256(data).hexdigest() for data in fetched] if self.shared is not None else []
        return items, digests

    @staticmethod
    def _decode(images: list[Image.Image], refs: list[str]) -> list[Image.Image]:
        return [decode_image(image, ref) for image, ref in zip(images, refs, strict=True)]

    def _run_encoder(self, sender: EmbeddingSender, modality: str, items: list) -> EncodedImages | None:
        """One forward pass (on the compute thread); None when the worker is not awake."""
        with self._lock:
            sender.failure_exception()  # nobody waits for it any more: do no work for it
            if self.gate.state != WorkerState.AWAKE:
                self.gate.check_admission()
                return None
            self._computing += 1
        try:
            if modality == "image":
                encoded = self.encoder.encode(items)
            elif modality == "video":
                encoded = self.encoder.encode_videos([clip.data for clip in items])
            else:
                encoded = self.encoder.encode_audios([clip.data for clip in items])
        finally:
            with self._idle:
                self._computing -= 1
                self._idle.notify_all()
        return encoded

    def _embedding(self, modality: str, encoded: EncodedImages) -> Embedding:
        """The encoded rows with their positions, as the connector sends them."""
        if modality == "audio":  # its grids are token counts
            fill_ids, mrope, delta = sequence_positions(len(encoded.embeddings), self.encoder.audio_token_id)
        else:
            pad_id = self.encoder.image_token_id if modality == "image" else self.encoder.video_token_id
            fill_ids, mrope, delta = image_positions(encoded.grid_thw, self.encoder.merge_size, pad_id)
        emb = Embedding(encoded.embeddings, fill_ids, mrope, np.zeros(AUX_INTS, np.int32), self.config.hidden_size,
                        self.config.dtype)
        emb.aux[0], emb.aux[1] = emb.num_tokens, delta
        return emb

    # ---- health, sleep, wake -------------------------------------------------------------------------

    def health(self) -> dict:
        free, total = pool_blocks(self.allocator)
        failing = self.sender.failing.report()
        return {"status": health_status(self.gate.is_sleeping(), failing), "role": "encode", "failing_language_peers": failing,
                "state": self.gate.state.value, "bootstrap_port": self.bootstrap.port,
                "preprocessing": self.encoder.fingerprint(), "modalities": list(self.encoder.modalities),
                "max_images": self.media.max_images, "free_blocks": free,
                "num_blocks": total, "active_rooms": self.sender.active_rooms(), **self._queues()}

    def is_sleeping(self) -> bool:
        return self.gate.is_sleeping()

    def sleep(self, level: int = 1, preserve_state: bool = False) -> dict:
        """Finish running encodes, keep (or fail) every room, release the pool, offload weights."""
        start = time.monotonic()
        with self.gate.falling_asleep() as proceed:
            if not proceed:
                return {"changed": False, "is_sleeping": True}
            with self._idle:  # no forward pass starts from here on
                if not self._idle.wait_for(lambda: not self._computing, self.config.bootstrap_timeout):
                    raise TransferFailure(FailureKind.CONFLICT, "encodes still running; try again")
            try:
                self.sender.pause()
            except TimeoutError as exc:
                raise TransferFailure(FailureKind.CONFLICT, f"{exc}; try again") from exc
            if not preserve_state:
                self.sender.abort_all(FailureKind.ASLEEP, "the encode worker went to sleep (preserve_state=false)")
            try:
                kept_bytes = self.sender.detach_pool()
                disk_error = ""
                if self.checkpoint_dir and preserve_state:
                    written, disk_error = checkpoint_files.save_or_explain(self.checkpoint_dir, lambda: checkpoint.save(
                        self.checkpoint_dir, self._geometry(), self.sender.held_rooms()))
                    if written is not None:
                        kept_bytes, self._on_disk = written, True
                self.encoder.offload(level)
            except BaseException:  # stay awake, with the pool and every room as they were
                if self._on_disk:  # a later start must not boot on it
                    checkpoint_files.remove(self.checkpoint_dir, checkpoint.ROLE)
                    self._on_disk = False
                self.sender.attach_pool(self.pool, self.allocator)
                raise
            self.pool = self.allocator = None
        seconds = time.monotonic() - start
        self.metrics.slept(level, preserve_state, seconds, kept_bytes)
        log.info("encode worker asleep (level %d, preserve_state=%s): %d bytes kept", level, preserve_state, kept_bytes)
        reply = {"changed": True, "is_sleeping": True, "kept_bytes": kept_bytes, "seconds": round(seconds, 4)}
        return {**reply, "checkpoint_error": disk_error} if disk_error else reply

    def wake_up(self, discard_checkpoint: bool = False) -> dict:
        """Reload weights, re-create and register the pool, let the kept rooms continue.

        A worker that booted on a checkpoint verifies it whole first: on any error it stays
        asleep with nothing loaded (:class:`CheckpointError`, HTTP 422), unless
        ``discard_checkpoint`` starts it clean.
        """
        start = time.monotonic()
        with self.gate.waking() as proceed:
            if not proceed:
                return {"changed": False, "is_sleeping": self.gate.is_sleeping()}
            restored = self._load_checkpoint() if self._restart and not discard_checkpoint else []
            self.encoder.reload()
            pool = BufferPool(self.config.num_blocks, self.config.block_size, self.config.hidden_size,
                              self.config.dtype, prefault=False)
            allocator = BlockAllocator(self.config.num_blocks)
            self.sender.attach_pool(pool, allocator, restored)
            self.pool, self.allocator = pool, allocator
            self.pool.prefault_in_background()
            if self.checkpoint_dir:
                checkpoint_files.remove(self.checkpoint_dir, checkpoint.ROLE)
            self._restart = self._on_disk = False
            rooms = self.sender.active_rooms()
        seconds = time.monotonic() - start
        self.metrics.woke(seconds, rooms)
        log.info("encode worker awake: %d rooms continue", rooms)
        return {"changed": True, "is_sleeping": False, "restored_requests": rooms, "seconds": round(seconds, 4)}

    def _load_checkpoint(self) -> list[SenderRoomCheckpoint]:
        """The verified rooms of the checkpoint this worker booted on, or :class:`CheckpointError`."""
        rooms = checkpoint.load(self.checkpoint_dir, self._geometry())
        too_big = [saved.room for saved in rooms if self.config.blocks_for(saved.data.num_tokens) > self.config.num_blocks]
        if too_big:
            need = max(self.config.blocks_for(saved.data.num_tokens) for saved in rooms)
            raise CheckpointError(f"checkpoint in {self.checkpoint_dir} holds rooms of up to {need} blocks; "
                                  f"this worker's pool has {self.config.num_blocks}")
        return rooms

    def _geometry(self) -> dict:
        """What a checkpoint must agree on with this worker: the encoder by what makes its rows
        (weights by content, preprocessing), not by where its files lie or what names them."""
        return {"block_size": self.config.block_size, "hidden_size": self.config.hidden_size,
                "dtype": self.config.dtype, "encoder": self.encoder.name, "fingerprint": self.encoder.fingerprint()}

    # ---- shutdown --------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM/SIGINT: refuse new requests and fail every room, so clients get a 503 at once."""
        self.gate.stop()
        self.sender.abort_all(FailureKind.SHUTTING_DOWN, "the encode worker is shutting down")

    def close(self, exiting: bool = False) -> None:
        """Release the connector, the bootstrap server and the transfer engine. A forward pass
        under way is not waited for (up to seconds for a 4K image: :meth:`stop` failed its room,
        its result goes nowhere). ``exiting``: the process ends next, so the engine is left to the
        exit (Mooncake's own release takes 0.5-1 s)."""
        self._loaders.shutdown(wait=False, cancel_futures=True)
        self._fetchers.shutdown(wait=False, cancel_futures=True)
        self._compute.shutdown(wait=False, cancel_futures=True)
        self.sender.close()
        self.bootstrap.close()
        if self.shared is not None:
            self.shared.store.close()
        self.transport.close(release=not exiting)
