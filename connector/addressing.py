"""Turns a round (source blocks -> destination blocks) into a few contiguous writes.

Runs of blocks that are consecutive on both sides become one write per buffer, so a fresh
pool moves an 8192-token round in three writes instead of 3 x 64. All arithmetic is numpy
over the block arrays, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AUX_BUFFER = 3


@dataclass(frozen=True)
class WritePlan:
    src_addrs: list[int]
    dst_addrs: list[int]
    lengths: list[int]

    @property
    def nbytes(self) -> int:
        return sum(self.lengths)


def plan_round(src_blocks: list[int], dst_blocks: list[int], num_tokens: int, block_size: int,
               src_bases: tuple[int, ...], dst_bases: tuple[int, ...], item_lens: tuple[int, ...],
               with_aux: bool) -> WritePlan:
    """Writes for ``num_tokens`` tokens from ``src_blocks`` into ``dst_blocks``.

    Only the first ``ceil(num_tokens / block_size)`` pairs are used; the last block may be
    partial, in which case each buffer sends ``item_len * n // block_size`` bytes of it.
    ``with_aux`` adds the aux row of the first source block into the first destination block.
    """
    nb = -(-num_tokens // block_size)
    if nb > len(src_blocks) or nb > len(dst_blocks):
        raise ValueError(f"{num_tokens} tokens need {nb} blocks; have {len(src_blocks)} source, {len(dst_blocks)} destination")
    src = np.asarray(src_blocks[:nb], np.int64)
    dst = np.asarray(dst_blocks[:nb], np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [nb])))
    last_tokens = num_tokens - (nb - 1) * block_size
    src_addrs, dst_addrs, lengths = [], [], []
    for buf in range(AUX_BUFFER):
        item = item_lens[buf]
        run_len = counts * item
        run_len[-1] -= item - item * last_tokens // block_size
        src_addrs.append(src_bases[buf] + src[starts] * item)
        dst_addrs.append(dst_bases[buf] + dst[starts] * item)
        lengths.append(run_len)
    if with_aux:
        item = item_lens[AUX_BUFFER]
        src_addrs.append(np.array([src_bases[AUX_BUFFER] + src[0] * item]))
        dst_addrs.append(np.array([dst_bases[AUX_BUFFER] + dst[0] * item]))
        lengths.append(np.array([item]))
    return WritePlan(np.concatenate(src_addrs).tolist(), np.concatenate(dst_addrs).tolist(),
                     np.concatenate(lengths).tolist())
