"""Encode side: which room's embedding moves between host memory and pool blocks next.

Rooms a destination asked for are placed first, in order; rooms nobody asked for yet borrow
free blocks (so the copy is done by the time their init comes) and give them back whenever an
asked-for room needs them: no room waits for blocks held by a room that waits for it
(``docs/flow_control.md``). The copies themselves run outside every lock (a 4K image is 75 MB);
the manager's placer thread runs them.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.sender_rooms import SenderPhase, SenderRoom


@dataclass(frozen=True)
class Move:
    room: SenderRoom
    blocks: tuple[int, ...]
    placing: bool  # True: the room's host data goes into ``blocks``; False: its blocks come back out


class PlacementQueue:
    """Rooms whose data waits in host memory for pool blocks, first come first served."""

    def __init__(self) -> None:
        self._rooms: collections.deque[SenderRoom] = collections.deque()

    def add(self, r: SenderRoom) -> bool:
        """Queue ``r`` unless it is queued already; True if it was added."""
        if r in self._rooms:
            return False
        self._rooms.append(r)
        return True

    def waiting_for_blocks(self) -> int:
        """Queued rooms a destination has asked for."""
        return sum(1 for r in self._rooms if r.inited)

    def next_move(self, allocator: BlockAllocator, pool: BufferPool, rooms: Iterable[SenderRoom]) -> Move | None:
        """The next copy, with the blocks it needs allocated; None when none can start now."""
        self._rooms = collections.deque(r for r in self._rooms if r.live and r.staged is not None
                                        and r.phase != SenderPhase.SUSPENDED)
        asked = next((r for r in self._rooms if r.inited), None)
        if asked is None:
            head = self._rooms[0] if self._rooms else None
            blocks = allocator.allocate(pool.blocks_for(head.total_tokens)) if head else None
            if blocks is None:
                return None
            self._rooms.popleft()
            return Move(head, tuple(blocks), True)
        blocks = allocator.allocate(pool.blocks_for(asked.total_tokens))
        if blocks is not None:
            self._rooms.remove(asked)
            return Move(asked, tuple(blocks), True)
        lent = [r for r in rooms if r.lent]
        if lent:  # newest first: the oldest is the likeliest to be asked for soon
            assert lent[-1].src_blocks is not None
            return Move(lent[-1], lent[-1].src_blocks, False)
        return None  # blocks come back as the asked-for rooms finish


def copy_out(pool: BufferPool, blocks: tuple[int, ...], num_tokens: int) -> Embedding:
    """An embedding's rows and aux read from its pool blocks into host memory."""
    out = Embedding.empty(num_tokens, pool.hidden_size, pool.dtype)
    pool.read_into(list(blocks), out, 0, num_tokens)
    out.aux[:] = pool.aux[blocks[0]]
    return out
