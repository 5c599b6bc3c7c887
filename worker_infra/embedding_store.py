"""The cluster's embedding cache: finished embeddings of images, videos and audio clips in
Mooncake Store, shared by every encode worker (which fill it) and language server (which read it).

An entry's key is ``epd-emb/<modality>/<sha256 of the media's bytes>/<encoder fingerprint>``,
computed by the worker from bytes it holds: a client never names a key, and nothing a client
sends is written. An entry is one blob::

    MAGIC | header length (u32, little endian) | header (JSON) | rows | HMAC-SHA256 (32 bytes)

The header holds the key, the rows' shape and the item's grid and position metadata; the tag
covers everything before it, keyed by the control secret (``--control-secret``; without one it
still catches bytes that changed, not a forger). An entry whose tag, key or shape does not check
is removed and treated as a miss: it never reaches an encoder's answer or a prefill.

Every call to the store runs on a thread of its own with a bound (``timeout_s``): a master that
is down or unreachable costs a request at most that, then the cache counts as unavailable (a log
line, ``epd_global_cache_available`` 0) and is skipped for :data:`RETRY_AFTER_S` before it is
tried again; encoding goes on without it. Writes are best effort, in the background, at most
:data:`MAX_PENDING_PUTS` waiting (more are dropped, never queued without bound). A full store
evicts (the master's watermark), so a put may fail or an entry go: both are misses, never an
error to a client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import enum
import hashlib
import hmac
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import Counter, Gauge

if TYPE_CHECKING:
    from connector.transport import Transport

log = logging.getLogger(__name__)

MAGIC = b"EPDEMB1\n"
TAG_BYTES = 32
MAX_HEADER_BYTES = 1 << 20  # a grid and per-frame timestamps fit in far less
RETRY_AFTER_S = 5.0  # how long an unavailable store is skipped before the next try
MAX_PENDING_PUTS = 4  # entries waiting to be written; more are dropped
STORE_THREADS = 4  # calls in flight at once (one stuck call does not hold the others)
KEY_PREFIX = "epd-emb"
P2P_METADATA = "P2PHANDSHAKE"  # peers tell each other their segments (the connector's engine's metadata)
LOCAL_BUFFER_BYTES = 16 << 20  # the client's staging for put() and get(), which this module does not use
# Mooncake Store's return codes (mooncake-store types.h)
NO_AVAILABLE_HANDLE = -200  # full: no segment has room (its eviction runs behind)
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800  # a segment's holder is gone
RPC_FAIL = -900  # the master does not answer


def media_key(modality: str, digest: str, fingerprint: str) -> str:
    """The key of one item's embedding: what the bytes are and what encoded them."""
    return f"{KEY_PREFIX}/{modality}/{digest}/{fingerprint}"


MAX_CACHE_SALT_CHARS = 1024  # a tenant's name, not a payload: both roles refuse a longer one (4xx)


def salted(fingerprint: str, cache_salt: str | None) -> str:
    """The fingerprint a request's entries are keyed under: the encoder's, or with SGLang's
    ``cache_salt`` one of that salt's own, so no request reads (or learns of) an entry another salt
    wrote, in any cache (this worker's or the cluster's), as SGLang's radix cache keeps salts apart."""
    if not cache_salt:
        return fingerprint
    return f"{fingerprint}.{hashlib.sha256(f'{fingerprint}|{cache_salt}'.encode()).hexdigest()[:32]}"


class EntryRejected(ValueError):
    """An entry that is not what its key says (tag, key, shape): never used."""


@dataclass(frozen=True)
class StoredMedia:
    """One item's embedding: its rows (``uint8 [tokens, hidden * itemsize]``, the connector's
    layout), its grid (``(t, h, w)``, or ``(tokens,)`` for audio) and its position metadata (a
    video's timestamps, a clip's mel frame count: the encoder's per-item values)."""

    rows: np.ndarray
    grid: tuple[int, ...]
    extras: dict = field(default_factory=dict)


def pack(key: str, item: StoredMedia, secret: bytes) -> np.ndarray:
    """The entry of ``item`` under ``key``, as one contiguous array (what the store copies from)."""
    rows = np.ascontiguousarray(item.rows, dtype=np.uint8)
    header = json.dumps({"key": key, "shape": list(rows.shape), "grid": list(item.grid),
                         "extras": item.extras}, sort_keys=True).encode()
    start = len(MAGIC) + 4 + len(header)
    blob = np.empty(start + rows.nbytes + TAG_BYTES, np.uint8)
    blob[:start] = np.frombuffer(MAGIC + struct.pack("<I", len(header)) + header, np.uint8)
    blob[start:start + rows.nbytes] = rows.reshape(-1)
    blob[-TAG_BYTES:] = np.frombuffer(hmac.new(secret, memoryview(blob[:-TAG_BYTES]), hashlib.sha256).digest(),
                                      np.uint8)
    return blob


def unpack(key: str, blob: bytes | np.ndarray, secret: bytes) -> StoredMedia:
    """The entry in ``blob`` if it is ``key``'s and intact, else :class:`EntryRejected`."""
    view = memoryview(blob)
    start = len(MAGIC) + 4
    if len(view) < start + TAG_BYTES or view[:len(MAGIC)] != MAGIC:
        raise EntryRejected("not an embedding entry")
    body, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
    if not hmac.compare_digest(hmac.new(secret, body, hashlib.sha256).digest(), tag):
        raise EntryRejected("its bytes do not match its tag")
    (header_len,) = struct.unpack_from("<I", view, len(MAGIC))
    if header_len > min(MAX_HEADER_BYTES, len(body) - start):
        raise EntryRejected("its header length is out of bounds")
    try:
        header = json.loads(bytes(view[start:start + header_len]))
        shape = tuple(int(n) for n in header["shape"])
        grid = tuple(int(n) for n in header["grid"])
        extras = dict(header["extras"])
        stored_key = header["key"]
    except (ValueError, KeyError, TypeError) as exc:
        raise EntryRejected(f"its header does not parse ({type(exc).__name__})") from None
    if stored_key != key:
        raise EntryRejected(f"it is the entry of another key ({str(stored_key)[:200]!r})")
    rows = np.frombuffer(body, np.uint8, offset=start + header_len)
    if isinstance(blob, np.ndarray):  # the array read into: writable, as the rows' consumers expect
        rows = blob[start + header_len:len(body)]
    if len(shape) != 2 or min(shape) <= 0 or shape[0] * shape[1] != rows.size or min(grid, default=0) <= 0:
        raise EntryRejected(f"its shape {shape} and grid {grid} do not describe its {rows.size} bytes")
    return StoredMedia(rows.reshape(shape), grid, extras)


class StoreState(enum.Enum):
    UNCONNECTED = "unconnected"  # not set up yet (or its set-up failed: tried again after RETRY_AFTER_S)
    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"  # a call failed or ran out of time: skipped until RETRY_AFTER_S has passed


# state -> the states it may go to (StoreState changes only through EmbeddingStore._become)
TRANSITIONS = {
    StoreState.UNCONNECTED: {StoreState.AVAILABLE, StoreState.UNAVAILABLE},
    StoreState.AVAILABLE: {StoreState.UNAVAILABLE},
    StoreState.UNAVAILABLE: {StoreState.AVAILABLE},
}


@dataclass(frozen=True)
class StoreSettings:
    master: str  # the Mooncake master's RPC address, host:port
    metadata: str  # the transfer engine's metadata: "P2PHANDSHAKE" or the master's http://host:port/metadata
    local_host: str  # the address this worker's store client is reached at
    segment_bytes: int  # memory this worker lends the store (0: it only reads and writes through others)
    timeout_s: float = 2.0
    secret: bytes = b""
    max_entry_bytes: int = 1 << 30  # an entry larger than this is neither read nor written


class EmbeddingStore:
    """Mooncake Store as the cluster's embedding cache (see the module docstring)."""

    def __init__(self, settings: StoreSettings,
                 client_factory: Callable[[StoreSettings, Transport | None], object] | None = None) -> None:
        self.settings = settings
        self.state = StoreState.UNCONNECTED
        self._client = None
        self._client_factory = client_factory or _mooncake_client
        self._transport: Transport | None = None  # the worker's, whose engine the client shares
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._connecting: concurrent.futures.Future | None = None
        self._calls = concurrent.futures.ThreadPoolExecutor(STORE_THREADS, thread_name_prefix="embedding-store")
        self._counts = threading.Lock()  # guards the two counts below
        self._in_flight = 0  # calls on the store's threads
        self._pending_puts = 0
        # registered by the worker that uses the store, in its own registry (``collectors``)
        self.lookups = Counter("epd_global_cache_lookups", "Lookups in the cluster's embedding cache, by outcome",
                               ["outcome"], registry=None)
        self.puts = Counter("epd_global_cache_puts", "Entries written to the cluster's embedding cache, by outcome",
                            ["outcome"], registry=None)
        self.read_bytes = Counter("epd_global_cache_read_bytes", "Bytes of entries read from the cluster's embedding "
                                  "cache", registry=None)
        self.written_bytes = Counter("epd_global_cache_written_bytes", "Bytes of entries written to the cluster's "
                                     "embedding cache", registry=None)
        available = Gauge("epd_global_cache_available", "1 while the cluster's embedding cache answers", registry=None)
        available.set_function(lambda: float(self.state == StoreState.AVAILABLE))
        self.collectors = (self.lookups, self.puts, self.read_bytes, self.written_bytes, available)

    # ---- state -----------------------------------------------------------------------------------

    def _become(self, state: StoreState, why: str = "") -> None:
        with self._lock:
            if state == self.state:
                return
            if state not in TRANSITIONS[self.state]:
                raise AssertionError(f"embedding store: {self.state.value} -> {state.value}")
            self.state = state
            if state == StoreState.AVAILABLE:
                log.info("the cluster's embedding cache (Mooncake Store at %s) answers", self.settings.master)
            else:
                self._retry_at = time.monotonic() + RETRY_AFTER_S
                log.warning("the cluster's embedding cache (Mooncake Store at %s) is unavailable: %s; media are "
                            "encoded without it, tried again in %gs", self.settings.master, why, RETRY_AFTER_S)

    def _usable(self) -> bool:
        """Whether a call may go to the store now (set up, or a set-up started in the background)."""
        if self.state != StoreState.AVAILABLE and time.monotonic() < self._retry_at:
            return False
        if self._client is None:
            self._connect_soon()
            return False
        return self._in_flight < STORE_THREADS  # every thread stuck in a call: skip it, never queue

    def _connect_soon(self) -> None:
        with self._lock:
            if self._connecting is not None and not self._connecting.done():
                return
            self._connecting = self._calls.submit(self._connect)

    def _connect(self) -> None:
        try:
            client = self._client_factory(self.settings, self._transport)
        except Exception as exc:  # noqa: BLE001 - any failure of Mooncake's set-up: go on without the cache
            self._become(StoreState.UNAVAILABLE, f"set-up failed: {exc}")
            return
        # Never destroyed: its destructor unmounts the memory it lent with the master, holding the
        # GIL all the while (16 s measured with the master gone), at the interpreter's exit too
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))
        self._client = client
        self._become(StoreState.AVAILABLE)

    def connect(self, transport: Transport | None = None, timeout: float | None = None) -> bool:
        """Set the client up now (at start-up), moving its bytes with ``transport``'s engine (the
        worker's own: one engine per process) where it has one to share; whether the store answers."""
        self._transport = transport
        self._connect_soon()
        assert self._connecting is not None
        try:
            self._connecting.result(timeout or self.settings.timeout_s)
        except concurrent.futures.TimeoutError:
            self._become(StoreState.UNAVAILABLE, f"no answer to set-up within {timeout or self.settings.timeout_s}s")
        return self.state == StoreState.AVAILABLE

    async def _call(self, what: str, fn, *args):
        """``fn(client, *args)`` on a store thread within ``timeout_s``; raises TimeoutError or the
        call's error (the caller counts it a miss, and the store unavailable)."""
        with self._counts:
            self._in_flight += 1
        future = self._calls.submit(fn, self._client, *args)
        future.add_done_callback(lambda _: self._release_thread())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.settings.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"{what} took over {self.settings.timeout_s:g}s") from None

    def _release_thread(self) -> None:
        with self._counts:
            self._in_flight -= 1

    # ---- reads and writes ------------------------------------------------------------------------

    async def get(self, key: str) -> StoredMedia | None:
        """``key``'s entry, checked; None for a miss (absent, rejected, or the store not answering)."""
        if not self._usable():
            self.lookups.labels("skipped").inc()
            return None
        try:
            blob = await self._call("a lookup", _read, key, self.settings.max_entry_bytes)
        except EntryRejected as exc:
            self.lookups.labels("rejected").inc()
            log.warning("the cluster's embedding cache held a bad entry under %s (%s): not used", key, exc)
            return None
        except Exception as exc:  # noqa: BLE001 - the store's failure is a miss, never the client's error
            self.lookups.labels("error").inc()
            self._become(StoreState.UNAVAILABLE, f"a lookup failed: {type(exc).__name__}: {exc}")
            return None
        self._become(StoreState.AVAILABLE)
        if blob is None:
            self.lookups.labels("miss").inc()
            return None
        try:
            entry = await asyncio.to_thread(unpack, key, blob, self.settings.secret)
        except EntryRejected as exc:
            self.lookups.labels("rejected").inc()
            log.warning("the cluster's embedding cache held a bad entry under %s (%s): removed, not used", key, exc)
            self._remove_soon(key)
            return None
        self.lookups.labels("hit").inc()
        self.read_bytes.inc(blob.nbytes)
        return entry

    def put_soon(self, key: str, item: StoredMedia, on_done: Callable[[], None] = lambda: None) -> None:
        """Write ``item`` under ``key`` in the background (best effort: dropped when the store is
        unavailable or :data:`MAX_PENDING_PUTS` writes are waiting); ``on_done()`` follows, on
        the writing thread, or at once when it was dropped."""
        usable = self._usable()
        with self._counts:
            skip = not usable or self._pending_puts >= MAX_PENDING_PUTS
            if not skip:
                self._pending_puts += 1
                self._in_flight += 1
        if skip:
            self.puts.labels("skipped").inc()
            on_done()
            return

        def write() -> None:
            try:
                blob = pack(key, item, self.settings.secret)
                if blob.nbytes > self.settings.max_entry_bytes:
                    self.puts.labels("too_large").inc()
                    return
                outcome = _write(self._client, key, blob)
                self.puts.labels(outcome).inc()
                if outcome == "ok":
                    self.written_bytes.inc(blob.nbytes)
            except Exception as exc:  # noqa: BLE001 - a failed write is a miss later, never an error now
                self.puts.labels("failed").inc()
                self._become(StoreState.UNAVAILABLE, f"a write failed: {type(exc).__name__}: {exc}")
            finally:
                with self._counts:
                    self._pending_puts -= 1
                    self._in_flight -= 1
                on_done()

        self._calls.submit(write)

    def _remove_soon(self, key: str) -> None:
        if self._client is not None:
            self._calls.submit(self._client.remove, key, True)  # forced: the read's lease would keep it

    def close(self) -> None:
        """Stop using the store. The client itself is never closed nor destroyed (see
        :meth:`_connect`): the master drops the memory of a client that went silent after its
        ``client_ttl`` (10 s), and readers meanwhile count those entries as misses."""
        self._calls.shutdown(wait=False, cancel_futures=True)
        self._client = None


def _read(client, key: str, max_bytes: int) -> np.ndarray | None:
    """``key``'s entry (None when absent), read into an array of its size; :class:`EntryRejected`
    for one over ``max_bytes``, RuntimeError for the store's failure."""
    size = client.get_size(key)
    if size == OBJECT_NOT_FOUND:
        return None
    if size < 0:
        raise RuntimeError(f"the store answered {size}")
    if size > max_bytes:
        raise EntryRejected(f"{size} bytes, over the entry bound of {max_bytes}")
    blob = np.empty(size, np.uint8)
    read = client.get_into(key, blob.ctypes.data, size)
    if read in (OBJECT_NOT_FOUND, TRANSFER_FAIL):  # evicted between the two calls, or its holder is gone
        return None
    if read != size:
        raise RuntimeError(f"the store answered {read} reading {size} bytes")
    return blob


def _write(client, key: str, blob: np.ndarray) -> str:
    """``blob`` under ``key`` (replacing what is there: a bad entry, or the same item another
    encoder wrote); the outcome for the metrics. The store full is no failure (it evicts behind),
    nor is an object it will not replace now (read under a lease); RuntimeError when the store
    itself failed."""
    code = client.upsert_from(key, blob.ctypes.data, blob.nbytes)
    if code == 0:
        return "ok"
    if code == NO_AVAILABLE_HANDLE:
        return "full"
    if code == RPC_FAIL:
        raise RuntimeError(f"the store answered {code}")
    return "refused"  # e.g. the memory it chose belongs to a worker that just went


def _mooncake_client(settings: StoreSettings, transport: Transport | None):
    """A set-up client. It shares ``transport``'s engine (named by its session id) when the store's
    metadata is peer to peer, as that engine's is: a second engine in the process would open two
    more ports and start its own threads beside the first (and two engines set up side by side in
    one process have crashed it)."""
    from mooncake.store import MooncakeDistributedStore

    engine = transport.shared_engine() if transport is not None and settings.metadata == P2P_METADATA else None
    local = transport.session_id if engine is not None else settings.local_host
    # one set-up attempt (Mooncake's default is 20 of about 4.4 s each against a master that is down);
    # the store is tried again after RETRY_AFTER_S
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    client = MooncakeDistributedStore()
    code = client.setup(local, settings.metadata, settings.segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "",
                        settings.master, engine)
    if code != 0:
        raise RuntimeError(f"Mooncake Store set-up returned {code} (master {settings.master})")
    return client
