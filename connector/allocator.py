"""Block allocator over ``num_blocks`` block ids that keeps requests contiguous."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np


class BlockAllocator:
    """Owns block ids ``0..num_blocks-1``; every id is either free or handed out, never both.

    Allocation is best fit: the smallest run of consecutive free ids that holds the request,
    else the lowest free ids. Contiguous blocks mean one write per buffer on the sender and a
    zero-copy view on the receiver. Allocation is all-or-nothing and returns ``None`` when too
    few blocks are free (callers wait; it is not an error). Freeing an id that is not handed
    out raises ``ValueError`` and frees nothing. Thread-safe; O(num_blocks) numpy per call.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._in_use = np.zeros(num_blocks, dtype=bool)  # True while a block is handed out
        self._free_count = num_blocks

    @property
    def free_blocks(self) -> int:
        return self._free_count

    def all_free(self) -> bool:
        """The leak check tests call: every block is back."""
        return self._free_count == self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        if n <= 0:
            raise ValueError(f"must allocate at least one block, asked for {n}")
        with self._lock:
            if n > self._free_count:
                return None
            free = np.flatnonzero(~self._in_use)
            starts = np.concatenate(([0], np.flatnonzero(np.diff(free) != 1) + 1))
            lengths = np.diff(np.concatenate((starts, [len(free)])))
            fitting = np.flatnonzero(lengths >= n)
            if len(fitting):
                best = fitting[np.argmin(lengths[fitting])]
                ids = free[starts[best]:starts[best] + n]
            else:
                ids = free[:n]
            self._in_use[ids] = True
            self._free_count -= n
            return ids.tolist()

    def free(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        if not ids:
            return
        arr = np.asarray(ids, dtype=np.int64)
        with self._lock:
            if arr.min() < 0 or arr.max() >= self.num_blocks:
                raise ValueError(f"block id outside 0..{self.num_blocks - 1}: {ids}")
            if len(set(ids)) != len(ids) or not self._in_use[arr].all():
                raise ValueError(f"double free or never allocated: {ids}")
            self._in_use[arr] = False
            self._free_count += len(ids)


def pool_blocks(allocator: BlockAllocator | None) -> tuple[int, int]:
    """``(free, total)`` blocks, ``(0, 0)`` while a worker sleeps with its pool released."""
    return (allocator.free_blocks, allocator.num_blocks) if allocator is not None else (0, 0)
