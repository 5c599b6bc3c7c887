"""The resumable connector as the way image (video, audio) embeddings reach SGLang's language server.

SGLang's tokenizer manager, in language-only mode with the ``zmq_to_tokenizer`` transfer
backend, awaits ``mm_receiver.recv_mm_data(...)`` for every request that has media and hands
the multimodal inputs it returns to the scheduler: that call is the hook. Here it sends the
request's images, videos and audio clips to the encoders of ``--encoder-urls`` (split by load,
failover, the embedding cache for images: :class:`language_side.dispatch.EncoderDispatch`),
receives each part through as many resume rounds as it needs into this worker's block-aligned
pool (or, for a request that names its encoder by ``bootstrap_*``, the two-request flow,
receives the room that encoder was sent by a router), and builds SGLang's inputs from the rows and their layout (grids, video timestamps or
seconds per temporal patch, audio token counts) with the model's own processor
(``get_validated_mm_data``: placeholder expansion, M-RoPE positions, row counts checked). From there the request is SGLang's: radix
cache (the item hash is the embedding's), chunked prefill, continuous batching.

A failure is a ``ValueError`` carrying ``status_code``, which SGLang's HTTP server answers with
that status (or, for a stream, as an error event): the encoder's 4xx about an image passes
through, an encoder that cannot be had is 502, this worker's own refusals keep their status
(503 asleep or overloaded, 413 too large).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import numpy as np
import torch

from connector import FailureKind, TransferFailure
from language_side.dispatch import Embedded, EncoderDispatch, ImageRefused
from language_side.layout import LayoutError
from language_side.transfer_meta import TransferMeta
from sglang_ext import shm_handover
from worker_infra.embedding_store import MAX_CACHE_SALT_CHARS

log = logging.getLogger(__name__)

MODALITIES = ("image", "video", "audio")
# the argument of SGLang's get_validated_mm_data that takes a modality's grids
GRID_ARGUMENTS = {"image": "img_grid_thw", "video": "video_grid_thw"}
# what an image or video item may carry besides its source (read or ignored), and the
# preprocessing options SGLang's items may set, which the encoders are not told
ITEM_FIELDS = ("url", "type", "detail", "content_hash")
ITEM_OPTIONS = ("max_long_side_pixel", "max_dynamic_patch", "preprocess_kwargs")


class EmbeddingUnavailable(ValueError):
    """A request's images could not be embedded, for ``kind``; ``status_code`` is the HTTP status
    SGLang answers (it reads that attribute of a ``ValueError``)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def status_code(self) -> int:
        return self.kind.http_status


def media_sources(data: Any, kind: str = "image") -> list[str]:
    """The image (or video) references of one request, in prompt order: strings (path,
    ``file://``, ``http(s)://``, ``data:``), SGLang's ``ImageData``/``VideoData`` or ``{"url":
    ...}``, nested lists flattened."""
    if data is None:
        return []
    items = data if isinstance(data, (list, tuple)) else [data]
    sources: list[str] = []
    for item in items:
        if isinstance(item, (list, tuple)):
            sources += media_sources(item, kind)
            continue
        if item is None:
            continue
        url = item.get("url") if isinstance(item, dict) else getattr(item, "url", item)
        if options := _item_options(item):
            raise EmbeddingUnavailable(FailureKind.BAD_REQUEST,
                                       f"per-{kind} options {sorted(options)} are not passed on to the encoders "
                                       f"(each {kind} is resized and sampled by the encoder's defaults)")
        if not isinstance(url, str) or not url:
            raise EmbeddingUnavailable(FailureKind.BAD_REQUEST,
                                       f"each {kind} must be given by a string (path, URL or data: URI), "
                                       f"not {type(url).__name__}")
        sources.append(url)
    return sources


def _item_options(item: Any) -> set[str]:
    """The names of the per-item preprocessing options an image or video item sets (SGLang's
    ``max_long_side_pixel``, ``max_dynamic_patch``, ``preprocess_kwargs`` such as a video's fps)."""
    if isinstance(item, dict):
        return {key for key, value in item.items() if key not in ITEM_FIELDS and value is not None}
    return {name for name in ITEM_OPTIONS if getattr(item, name, None)}


def _adopt_digests(inputs, tensors: dict, digests: dict) -> list:
    """SGLang keys its radix cache by each item's hash: the first 8 bytes, big-endian, of the
    SHA-256 of its embedding's bytes (``mm_utils.tensor_hash`` on a CPU tensor). SGLang's
    processor makes one item per image, each a view of the rows given for its modality; an item
    whose view is all of those rows, which are one received part's, gets that part's digest,
    already taken of the same bytes, so SGLang does not read 75.6 MB (a 4K image) again. Any
    other item (one image of several, joined parts, cached rows, rows converted to a model dtype
    other than bf16) is left to SGLang. Returns the items that got a digest."""
    adopted = []
    for item in getattr(inputs, "mm_items", None) or []:
        digest, given = digests.get(item.modality), tensors.get(item.modality)
        view = item.precomputed_embeddings
        if (digest is not None and item.hash is None and item.feature is None and given is not None
                and given.dtype == torch.bfloat16 and isinstance(view, torch.Tensor) and view.dtype == given.dtype
                and view.shape == given.shape and view.data_ptr() == given.data_ptr()
                and view.is_contiguous() and given.is_contiguous()):
            item.set_hash(int(digest[:16], 16))
            adopted.append(item)
    return adopted


class ResumableReceiver:
    """What SGLang's tokenizer manager calls ``mm_receiver`` (see the module docstring)."""

    def __init__(self, dispatch: EncoderDispatch, dtype: torch.dtype, keep_inputs: bool = False,
                 limits: dict[str, int] | None = None) -> None:
        """``keep_inputs``: hold each request's image rows until it ends, for a disk checkpoint
        (``--checkpoint-dir``); without one nothing is held past ``recv_mm_data``. ``limits``:
        SGLang's ``--limit-mm-data-per-request`` ("image", "video": items per request), counted
        again here after nested lists are flattened (SGLang counts the outer list)."""
        self.dispatch, self.dtype, self.keep_inputs = dispatch, dtype, keep_inputs
        self.limits = limits or {}
        self._embedding: dict[str, asyncio.Task] = {}  # rid -> its images at the encoders
        # Until its request ends (see annotated), by rid: TRANSFER_META of its images, and their rows
        # (uint8, bf16 bits), grids and the request's image_data list, which a disk checkpoint keeps
        # of a generation (the list: SGLang's copies of an n>1 request share it, see inputs_of)
        self._transfer_meta: dict[str, dict] = {}
        self._inputs: dict[str, tuple[np.ndarray, list, Any]] = {}
        self._segments: dict[str, list[str]] = {}  # rid -> its embeddings' handover segments (shm_handover)
        self._restored: dict[str, tuple[np.ndarray, list]] = {}  # rid -> its images' rows and grids, from disk
        # The image_data a two-request /generate is given (language_server.name_room), so that
        # SGLang hands it here: unguessable, so no client's image reference is taken for it
        self.room_marker = f"epd-room:{secrets.token_hex(16)}"

    async def recv_mm_data(self, request_obj, mm_processor, prompt, need_wait_for_mm_inputs: bool = True):
        sources = {kind: media_sources(getattr(request_obj, f"{kind}_data"), kind) for kind in MODALITIES}
        for kind, refs in sources.items():
            if len(refs) > self.limits.get(kind, len(refs)):
                raise EmbeddingUnavailable(FailureKind.BAD_REQUEST,
                                           f"{len(refs)} {kind}s in one request, over the limit of "
                                           f"{self.limits[kind]} (--limit-mm-data-per-request)")
        # Media always come through the connector, whatever ``need_wait_for_mm_inputs`` says: SGLang
        # leaves it None on each choice of an n>1 request (``GenerateReqInput.__getitem__`` does not
        # copy it), and a None here would make SGLang encode the images itself.
        if not any(sources.values()):
            return None
        rid = str(request_obj.rid)
        if (restored := self._restored.pop(rid, None)) is not None:
            rows, grids = restored
            embedded = {"image": Embedded(rows=rows, grids=grids)}
        elif sources["image"] == [self.room_marker]:
            embedded = {"image": await self._receive_room(rid, request_obj)}
        else:
            salt = getattr(request_obj, "cache_salt", None)  # SGLang's: a str per request once split
            if isinstance(salt, str) and len(salt) > MAX_CACHE_SALT_CHARS:
                raise EmbeddingUnavailable(FailureKind.BAD_REQUEST, f"cache_salt of {len(salt)} characters, over "
                                                                    f"the limit of {MAX_CACHE_SALT_CHARS}")
            embedded = await self._embed(rid, {kind: refs for kind, refs in sources.items() if refs},
                                         salt if isinstance(salt, str) and salt else None)
        from sglang.srt.managers.schedule_batch import Modality

        embeddings, layout = {}, {}
        for kind, part in embedded.items():
            embeddings[Modality[kind.upper()]] = self._tensor(part.rows)
            if kind != "audio":  # an audio clip's layout is its token count, in its extras
                layout[GRID_ARGUMENTS[kind]] = torch.tensor(part.grids, dtype=torch.long)
            layout |= {key: torch.tensor(value) if key == "audio_feature_lens" else value
                       for key, value in part.extras.items()}
        built_at = time.monotonic()
        try:
            inputs = mm_processor.get_validated_mm_data(prompt, embeddings, **layout)
        except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as exc:  # placeholders disagree
            counts = ", ".join(f"{len(refs)} {kind}(s)" for kind, refs in sources.items())
            raise EmbeddingUnavailable(FailureKind.BAD_REQUEST,
                                       f"the prompt's placeholders do not match its {counts}: {exc}") from None
        digested = _adopt_digests(inputs, embeddings, {Modality[kind.upper()]: part.rows_sha256
                                                      for kind, part in embedded.items()})
        built_ms = (time.monotonic() - built_at) * 1e3
        # Not for an n>1 request: SGLang sends its items to the scheduler once per choice, and
        # the scheduler removes a segment when it maps it.
        sampling = getattr(request_obj, "sampling_params", None)
        if digested and isinstance(sampling, dict) and sampling.get("n", 1) == 1 and shm_handover.sglang_sends_shm():
            self._segments.setdefault(rid, []).extend(await shm_handover.hand_over(digested))
        meta = TransferMeta.joined([part.meta for part in embedded.values()])
        if self.keep_inputs and list(embedded) == ["image"]:
            self._inputs[rid] = (embedded["image"].rows, embedded["image"].grids, request_obj.image_data)
        self._transfer_meta[rid] = meta.response_fields()
        log.info("rid=%s: %s tokens from %s, %d resume rounds, transfer %.0f ms, %d cached image(s), %d from the "
                 "cluster's cache; SGLang's inputs built in %.0f ms, %d item hash(es) from the connector's digest, %d "
                 "handed over in shared memory", rid, ", ".join(f"{len(part.rows)} {kind}" for kind, part in embedded.items()),
                 meta.encoders, meta.resume_rounds, meta.transfer_ms, meta.cached_images or 0, meta.stored_images or 0,
                 built_ms, len(digested),
                 len(self._segments.get(rid, [])))
        return inputs

    def _tensor(self, rows: np.ndarray) -> torch.Tensor:
        """bf16 bytes [tokens, 2 * hidden] as the model's dtype."""
        return torch.from_numpy(np.ascontiguousarray(rows)).view(torch.bfloat16).to(self.dtype)

    async def _receive_room(self, rid: str, request_obj) -> Embedded:
        """The room a two-request /generate names (checked by ``language_server.name_room``). A
        client that goes away meanwhile ends it at once (its room is the client's only while the
        client is there; SGLang does not look for a gone client before the prompt is built)."""
        addr = f"{request_obj.bootstrap_host}:{request_obj.bootstrap_port}"
        receiving = self.dispatch.receive_room(rid, addr, int(request_obj.bootstrap_room))
        try:
            return await self._tracked(rid, receiving, getattr(request_obj, CLIENT_ATTRIBUTE, None))
        except LayoutError as exc:
            raise EmbeddingUnavailable(FailureKind.PROTOCOL,
                                       f"the embedding from the encoder at {addr} cannot be placed: {exc}") from None

    async def _embed(self, rid: str, sources: dict[str, list[str]], cache_salt: str | None = None
                     ) -> dict[str, Embedded]:
        """The request's images, videos and audio clips, at the encoders at once (cached under its
        ``cache_salt``); when one kind fails (or the request is aborted) the others are cancelled and
        waited for, their rooms ended."""
        async def every_kind():
            kinds = [asyncio.ensure_future(self.dispatch.embed(rid, refs, cache_salt) if kind == "image"
                                           else self.dispatch.embed_media(rid, refs, kind, cache_salt))
                     for kind, refs in sources.items()]
            try:
                return dict(zip(sources, await asyncio.gather(*kinds), strict=True))
            except BaseException:
                for each in kinds:
                    each.cancel()
                await asyncio.gather(*kinds, return_exceptions=True)
                raise

        return await self._tracked(rid, every_kind())

    async def _tracked(self, rid: str, receiving, client=None):
        """``receiving`` (a request's media on their way), abortable by ``rid`` (:meth:`abort`)
        and, given the ``client``'s HTTP request, ended when it disconnects; its failures as
        :class:`EmbeddingUnavailable` with their status."""
        task = self._embedding[rid] = asyncio.ensure_future(receiving)
        watcher = asyncio.ensure_future(_end_when_gone(client, task)) if client is not None else None
        try:
            return await task
        except (ImageRefused, TransferFailure) as exc:
            raise EmbeddingUnavailable(exc.kind, str(exc)) from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the client went away: SGLang's handler is cancelled
                raise
            if watcher is not None and watcher.done() and not watcher.cancelled() and watcher.exception() is None \
                    and watcher.result():  # ... or this receiver saw it go
                raise EmbeddingUnavailable(FailureKind.CANCELLED, f"request {rid}: the client went away") from None
            raise EmbeddingUnavailable(FailureKind.CANCELLED, f"request {rid}: aborted by /abort_request") from None
        finally:
            if watcher is not None:
                watcher.cancel()
            self._embedding.pop(rid, None)

    async def annotated(self, obj, stream):
        """``stream`` (SGLang's outputs for the request ``obj``, single or batch) with each
        request's image transfer in its ``meta_info``; what was kept of its images is dropped at
        the end."""
        try:
            async for out in stream:
                for position, item in enumerate(out if isinstance(out, list) else [out]):
                    meta = item.get("meta_info") if isinstance(item, dict) else None
                    if isinstance(meta, dict) and (transfer := self._transfer_of(obj, meta, item.get("index", position))):
                        meta.update(transfer)
                yield out
        finally:
            for rid in [obj.rid] if isinstance(obj.rid, str) else obj.rid or []:
                self._transfer_meta.pop(str(rid), None)
                self._inputs.pop(str(rid), None)
                shm_handover.unlink(self._segments.pop(str(rid), []))
            await stream.aclose()

    def _transfer_of(self, obj, meta: dict, index) -> dict | None:
        """The image transfer of the response with ``meta``: its request's, found by its rid, or for
        a choice of an ``n>1`` request, whose choices SGLang gives fresh rids (its ``index``: each
        prompt's ``n`` choices in turn), its prompt's."""
        if (transfer := self._transfer_meta.get(str(meta.get("id")))) is not None:
            return transfer
        choices = getattr(obj, "parallel_sample_num", 1)
        rids = [obj.rid] if isinstance(obj.rid, str) else obj.rid or []
        if choices > 1 and isinstance(index, int) and 0 <= index // choices < len(rids):
            return self._transfer_meta.get(str(rids[index // choices]))
        return None

    def inputs_of(self, rid: str, image_data: Any = None) -> tuple[np.ndarray | None, list]:
        """The rows and grids of ``rid``'s images, once received (``(None, [])`` before). A choice
        of an ``n>1`` request has a rid of its own (SGLang's) and its prompt's ``image_data``
        list itself (SGLang copies the request shallowly): it gets its prompt's."""
        kept = self._inputs.get(rid) or next((entry for entry in self._inputs.values()
                                              if image_data is not None and entry[2] is image_data), None)
        return (kept[0], kept[1]) if kept else (None, [])

    def restore(self, rid: str, rows: np.ndarray, grids: list) -> None:
        """``rid``'s images as a disk checkpoint kept them, for its request submitted again."""
        self._restored[rid] = (rows, grids)

    def abort(self, rid: str) -> bool:
        """``/abort_request`` for a request still waiting for its embedding: its rooms end, each
        encoder is told."""
        task = self._embedding.get(str(rid))
        if task is None:
            return False
        task.cancel()
        return True


# The attribute of a two-request /generate's request object that holds its client's HTTP request
# (``language_server.around_generate_request`` sets it), for :meth:`ResumableReceiver._tracked`
CLIENT_ATTRIBUTE = "_epd_client"
CLIENT_POLL_S = 0.5  # how often a waiting two-request /generate looks whether its client is there


async def _end_when_gone(client, task: asyncio.Task) -> bool:
    """Cancel ``task`` once ``client`` (a Starlette request) has disconnected; True then."""
    while not task.done():
        if await client.is_disconnected():
            task.cancel()
            return True
        await asyncio.sleep(CLIENT_POLL_S)
    return False

