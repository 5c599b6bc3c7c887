"""What an encode worker does not encode twice: items (images, videos, audio clips) that are in
the cluster's embedding cache, and items another request on this worker is encoding right now.

An item is known by its key (``worker_infra.embedding_store.media_key``: the SHA-256 of the bytes
this worker fetched and the encoder's fingerprint). A request first waits for the items another
request here has claimed (a leader's forward pass, then its write to the store: the same image
sent twice at once is encoded once), then claims the others, looks them up in the store, and
encodes what is not there. A leader's failure releases its claims: a follower then encodes the item
itself. A claim lasts until the store has the item (or its write was dropped), so a request that
comes between the forward pass and the write's landing reuses it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable

import numpy as np

from embedding_side.encoders import EncodedImages
from worker_infra.embedding_store import EmbeddingStore, StoredMedia, media_key, salted


def rows_of(grid: tuple[int, ...], merge_size: int) -> int:
    """An item's embedding rows: its merged patches (``(t, h, w)``), or its count (audio ``(n,)``)."""
    if len(grid) == 1:
        return grid[0]
    t, h, w = grid
    return t * h * w // (merge_size * merge_size)


def split_items(encoded: EncodedImages, merge_size: int) -> list[StoredMedia]:
    """One request's encoded items, one entry each (rows, grid, that item's position metadata)."""
    ends = np.cumsum([rows_of(tuple(g), merge_size) for g in encoded.grid_thw])
    rows = np.split(encoded.embeddings, ends[:-1])
    return [StoredMedia(item_rows, tuple(int(n) for n in grid), {name: values[i] for name, values in
                                                                 encoded.extras.items()})
            for i, (item_rows, grid) in enumerate(zip(rows, encoded.grid_thw, strict=True))]


def join_items(items: list[StoredMedia], hidden_size: int) -> EncodedImages:
    """The reverse of :func:`split_items`, items in request order."""
    names = {name for item in items for name in item.extras}
    rows = items[0].rows if len(items) == 1 else np.concatenate([item.rows for item in items])
    return EncodedImages(rows, [item.grid for item in items], hidden_size,
                         {name: [item.extras[name] for item in items] for name in sorted(names)})


class SharedEncodings:
    def __init__(self, store: EmbeddingStore, fingerprint: Callable[[], str]) -> None:
        self.store = store
        self._fingerprint = fingerprint
        self._claims: dict[str, concurrent.futures.Future] = {}  # key -> its leader's item (event loop only)

    def keys(self, modality: str, digests: list[str], cache_salt: str | None = None) -> list[str]:
        fingerprint = salted(self._fingerprint(), cache_salt)
        return [media_key(modality, digest, fingerprint) for digest in digests]

    async def reuse(self, keys: list[str], wait: Callable[[concurrent.futures.Future], Awaitable[object]]
                    ) -> tuple[dict[int, StoredMedia], dict[str, concurrent.futures.Future]]:
        """The items (by index) this request need not encode, and its claims on the others, which
        it encodes (:meth:`settle` or :meth:`abandon` them). ``wait(future)`` waits for another
        request's claim (the caller's own room failing ends the wait)."""
        found: dict[int, StoredMedia] = {}
        while waiting := [i for i, key in enumerate(keys) if i not in found and key in self._claims]:
            for i in waiting:
                if i not in found and (claim := self._claims.get(keys[i])) is not None:
                    try:
                        item = await wait(_follow(claim))
                    except _LeaderFailed:  # unclaimed now: this request may claim it below
                        continue
                    found.update({j: item for j, key in enumerate(keys) if key == keys[i]})
        # claimed with no wait since the loop saw none claimed: no other request can claim them between
        claims = {key: concurrent.futures.Future() for i, key in enumerate(keys) if i not in found}
        self._claims.update(claims)
        try:
            entries = await asyncio.gather(*(self.store.get(key) for key in claims))
        except BaseException:
            self.abandon(claims)
            raise
        for key, entry in zip(list(claims), entries, strict=True):
            if entry is not None:  # in the store already: followers take it from here, nothing to write
                claim = claims.pop(key)
                claim.set_result(entry)
                self._end(key, claim)
                found.update({i: entry for i, k in enumerate(keys) if k == key})
        return found, claims

    def settle(self, claims: dict[str, concurrent.futures.Future], keys: list[str],
               items: list[StoredMedia]) -> None:
        """The claimed items are encoded: followers get them, the store gets a copy, and each claim
        ends once its write is done."""
        loop = asyncio.get_running_loop()
        for key, item in zip(keys, items, strict=True):
            if (claim := claims.pop(key, None)) is None:
                continue
            claim.set_result(item)
            self.store.put_soon(key, item, on_done=lambda key=key, claim=claim: loop.call_soon_threadsafe(
                self._end, key, claim))

    def abandon(self, claims: dict[str, concurrent.futures.Future]) -> None:
        """This request failed before its items were encoded: followers encode them themselves."""
        for key, claim in claims.items():
            if not claim.done():
                claim.set_exception(_LeaderFailed())
            self._end(key, claim)
        claims.clear()

    def _end(self, key: str, claim: concurrent.futures.Future) -> None:
        if self._claims.get(key) is claim:
            del self._claims[key]


class _LeaderFailed(Exception):
    """The request encoding an item failed first."""


def _follow(claim: concurrent.futures.Future) -> concurrent.futures.Future:
    """A future of a follower's own, done with ``claim``: cancelling it (the follower's room
    failed) leaves the claim to the others."""
    mine: concurrent.futures.Future = concurrent.futures.Future()

    def copy(done: concurrent.futures.Future) -> None:
        if mine.set_running_or_notify_cancel():
            if done.exception() is not None:
                mine.set_exception(done.exception())
            else:
                mine.set_result(done.result())

    claim.add_done_callback(copy)
    return mine
