"""Finished image embeddings kept by the language worker, so a chat that sends the same image
every turn skips the encoder and the transfer after the first.

The key is the sha256 of the image's bytes and the encoders' preprocessing fingerprint (their
``/health`` ``preprocessing``: settings, tower config and weight files), so two images that
differ in one pixel, or one image under two preprocessings, never share an entry. Only images
whose bytes the language worker holds are keyed: ``data:`` URIs (what OpenAI clients send);
paths and URLs are read by the encoders, and go to them every time. An LRU over a byte budget
(rows' bytes); an embedding larger than the whole budget is not kept.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import threading

import numpy as np

from language_side.layout import image_token_count

Grid = tuple[int, int, int]


def image_digest(source: str) -> str | None:
    """sha256 of an image source's bytes, or None when the worker does not hold them (a path or
    a URL) or the ``data:`` URI does not decode (the encoder will say why)."""
    if source[:5].lower() != "data:" or "," not in source:  # schemes are case-insensitive
        return None
    header, payload = source.split(",", 1)
    if not header.lower().endswith(";base64"):
        return None
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None
    return hashlib.sha256(data).hexdigest()


def image_key(source: str, fingerprint: str) -> str | None:
    """The cache key of an image source under a preprocessing fingerprint (see
    :func:`image_digest`)."""
    digest = image_digest(source)
    return None if digest is None else cache_key(digest, fingerprint)


def cache_key(digest: str, fingerprint: str) -> str:
    return f"{digest}:{fingerprint}"


def split_rows(rows: np.ndarray, grids: list[Grid]) -> list[np.ndarray]:
    """A part's rows, one array per image (each image takes its grid's merged token count)."""
    ends = np.cumsum([image_token_count(g) for g in grids])
    if ends[-1] != len(rows):
        raise ValueError(f"{len(rows)} embedding rows for grids of {int(ends[-1])} tokens")
    return np.split(rows, ends[:-1])


class EmbeddingCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.used = 0
        self._entries: collections.OrderedDict[str, tuple[np.ndarray, Grid]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> tuple[np.ndarray, Grid] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, rows: np.ndarray, grid: Grid) -> None:
        """Keep ``rows`` (a copy of its own, so a larger array it views can go), evicting the
        least recently used entries as needed."""
        if rows.nbytes > self.budget:
            return
        rows = np.array(rows, copy=True)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.used -= old[0].nbytes
            while self._entries and self.used + rows.nbytes > self.budget:
                _, (evicted, _) = self._entries.popitem(last=False)
                self.used -= evicted.nbytes
            self._entries[key] = (rows, grid)
            self.used += rows.nbytes
