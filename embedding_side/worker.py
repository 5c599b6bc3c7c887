"""The encode worker: images -> encoder -> block pool -> connector sender.

One request: load and decode every image (400 on bad input), encode them in order into one
embedding, compute fill ids and M-RoPE positions, write it into source blocks (waiting while
the pool is full) and hand the blocks to the room's sender, which moves them to the language
side in as many rounds as that side asks for and frees them afterwards.

Sleep lets running encodes finish, stops every write, keeps each room's source data in host
memory (``preserve_state=true``) or fails the rooms (``false``), releases the pool and
offloads the weights; the bootstrap server stays up and reports ``SLEEPING`` so peers wait.
With a checkpoint folder the kept rooms also go to disk, ``/health`` says ``SLEEPING
checkpointed`` (peers then wait even while this process is gone), and a worker started on
that folder boots asleep and continues those rooms after ``/wake_up``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from connector import checkpoint as checkpoint_files
from connector.allocator import BlockAllocator, pool_blocks
from connector.bootstrap import BootstrapServer
from connector.buffers import AUX_INTS, BufferPool, Embedding
from connector.checkpoint import CheckpointError
from connector.config import ConnectorConfig
from connector.http_util import HTTPError
from connector.metrics import WorkerMetrics
from connector.mooncake_transport import MooncakeTransport
from connector.sender import EmbeddingSenderManager, SenderRoomCheckpoint
from connector.sleep import SleepGate
from embedding_side import checkpoint
from embedding_side.encoders import VisionEncoder
from embedding_side.images import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S, ImageInputError, load_image
from embedding_side.positions import image_positions

log = logging.getLogger(__name__)


@dataclass
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    fetch_timeout: float = DEFAULT_TIMEOUT_S
    max_images: int = 16


class EncodeWorker:
    def __init__(self, config: ConnectorConfig, encoder: VisionEncoder, bootstrap_port: int,
                 limits: ImageLimits | None = None, queue_while_sleeping: bool = False,
                 checkpoint_dir: str | None = None) -> None:
        if encoder.hidden_size != config.hidden_size:
            raise ValueError(f"encoder output width {encoder.hidden_size} != configured hidden size {config.hidden_size}")
        self.config, self.encoder, self.limits = config, encoder, limits or ImageLimits()
        self.checkpoint_dir = checkpoint_dir
        self.pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
        self.allocator = BlockAllocator(config.num_blocks)
        self.transport = MooncakeTransport(config.host, config.protocol, config.ib_device, config.completion)
        self.sender = EmbeddingSenderManager(config, self.transport, self.pool, self.allocator)
        self.gate = SleepGate("encode", queue_while_sleeping, config.max_sleep)
        self._on_disk = False  # asleep with every kept room written to the checkpoint folder
        self.bootstrap = BootstrapServer(config.host, bootstrap_port, health_status=self._bootstrap_health)
        self.bootstrap.put_route(1, 1, config.host, self.sender.rank_port, 0)
        self.metrics = WorkerMetrics("encode", lambda: pool_blocks(self.allocator))
        self._encode_lock = threading.Lock()  # one forward pass at a time; the cores are few
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        # Notified when an encode request ends. On the same lock as the admission check, so a
        # sleep cannot see no request in flight while one is being admitted.
        self._idle = threading.Condition(self._lock)
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

    def encode(self, rid: str, room: int, image_refs: list[str]) -> dict:
        """Encode one request and start its transfer; returns the HTTP reply body."""
        if not image_refs or len(image_refs) > self.limits.max_images:
            raise HTTPError(400, f"images must be a list of 1 to {self.limits.max_images} references")
        self.gate.wait_awake()
        with self._lock:
            if self.gate.is_sleeping():  # fell asleep between the check and here
                raise HTTPError(503, "the encode worker is falling asleep", {"Retry-After": "5"})
            if rid in self._in_flight:
                raise HTTPError(409, f"request {rid!r} is already being encoded")
            self._in_flight.add(rid)
        start = time.monotonic()
        try:
            return self._encode(rid, room, image_refs, start)
        except HTTPError as exc:
            self.metrics.failure("bad_input" if exc.status < 500 else "pool_full")
            raise
        finally:
            with self._idle:
                self._in_flight.discard(rid)
                self._idle.notify_all()

    def _encode(self, rid: str, room: int, image_refs: list[str], start: float) -> dict:
        try:
            images = [load_image(ref, self.limits.max_bytes, self.limits.fetch_timeout) for ref in image_refs]
        except ImageInputError as exc:
            raise HTTPError(400, str(exc)) from None
        try:
            sender = self.sender.create_sender(room)
        except ValueError as exc:
            raise HTTPError(409, str(exc)) from None
        try:
            with self._encode_lock:
                encoded = self.encoder.encode(images)
        except ValueError as exc:  # e.g. an aspect ratio Qwen refuses
            sender.abort(f"encoding failed: {exc}")
            raise HTTPError(400, f"cannot encode: {exc}") from None
        emb = self._embedding(encoded.embeddings, encoded.grid_thw)
        blocks = self._allocate(self.pool.blocks_for(emb.num_tokens), start)
        if blocks is None:
            sender.abort("encode pool full")
            raise HTTPError(503, f"encode pool full: {emb.num_tokens} tokens did not fit within "
                                 f"{self.config.bootstrap_timeout:g}s")
        self.pool.write(blocks, emb)
        sender.send(blocks, emb.num_tokens)
        self.metrics.success(emb.num_tokens, emb.embeddings.nbytes, 0, time.monotonic() - start)
        log.info("rid=%s room=%d: %d images -> %d tokens", rid, room, len(image_refs), emb.num_tokens)
        return {"rid": rid, "num_tokens": emb.num_tokens, "hidden_size": emb.hidden_size, "dtype": emb.dtype,
                "sha256": emb.sha256(), "grid_thw": [list(g) for g in encoded.grid_thw]}

    def _embedding(self, data, grids) -> Embedding:
        fill_ids, mrope, delta = image_positions(grids)
        emb = Embedding(data, fill_ids, mrope, np.zeros(AUX_INTS, np.int32), self.config.hidden_size, self.config.dtype)
        emb.aux[0], emb.aux[1] = emb.num_tokens, delta
        return emb

    def _allocate(self, n: int, start: float) -> list[int] | None:
        if n > self.allocator.num_blocks:
            raise HTTPError(413, f"embedding needs {n} blocks, the encode pool has {self.allocator.num_blocks}")
        while (blocks := self.allocator.allocate(n)) is None:
            if time.monotonic() - start > self.config.bootstrap_timeout:
                return None
            time.sleep(0.01)
        return blocks

    def health(self) -> dict:
        free, total = pool_blocks(self.allocator)
        return {"status": "sleeping" if self.gate.is_sleeping() else "ok", "role": "encode",
                "state": self.gate.state.value, "bootstrap_port": self.bootstrap.port, "free_blocks": free,
                "num_blocks": total, "active_rooms": self.sender.active_rooms()}

    def is_sleeping(self) -> bool:
        return self.gate.is_sleeping()

    def sleep(self, level: int = 1, preserve_state: bool = False) -> dict:
        """Finish running encodes, keep (or fail) every room, release the pool, offload weights."""
        start = time.monotonic()
        with self.gate.falling_asleep() as proceed:
            if not proceed:
                return {"changed": False, "is_sleeping": True}
            with self._idle:  # new requests are refused (or wait) from here on
                if not self._idle.wait_for(lambda: not self._in_flight, self.config.bootstrap_timeout):
                    raise HTTPError(409, "encodes still running; try again")
            if not preserve_state:
                self.sender.abort_all("the encode worker went to sleep (preserve_state=false)")
            self.sender.pause()
            kept_bytes = self.sender.detach_pool()
            disk_error = ""
            if self.checkpoint_dir and preserve_state:
                written, disk_error = checkpoint_files.save_or_explain(self.checkpoint_dir, lambda: checkpoint.save(
                    self.checkpoint_dir, self._geometry(), self.sender.held_rooms()))
                if written is not None:
                    kept_bytes, self._on_disk = written, True
            self.pool = self.allocator = None
            self.encoder.offload(level)
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
        need = sum(self.config.blocks_for(saved.data.num_tokens) for saved in rooms)
        if need > self.config.num_blocks:
            raise CheckpointError(f"checkpoint in {self.checkpoint_dir} holds {need} blocks of rooms; "
                                  f"this worker's pool has {self.config.num_blocks}")
        return rooms

    def _geometry(self) -> dict:
        """What a checkpoint must agree on with this worker."""
        model_path = getattr(self.encoder, "model_path", None)
        return {"block_size": self.config.block_size, "hidden_size": self.config.hidden_size,
                "dtype": self.config.dtype, "encoder": self.encoder.name,
                "model_path": str(Path(model_path).resolve()) if model_path else None}

    def close(self) -> None:
        self.sender.close()
        self.bootstrap.close()
        self.transport.close()
