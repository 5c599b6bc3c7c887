"""Rejected control messages: a counter per reason, and logs that a flood cannot turn into a
full disk (at most ``burst`` lines per reason per ``window`` seconds, then one line saying how
many were left out)."""

from __future__ import annotations

import collections
import logging
import threading
import time

# Every reason a message can be rejected for; they are the metric's label values, so the set
# is fixed (a peer cannot make up new ones).
REASONS = (
    "malformed",  # does not decode
    "unauthenticated",  # the shared secret is on and the message's MAC is missing or wrong
    "unregistered_session",  # an init or resume from a session that never registered
    "not_owner",  # an abort, suspend or resume for a room the sender does not own
    "register_conflict",  # a register that would replace a busy session's pool with another
    "register_takeover",  # a register for an endpoint or session whose real owner answered the ping
    "register_limit",  # too many registered sessions, none idle
    "refused_round",  # an init or resume its sender owns but that cannot be served (geometry, blocks)
    "unknown_room",  # a status or ack for a room this side does not have
)


class Rejections:
    def __init__(self, logger: logging.Logger, window: float = 10.0, burst: int = 5) -> None:
        self._log, self._window, self._burst = logger, window, burst
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self._logged: dict[str, tuple[float, int, int]] = {}  # reason -> (window start, lines, left out)

    def reject(self, reason: str, detail: str, level: int = logging.WARNING) -> None:
        """Count one rejected message; log ``detail`` unless this reason logged enough lately."""
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            start, lines, left_out = self._logged.get(reason, (now, 0, 0))
            if now - start > self._window:
                if left_out:
                    self._log.log(level, "%d more messages rejected (%s) in the last %gs were not logged",
                                  left_out, reason, self._window)
                start, lines, left_out = now, 0, 0
            if lines < self._burst:
                self._log.log(level, "rejected message (%s): %s", reason, detail)
                lines += 1
            else:
                left_out += 1
            self._logged[reason] = (start, lines, left_out)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
