"""One request's images, encoded by the encoders of ``--encoder-urls`` and received by this worker.

A request's images are split into contiguous parts, one per encoder, and more parts where one
would pass the images an encoder takes per ``/encode``; each part goes to an encoder no other
part of the request went to while there is one. A part goes to the encoder its first
image hashes to (rendezvous hashing of the image's SHA-256, or of its reference when this worker
does not hold its bytes, over the healthy encoders), so an image comes back to the encoder that
has it, unless that encoder has :data:`AFFINITY_SLACK_IMAGES` images' worth of tokens or more
outstanding beyond the least loaded one, which then takes it (outstanding image tokens: an
estimate until an encoder answers with the true count); each
part has its own room and is received like any two-request transfer (rounds and resumes as
needed); the parts are joined in image order, each part's digest checked against the one its
encoder reported. A part whose encoder cannot be reached, is busy (408/429/503) or fails is sent
again, with a new room, to an encoder it has not been tried on, up to ``max_attempts`` in all
(so ``min(max_attempts, encoders)``: never twice on one encoder), as soon as either
side sees the failure (the ``/encode`` answer, or this worker's room failing: the encoder found
dead, an init refused, the room aborted; the ``/encode`` is then dropped); that encoder gets
no new part until its ``/health`` answers again (probed at most once a second, at once when no
other is left). A part every encoder it was tried on refused as busy or asleep (429/503), or
with no encoder answering ``/health`` to try (all dead, or this host cut off from them), is a
503 for the client (with ``Retry-After``), any other failure a 502. An encoder's other 4xx is
about the images: the client's error, with that status, not retried. This worker's own
refusals (asleep, over its queue) pass through as they are.

Embeddings of ``data:`` images are kept in an :class:`EmbeddingCache` under the fingerprint of
the encoder that made them and read back under the one every encoder reports. With the cluster's
cache (``--mm-global-cache``: Mooncake Store, which the encoders fill), an image this worker has
not kept is looked up there next, and one found is not sent to an encoder at all; an entry that
fails its check, or a store that does not answer in time, is a miss.

Videos and audio clips (:meth:`EncoderDispatch.embed_media`) go the same way, each video a part
of its own (an encoder encodes videos one at a time), to encoders whose ``/health`` lists that
modality; a video's grid and position metadata (timestamps, seconds per temporal patch) and a
clip's token count come with the encoder's answer, checked against the rows received. They are
not cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass, field, replace

import aiohttp
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from connector import DTYPE_SIZES, FailureKind, TransferFailure
from language_side.embedding_cache import EmbeddingCache, Grid, cache_key, image_digest, split_rows
from language_side.layout import MERGE, LayoutError, grids_from_positions, image_token_count
from language_side.transfer_meta import TransferMeta
from language_side.worker import LanguageWorker
from worker_infra.embedding_store import EmbeddingStore, StoredMedia, media_key, salted
from worker_infra.futures import wait_for_future
from worker_infra.trust import encoder_host

log = logging.getLogger(__name__)

PROBE_INTERVAL = 1.0  # seconds between /health probes of an encoder taken out of rotation
PROBE_TIMEOUT_S = 2.0  # a /health probe's whole answer; later is no answer
WATCH_INTERVAL = 2.0  # seconds between the background /health probes of every encoder
ENCODER_MAX_IMAGES = 16  # images per /encode an encoder takes until its /health says otherwise
FIRST_ESTIMATE = 1024  # image tokens assumed for an image before any encoder has answered
# the hashed encoder takes a part unless it is this many images busier than the least loaded: the
# same image sent at once by two requests goes to one encoder (which encodes it once) unless that
# one is this far behind
AFFINITY_SLACK_IMAGES = 4
ABOUT_THE_IMAGES = frozenset({FailureKind.BAD_REQUEST, FailureKind.TOO_LARGE})
REFUSAL_GRACE_S = 2.0  # how long a room failed for its images waits for the encoder's own refusal
# an encoder's refusals for capacity: another encoder may take the part
BUSY = frozenset({FailureKind.OVERLOADED, FailureKind.ASLEEP, FailureKind.SHUTTING_DOWN})
# failures of this worker's own side: another encoder would not help
OUR_SIDE = frozenset({FailureKind.CANCELLED, FailureKind.ASLEEP, FailureKind.SHUTTING_DOWN, FailureKind.OVERLOADED,
                      FailureKind.CONFLICT, FailureKind.BAD_REQUEST, FailureKind.TOO_LARGE})


class ImageRefused(ValueError):
    """An encoder refused the images as bad input (a 4xx but 408/429): the client's error, with
    the kind of the encoder's status; not retried."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class Encoder:
    url: str
    host: str
    bootstrap_port: int | None = None  # from its /health
    max_images: int = ENCODER_MAX_IMAGES  # per /encode, from its /health
    modalities: tuple[str, ...] | None = None  # from its /health (None: not known yet)
    outstanding: int = 0  # estimated image tokens of its parts in flight
    healthy: bool = True
    next_probe: float = 0.0


@dataclass
class Embedded:
    """A request's images (or videos), received: rows in order, their grids, and how it went."""

    rows: np.ndarray
    grids: list[tuple[int, int, int]]
    fingerprints: list[str | None] = field(default_factory=list)  # per image: the preprocessing that made it
    meta: TransferMeta = field(default_factory=TransferMeta)
    # per video, in order: "video_timestamps" and/or "second_per_grid_ts", as the encoder gave them
    extras: dict = field(default_factory=dict)
    # the SHA-256 of ``rows`` when they are one received part's copy, checked end to end (None
    # when they were joined or came from the cache): SGLang's item hash, taken once (mm_receiver)
    rows_sha256: str | None = None


class EncoderDispatch:
    def __init__(self, urls: list[str], worker: LanguageWorker, cache: EmbeddingCache, max_attempts: int = 3,
                 encode_timeout: float = 600.0, store: EmbeddingStore | None = None) -> None:
        self.encoders = [Encoder(url.rstrip("/"), encoder_host(url)) for url in urls]
        self.worker, self.max_attempts = worker, max_attempts
        self.timeout = aiohttp.ClientTimeout(total=encode_timeout, sock_connect=5)
        self.tokens_per_image = FIRST_ESTIMATE
        self.cache = cache
        self.store = store  # the cluster's embedding cache (Mooncake Store), read after this worker's
        self.fingerprints: dict[str, str] = {}  # each probed encoder's preprocessing fingerprint, by URL
        self._session: aiohttp.ClientSession | None = None
        self._watching: asyncio.Task | None = None
        self.registry = r = CollectorRegistry()
        self.parts = Counter("epd_encoder_parts", "Image parts sent to an encoder, by outcome", ["encoder", "outcome"],
                             registry=r)
        self.retries = Counter("epd_encoder_retries", "Parts sent again to another encoder", registry=r)
        self.rotation_exits = Counter("epd_encoder_rotation_exits", "Times an encoder left the rotation (a part "
                                      "failed there, or its /health stopped answering)", ["encoder"], registry=r)
        Gauge("epd_encoders_healthy", "Encoders taking new parts", registry=r).set_function(
            lambda: sum(e.healthy for e in self.encoders))
        outstanding = Gauge("epd_encoder_outstanding_tokens", "Estimated image tokens in flight per encoder",
                            ["encoder"], registry=r)
        for enc in self.encoders:
            outstanding.labels(enc.url).set_function(lambda enc=enc: enc.outstanding)
        self.cache_hits = Counter("epd_embedding_cache_hits", "Images whose embedding came from the cache",
                                  registry=r)
        for collector in store.collectors if store is not None else ():
            r.register(collector)
        for name, doc, read in (("epd_embedding_cache_bytes", "Bytes of embeddings in the cache", lambda: cache.used),
                                ("epd_embedding_cache_entries", "Images in the cache", lambda: len(cache))):
            Gauge(name, doc, registry=r).set_function(read)

    async def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self._watching is not None:
            self._watching.cancel()
        if self._session is not None:
            await self._session.close()

    def watch(self) -> None:
        """From the first call on (in the server's event loop), probe every encoder's /health
        every :data:`WATCH_INTERVAL` in the background: the rotation and ``epd_encoders_healthy``
        follow the probes with or without traffic (an encoder killed while idle is out within
        one interval and a probe's timeout, not at the next part that fails there)."""
        if self._watching is None and self.encoders:
            self._open_session()
            self._watching = asyncio.get_running_loop().create_task(self._watch_forever())

    async def _watch_forever(self) -> None:
        while True:
            answers = await asyncio.gather(*(self._probe(enc) for enc in self.encoders))
            for enc, healthy in zip(self.encoders, answers, strict=True):
                if healthy != enc.healthy:
                    log.warning("encoder %s %s its /health", enc.url, "answers" if healthy else "does not answer")
                self._set_healthy(enc, healthy)
            await asyncio.sleep(WATCH_INTERVAL)

    def _set_healthy(self, enc: Encoder, healthy: bool) -> None:
        """Whether ``enc`` takes new parts; out of rotation, it is probed again after
        :data:`PROBE_INTERVAL` (each exit counted in ``epd_encoder_rotation_exits_total``)."""
        if enc.healthy and not healthy:
            self.rotation_exits.labels(enc.url).inc()
        enc.healthy, enc.next_probe = healthy, time.monotonic() + PROBE_INTERVAL

    def render_metrics(self) -> bytes:
        return generate_latest(self.registry)

    async def receive_room(self, rid: str, addr: str, room: int) -> Embedded:
        """The two-request flow's half: the embedding of ``room``, which a router had the encoder
        at ``addr`` (its bootstrap address, allowed by the caller) encode and send; the images'
        grids are read from the positions that came with it. TransferFailure as :meth:`embed`'s
        (the encoder's failure of the room included), :class:`LayoutError` for positions that
        are no image's."""
        future = self.worker.submit(rid, addr, room, named_by_client=True)
        transfer = await wait_for_future(future, lambda: self.worker.cancel(rid, "the client went away"))
        rows, positions = transfer.pop("embedding"), transfer.pop("mrope_positions")
        return Embedded(rows, grids_from_positions(positions), meta=TransferMeta.received(
            transfer, encoders=[addr], sha256=transfer["sha256"]), rows_sha256=transfer["sha256"])

    async def embed_media(self, rid: str, refs: list[str], modality: str, cache_salt: str | None = None) -> Embedded:
        """Videos' or audio clips' embeddings (``modality``), encoded and received, not cached here
        (the encoders' cluster cache keeps them under ``cache_salt``); failures as :meth:`embed`'s."""
        self._check_encoders()
        self.watch()
        digests = await asyncio.to_thread(lambda: [image_digest(s) for s in refs])
        return await self._dispatch(rid, refs, modality, digests, cache_salt)

    def _check_encoders(self) -> None:
        if not self.encoders:
            raise ImageRefused(FailureKind.BAD_REQUEST,
                               "this language server has no --encoder-urls: name the encoder that holds a "
                               "request's embedding by bootstrap_host, bootstrap_port and bootstrap_room (the "
                               "two-request flow)")

    def _open_session(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)

    async def embed(self, rid: str, images: list[str], cache_salt: str | None = None) -> Embedded:
        """``images``' embeddings, from the caches (this worker's, then the cluster's: entries of
        ``cache_salt`` only) or encoded and received; TransferFailure (its kind says the status) or
        :class:`ImageRefused` when they cannot be had."""
        self._check_encoders()
        self.watch()
        digests = await asyncio.to_thread(lambda: [image_digest(s) for s in images])
        cached = self.cache.budget or self.store is not None
        fingerprint = await self._fingerprint() if cached and any(digests) else None
        fingerprint = salted(fingerprint, cache_salt) if fingerprint is not None else None
        found: dict[int, tuple[np.ndarray, Grid]] = {}
        from_store = 0
        if fingerprint is not None:
            found = {i: hit for i, digest in enumerate(digests)
                     if digest is not None and (hit := self.cache.get(cache_key(digest, fingerprint))) is not None}
            self.cache_hits.inc(len(found))
            if self.store is not None:
                wanted = [i for i, digest in enumerate(digests) if digest is not None and i not in found]
                stored = await asyncio.gather(*(self.store.get(media_key("image", digests[i], fingerprint))
                                                for i in wanted))
                for i, entry in zip(wanted, stored, strict=True):
                    if entry is not None and self._fits(entry):
                        found[i] = (entry.rows, entry.grid)
                        self.cache.put(cache_key(digests[i], fingerprint), entry.rows, entry.grid)
                        from_store += 1
        missing = [i for i in range(len(images)) if i not in found]
        meta = TransferMeta(encode_ms=0.0)  # nothing encoded: every image from a cache
        if missing:
            sent = await self._dispatch(rid, [images[i] for i in missing], "image", [digests[i] for i in missing],
                                        cache_salt)
            meta = sent.meta
            for i, rows, grid, made_by in zip(missing, split_rows(sent.rows, sent.grids), sent.grids,
                                              sent.fingerprints, strict=True):
                found[i] = (rows, grid)
                if digests[i] is not None and made_by is not None:  # keyed by what made it
                    self.cache.put(cache_key(digests[i], salted(made_by, cache_salt)), rows, grid)
        ordered = [found[i] for i in range(len(images))]
        # nothing from a cache: the parts' rows are already joined in order (no second copy)
        whole = len(missing) == len(images)
        rows = sent.rows if whole else np.concatenate([r for r, _ in ordered])
        return Embedded(rows, [g for _, g in ordered],
                        meta=replace(meta, num_tokens=len(rows), cached_images=len(images) - len(missing) - from_store,
                                     stored_images=from_store if self.store is not None else None),
                        rows_sha256=sent.rows_sha256 if whole else None)

    def _fits(self, entry: StoredMedia) -> bool:
        """Whether an entry of the cluster's cache is an image's rows at this worker's width."""
        width = self.worker.config.hidden_size * DTYPE_SIZES[self.worker.config.dtype]
        return len(entry.grid) == 3 and entry.rows.shape == (image_token_count(entry.grid), width)

    async def _fingerprint(self) -> str | None:
        """The preprocessing fingerprint every encoder reports (None when they disagree: an
        embedding would depend on which one made it, so the cache is not read)."""
        if not self.fingerprints:
            for enc in self.encoders:
                if await self._probe(enc):
                    break
        if len(set(self.fingerprints.values())) != 1:
            if len(self.fingerprints) > 1:
                log.warning("encoders report different preprocessing %s: the embedding cache is not read",
                            self.fingerprints)
            return None
        return next(iter(self.fingerprints.values()))

    async def _dispatch(self, rid: str, refs: list[str], modality: str = "image",
                        digests: list[str | None] | None = None, cache_salt: str | None = None) -> Embedded:
        """One part per healthy encoder (fewer parts than images), more when a part would pass
        the images an encoder takes per request (any encoder may get any part); one part per
        video. A part goes where its first item hashes (its digest, when known, else its
        reference), load permitting."""
        healthy = [e for e in self.encoders if e.healthy] or self.encoders
        per_part = 1 if modality == "video" else max(1, min(e.max_images for e in self.encoders))
        count = max(min(len(healthy), len(refs)), -(-len(refs) // per_part))
        bounds = np.linspace(0, len(refs), count + 1).astype(int)
        affinity = [affinity_of(ref, digest) for ref, digest in zip(refs, digests or [None] * len(refs), strict=True)]
        siblings: set[str] = set()  # the encoders this request's parts went to: the next part goes elsewhere
        tasks = [asyncio.ensure_future(self._part(rid, i, refs[a:b], modality, affinity[a], siblings, cache_salt))
                 for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        rows = parts[0].rows if len(parts) == 1 else np.concatenate([p.rows for p in parts])
        return Embedded(rows, [g for p in parts for g in p.grids],
                        fingerprints=[p.meta.preprocessing for p in parts for _ in p.grids],
                        meta=TransferMeta.joined([p.meta for p in parts]),
                        extras={key: [v for p in parts for v in p.extras.get(key, [])]
                                for key in {key for p in parts for key in p.extras}},
                        rows_sha256=parts[0].rows_sha256 if len(parts) == 1 else None)

    async def _part(self, rid: str, index: int, images: list[str], modality: str = "image",
                    affinity: str | None = None, siblings: set[str] | None = None,
                    cache_salt: str | None = None) -> Embedded:
        tried: set[str] = set()
        last: _EncoderFault | None = None
        only_busy = True  # every encoder tried answered 429/503 (over its queue, or asleep)
        for attempt in range(1, self.max_attempts + 1):
            enc = await self._pick(tried, modality, affinity, siblings or set())
            if enc is None:
                break
            tried.add(enc.url)
            if siblings is not None:
                siblings.add(enc.url)
            estimate = self.tokens_per_image * len(images)
            enc.outstanding += estimate
            part_rid = f"{rid}/{'part' if modality == 'image' else modality}{index}.{attempt}"
            try:
                result = await self._encode_and_receive(enc, part_rid, images, modality, cache_salt)
            except ImageRefused:
                self.parts.labels(enc.url, "refused_image").inc()
                raise
            except _EncoderFault as exc:
                last, only_busy = exc, only_busy and exc.busy
                self.parts.labels(enc.url, "failed").inc()
                self.retries.inc()
                self._set_healthy(enc, False)
                log.warning("rid=%s: part %d on %s failed (attempt %d): %s", rid, index, enc.url, attempt, exc)
                continue
            finally:
                enc.outstanding -= estimate
            self.parts.labels(enc.url, "ok").inc()
            if modality == "image":
                self.tokens_per_image = max(1, result.meta.num_tokens // len(images))
            result.meta.attempts, result.meta.encoders = attempt, [enc.url]
            return result
        if not tried and all(e.modalities is not None and modality not in e.modalities for e in self.encoders):
            raise ImageRefused(FailureKind.BAD_REQUEST,
                               f"none of this language server's encoders takes {modality}s (their /health "
                               f"lists {sorted({m for e in self.encoders for m in e.modalities or ()})})")
        # Never twice on one encoder: what failed a part there (dead, frozen, busy, refusing this
        # worker's rooms) would most likely fail it again, at the cost of another detection.
        others = len(self.encoders) - len(tried)
        why = (f"; {others} other(s) out of rotation, not answering /health, or not taking {modality}s"
               if others and len(tried) < self.max_attempts else "")
        # busy (or asleep) everywhere it was tried, or no encoder answering /health to try (all dead or
        # cut off): the client's answer is 503 with Retry-After, to come back; an encoder failing it: 502
        if last is None:
            kind = FailureKind.UNAVAILABLE
        else:
            kind = FailureKind.OVERLOADED if only_busy else FailureKind.PEER_FAILED
        raise TransferFailure(kind, f"request {rid}: no encoder could encode part {index} (tried {len(tried)} of "
                                    f"{len(self.encoders)} encoders, one attempt each, at most {self.max_attempts}"
                                    f"{why}): {last or 'no encoder answers /health'}")

    async def _pick(self, tried: set[str], modality: str = "image", affinity: str | None = None,
                    siblings: set[str] = frozenset()) -> Encoder | None:
        """The healthy encoder not tried yet (and not known to refuse ``modality``) that
        ``affinity`` hashes to, or the least loaded one when that one is busier by a slack (see
        the module docstring); one no other part of the request went to, while there is one.
        One out of rotation comes back once its /health answers (asked at most once a second, or
        at once when no other is left)."""
        now = time.monotonic()
        left = [e for e in self.encoders if e.url not in tried and (e.modalities is None or modality in e.modalities)]
        none_healthy = not any(e.healthy for e in left)
        for enc in left:
            if not enc.healthy and (none_healthy or now >= enc.next_probe):
                enc.next_probe = now + PROBE_INTERVAL
                self._set_healthy(enc, await self._probe(enc))
        healthy = [e for e in left if e.healthy]
        healthy = [e for e in healthy if e.url not in siblings] or healthy
        if not healthy:
            return None
        least = min(healthy, key=lambda e: e.outstanding)
        if affinity is None:
            return least
        hashed = max(healthy, key=lambda e: rendezvous_weight(affinity, e.url))
        slack = AFFINITY_SLACK_IMAGES * self.tokens_per_image
        return hashed if hashed.outstanding < least.outstanding + slack else least

    async def _probe(self, enc: Encoder) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(f"{enc.url}/health",
                                         timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                health = await resp.json()
            enc.bootstrap_port = int(health["bootstrap_port"])
            enc.max_images = int(health.get("max_images", ENCODER_MAX_IMAGES))  # a fork encoder does not say
            enc.modalities = tuple(str(m) for m in health.get("modalities", ["image"]))
            self.fingerprints[enc.url] = str(health["preprocessing"])
            return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError, AttributeError):
            return False

    async def _encode_and_receive(self, enc: Encoder, part_rid: str, images: list[str],
                                  modality: str = "image", cache_salt: str | None = None) -> Embedded:
        """One part on one encoder. This worker's own refusals (asleep, over its queue, a rid in
        use, an embedding too large for its pool) pass through unchanged; the encoder's failures
        are :class:`_EncoderFault`; the encoder's 4xx about the images is :class:`ImageRefused`."""
        assert self._session is not None
        if enc.bootstrap_port is None and not await self._probe(enc):
            raise _EncoderFault(f"encoder {enc.url} does not answer /health")
        room = secrets.randbits(62)
        future = self.worker.submit(part_rid, f"{enc.host}:{enc.bootstrap_port}", room)
        receiving = asyncio.ensure_future(wait_for_future(future, lambda: None))
        media = {f"{modality}s": images, **({"cache_salt": cache_salt} if cache_salt else {})}
        encoding = asyncio.ensure_future(self._post_encode(enc, part_rid, room, media))
        try:
            # Whichever side fails first decides: a room this worker saw fail (encoder declared
            # dead, init refused, room aborted) does not wait for that encoder's /encode to time
            # out; the request is dropped (the encoder ends a room whose caller went away).
            await asyncio.wait((receiving, encoding), return_when=asyncio.FIRST_COMPLETED)
            # This worker's own failure of the room (its pool full, asleep) decides even when the
            # encoder's answer is in too: that answer then echoes it (502 "aborted by language peer").
            # The room fails here before the encoder is told; one turn of the loop lets that land.
            if encoding.done() and not receiving.done():
                await asyncio.sleep(0)
            own = receiving.exception() if receiving.done() else None
            if isinstance(own, TransferFailure) and own.kind in OUR_SIDE and not own.by_peer:
                raise own
            failure = None if encoding.done() else receiving.exception()
            if isinstance(failure, TransferFailure) and failure.kind in ABOUT_THE_IMAGES:
                # the encoder refused the images and failed the room for it: its own answer, with
                # its status and words for the client, is on its way
                await asyncio.wait((encoding,), timeout=REFUSAL_GRACE_S)
            if failure is not None and not encoding.done():
                await self._received(enc, receiving)  # raises
            encoded = await encoding
            transfer = await self._received(enc, receiving)
            if transfer.get("sha256") != encoded.get("sha256"):  # end to end: what was sent is what landed
                raise _EncoderFault(f"encoder {enc.url}: the embedding's digest differs between the two sides")
        except BaseException:
            self.worker.cancel(part_rid, "its encoder failed; sent to another one")
            receiving.cancel()
            encoding.cancel()
            raise
        rows = transfer.pop("embedding")
        try:
            grids, extras = LAYOUTS[modality](encoded, len(rows), len(images))
        except LayoutError as exc:
            raise _EncoderFault(f"encoder {enc.url}: its embedding cannot be placed: {exc}") from None
        if encoded.get("preprocessing"):
            self.fingerprints[enc.url] = str(encoded["preprocessing"])
        meta = TransferMeta.received(transfer, encode_ms=encoded.get("encode_ms", 0.0),
                                     preprocessing=self.fingerprints.get(enc.url))
        return Embedded(rows, grids, meta=meta, extras=extras, rows_sha256=transfer["sha256"])

    @staticmethod
    async def _received(enc: Encoder, receiving: asyncio.Future) -> dict:
        """The part's transfer; the encoder's failures (its refusals for being busy or asleep
        among them) as :class:`_EncoderFault`, ours as they are."""
        try:
            return await receiving
        except TransferFailure as exc:
            if exc.by_peer and exc.kind in BUSY:  # the encoder's refusal, not this worker's: another may take it
                raise _EncoderFault(f"encoder {enc.url}: {exc}", busy=True) from None
            if exc.kind in OUR_SIDE:
                raise
            raise _EncoderFault(f"encoder {enc.url}: {exc}") from None

    async def _post_encode(self, enc: Encoder, part_rid: str, room: int, media: dict) -> dict:
        """``media``: ``{"images": [...]}`` or ``{"videos": [...]}`` (and the request's ``cache_salt``)."""
        assert self._session is not None
        try:
            async with self._session.post(f"{enc.url}/encode", json={"rid": part_rid, "bootstrap_room": room,
                                                                      **media}) as resp:
                if resp.status == 200:
                    encoded = await resp.json()
                    if not isinstance(encoded, dict):
                        raise ValueError("not a JSON object")
                    return encoded
                why = (await resp.text())[:500]
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            raise _EncoderFault(f"encoder {enc.url}: {type(exc).__name__}: {exc}") from None
        if 400 <= resp.status < 500 and resp.status not in (408, 429):  # about the images
            kind = {"images": "image", "videos": "video", "audios": "audio clip"}.get(next(iter(media), ""), "input")
            raise ImageRefused(FailureKind.answered(resp.status),
                               f"encoder {enc.url} refused the {kind} ({resp.status}): {why}")
        raise _EncoderFault(f"encoder {enc.url} answered {resp.status}: {why}", busy=resp.status in (429, 503))


def affinity_of(ref: str, digest: str | None) -> str:
    """What an item is routed by: its bytes' digest when this worker holds them, else its reference."""
    return digest or hashlib.sha256(ref.encode()).hexdigest()


def rendezvous_weight(affinity: str, url: str) -> bytes:
    """An encoder's weight for an item: the item goes to the heaviest encoder (rendezvous hashing),
    so an encoder that leaves moves only its own items."""
    return hashlib.sha256(f"{affinity}|{url}".encode()).digest()


def merged_grids(encoded: dict, kind: str, count: int, rows: int) -> list[tuple[int, int, int]]:
    """The ``(t, h, w)`` grids of the encoder's answer for ``count`` images or videos (``kind``),
    each of 2x2-merged patches, together exactly ``rows`` rows."""
    try:
        grids = [(int(t), int(h), int(w)) for t, h, w in encoded["grid_thw"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"the answer has no usable {kind} grids ({type(exc).__name__})") from None
    if any(min(grid) <= 0 or grid[1] % MERGE or grid[2] % MERGE for grid in grids):
        raise LayoutError(f"{kind} grids {grids} are not grids of {MERGE}x{MERGE} merged patches")
    if len(grids) != count or sum(t * h * w for t, h, w in grids) != rows * MERGE * MERGE:
        raise LayoutError(f"{kind} grids {grids} do not describe {rows} rows of {count} {kind}(s)")
    return grids


def image_layout(encoded: dict, rows: int, images: int) -> tuple[list[tuple[int, int, int]], dict]:
    """The images' ``(1, h, w)`` patch grids from the encoder's answer, checked against the rows
    that came: one grid of one frame per image."""
    grids = merged_grids(encoded, "image", images, rows)
    if any(t != 1 for t, _, _ in grids):
        raise LayoutError(f"image grids {grids} are not grids of one frame")
    return grids, {}


def video_layout(encoded: dict, rows: int, videos: int) -> tuple[list[tuple[int, int, int]], dict]:
    """The videos' ``(t, h, w)`` grids and position metadata from the encoder's answer, checked
    against the rows that came: one grid and one metadata entry per video, one timestamp per
    temporal patch."""
    grids = merged_grids(encoded, "video", videos, rows)
    try:
        extras = {}
        if "video_timestamps" in encoded:
            extras["video_timestamps"] = [[float(t) for t in video] for video in encoded["video_timestamps"]]
        if "second_per_grid_ts" in encoded:
            extras["second_per_grid_ts"] = [float(s) for s in encoded["second_per_grid_ts"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"the answer has no usable video metadata ({type(exc).__name__})") from None
    if any(len(values) != videos for values in extras.values()):
        raise LayoutError(f"video metadata {sorted(extras)} does not describe {videos} video(s)")
    stamps = extras.get("video_timestamps")
    if stamps is not None and any(len(s) != t for s, (t, _, _) in zip(stamps, grids, strict=True)):
        raise LayoutError("a video's timestamps do not match its temporal patches")
    return grids, extras


def audio_layout(encoded: dict, rows: int, clips: int) -> tuple[list[tuple[int]], dict]:
    """The clips' token counts from the encoder's answer (its ``grid_thw``: one count per
    clip), checked against the rows that came, and their mel frame counts, which SGLang's
    language side takes (``audio_feature_lens``)."""
    try:
        counts = [int(count) for (count,) in encoded["grid_thw"]]
        mel_frames = [int(n) for n in encoded["audio_feature_lens"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"the answer has no usable audio token counts ({type(exc).__name__})") from None
    if len(counts) != clips or len(mel_frames) != clips or min(counts + mel_frames, default=0) <= 0 or \
            sum(counts) != rows:
        raise LayoutError(f"audio token counts {counts} do not describe {rows} rows of {clips} clip(s)")
    return [(count,) for count in counts], {"audio_feature_lens": mel_frames}


# how the rows of a part are laid out, from the encoder's answer (the two-request flow has none:
# its images' grids are read from the positions on the wire)
LAYOUTS = {"image": image_layout, "video": video_layout, "audio": audio_layout}


class _EncoderFault(Exception):
    """A part failed on the encoder's side (unreachable, busy, failed): it goes to another
    encoder, and this one gets no new part until its /health answers. ``busy``: it said so
    (429/503: over its queue, or asleep)."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy
