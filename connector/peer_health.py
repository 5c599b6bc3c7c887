"""Rooms failed in a row, per peer: what ``/health`` reports when a peer's process answers its
heartbeats but its rooms keep failing (inits refused, rooms aborted, writes that do not land).

A worker counts only failures that say something about the peer (``ABOUT_THE_PEER``), and only
of rooms the peer took part in (an encoder that spoke of the room; on the encode side, a room
its own encode request had): a room a client made up, which no encoder ever began, times out
without blaming anyone, unless the peer was found dead. A room that ends well clears its peer's
count. A peer with ``threshold`` failures in a row is listed,
and the worker's status reads ``degraded`` while any is, until ``window`` seconds pass without
another failure of that peer: a peer taken out of rotation (or gone) gets no room that could
clear its count, and the worker, serving well through its other peers, would read ``degraded``
for ever.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from connector.failures import FailureKind

# Failures that tell something about the peer, not about the request or this worker's own state.
ABOUT_THE_PEER = frozenset({FailureKind.ABORTED, FailureKind.PEER_DEAD, FailureKind.PEER_UNREACHABLE,
                            FailureKind.PEER_FAILED, FailureKind.MISMATCH, FailureKind.PROTOCOL,
                            FailureKind.TRANSFER, FailureKind.TIMEOUT})
# ... of which these count even for a room the peer never took part in: it was found gone
PEER_GONE = frozenset({FailureKind.PEER_DEAD, FailureKind.PEER_UNREACHABLE})
FAILING_AFTER = 3  # rooms failed in a row before a peer is reported
FAILING_WINDOW_S = 30.0  # ... until this long after its last failure
MAX_PEERS = 1024  # peers tracked at once; the one that failed least recently is forgotten first


@dataclass
class _Streak:
    failed: int = 0
    last_error: str = ""
    since: float = 0.0  # wall clock of the streak's first failure
    last: float = 0.0  # monotonic clock of its last failure


class FailingPeers:
    """Thread-safe: the connector records under its own lock, ``/health`` reads from its thread."""

    def __init__(self, threshold: int = FAILING_AFTER, window: float = FAILING_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.threshold, self.window, self.clock = threshold, window, clock
        self._lock = threading.Lock()
        self._streaks: collections.OrderedDict[str, _Streak] = collections.OrderedDict()

    def failed(self, peer: str, kind: FailureKind | None, reason: str, joined: bool) -> None:
        if kind not in ABOUT_THE_PEER or not (joined or kind in PEER_GONE):
            return
        with self._lock:
            streak = self._streaks.pop(peer, None) or _Streak(since=time.time())
            streak.failed += 1
            streak.last_error = reason[:300]
            streak.last = self.clock()
            self._streaks[peer] = streak
            while len(self._streaks) > MAX_PEERS:
                self._streaks.popitem(last=False)

    def succeeded(self, peer: str) -> None:
        with self._lock:
            self._streaks.pop(peer, None)

    def report(self) -> list[dict]:
        """``[{"peer", "rooms_failed_in_a_row", "since", "last_error"}]`` of the peers over the
        threshold whose last failure is within the window."""
        recent = self.clock() - self.window
        with self._lock:
            return [{"peer": peer, "rooms_failed_in_a_row": s.failed, "since": round(s.since, 3),
                     "last_error": s.last_error} for peer, s in self._streaks.items()
                    if s.failed >= self.threshold and s.last >= recent]


def health_status(sleeping: bool, failing: list[dict]) -> str:
    """A worker's ``/health`` status: ``sleeping``, ``degraded`` (a peer's rooms keep failing) or ``ok``."""
    return "sleeping" if sleeping else "degraded" if failing else "ok"
