"""Host memory for encoded embeddings that are not in pool blocks: a byte budget, FIFO.

(The encode worker also bounds the memory for decoding images with one; there every request is
an ordinary waiter, nobody is urgent.)

An encode request reserves the bytes of its embedding before it is encoded (the token count
follows from the image sizes). A room that no language peer has asked for yet is granted its
bytes in arrival order while they fit the budget, and otherwise waits (its caller bounds the
wait); a room whose every destination has already sent its init is granted at once, budget or
not, because a language worker is holding blocks for it and must not wait behind rooms nobody
has asked for (the deadlock-freedom argument in ``docs/flow_control.md``). Data that leaves
the pool for host memory (a sleep, a suspended room) is charged without waiting. Not
thread-safe: the sender manager calls it under its lock.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass
class _Waiter:
    room: int
    nbytes: int
    granted: Future


class ByteBudget:
    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"staging budget must be positive, got {limit}")
        self.limit = limit
        self.used = 0  # bytes granted or charged and not released
        self._held: dict[int, int] = {}  # room -> bytes granted or charged
        self._waiting: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def request(self, room: int, nbytes: int, urgent: bool) -> Future:
        """A future that completes (result None) once ``nbytes`` are granted to ``room``."""
        waiter = _Waiter(room, nbytes, Future())
        if urgent:
            self._grant(waiter)
        else:
            self._waiting.append(waiter)
            self._grant_in_order()
        return waiter.granted

    def charge(self, room: int, nbytes: int) -> None:
        """Count bytes that are already in host memory (they cannot wait)."""
        self._held[room] = self._held.get(room, 0) + nbytes
        self.used += nbytes

    def settle(self, room: int, nbytes: int) -> None:
        """The embedding of ``room`` arrived with ``nbytes``: charge the difference to what it was
        granted (all of it when it never asked)."""
        waiter = self._find(room)
        if waiter is not None:  # it came without waiting for its grant: it is here now
            self._waiting.remove(waiter)
            if waiter.granted.set_running_or_notify_cancel():
                waiter.granted.set_result(None)
        granted = self._held.get(room, 0)
        if nbytes != granted:
            self._held[room] = nbytes
            self.used += nbytes - granted

    def promote(self, room: int) -> None:
        """``room`` became urgent (its destinations inited it): grant it now if it waits."""
        waiter = self._find(room)
        if waiter is not None:
            self._waiting.remove(waiter)
            self._grant(waiter)

    def release(self, room: int, error: BaseException | None = None) -> None:
        """``room`` no longer holds host memory: give its bytes back, or stop its wait (its future
        gets ``error``)."""
        waiter = self._find(room)
        if waiter is not None:
            self._waiting.remove(waiter)
            if waiter.granted.set_running_or_notify_cancel():
                waiter.granted.set_exception(error or RuntimeError(f"room {room} ended"))
        self.used -= self._held.pop(room, 0)
        self._grant_in_order()

    def _find(self, room: int) -> _Waiter | None:
        return next((w for w in self._waiting if w.room == room), None)

    def _grant_in_order(self) -> None:
        # The head waits until it fits (one larger than the whole budget goes alone), so a large
        # embedding is never starved by a stream of small ones behind it.
        while self._waiting and (self.used + self._waiting[0].nbytes <= self.limit or self.used == 0):
            self._grant(self._waiting.popleft())

    def _grant(self, waiter: _Waiter) -> None:
        if waiter.granted.set_running_or_notify_cancel():  # a caller that gave up takes nothing
            self.charge(waiter.room, waiter.nbytes)
            waiter.granted.set_result(None)
