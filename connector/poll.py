"""Room status values and the monotonic progress rule shared by both sides."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass


class KVPoll(enum.IntEnum):
    """SGLang's transfer status values (same numbers on the wire)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class TransferFailure(RuntimeError):
    """A room ended in ``Failed``; the message says why and names the peer where known."""


@dataclass(frozen=True)
class Progress:
    """Where a room stands: the status of the round that began at ``sent_tokens``."""

    status: KVPoll
    sent_tokens: int = 0

    @property
    def terminal(self) -> bool:
        return self.status in (KVPoll.Failed, KVPoll.Success)


class RoomState:
    """Thread-safe progress of one room.

    Progress only moves forward, ordered by ``(sent_tokens, status)``: a resume moves a room
    from ``Transferring`` back to ``WaitingForInput`` at a larger ``sent_tokens``, so rounds
    are told apart by ``sent_tokens`` and never by block ids. ``Failed`` always wins and is
    final; ``Success`` is final except that ``Failed`` may still replace it.
    """

    def __init__(self, status: KVPoll = KVPoll.Bootstrapping) -> None:
        self._lock = threading.Lock()
        self._progress = Progress(status)
        self._reason = ""

    @property
    def progress(self) -> Progress:
        return self._progress

    @property
    def status(self) -> KVPoll:
        return self._progress.status

    @property
    def reason(self) -> str:
        return self._reason

    def advance(self, status: KVPoll, sent_tokens: int | None = None) -> bool:
        """Move to ``status`` at ``sent_tokens`` (default: unchanged); False if it would go back."""
        with self._lock:
            current = self._progress
            if current.status == KVPoll.Failed:
                return False
            if status == KVPoll.Failed:
                return self._fail_locked("failed", sent_tokens)
            if current.status == KVPoll.Success:
                return False
            new = Progress(status, current.sent_tokens if sent_tokens is None else sent_tokens)
            if (new.sent_tokens, new.status) <= (current.sent_tokens, current.status):
                return False
            self._progress = new
            return True

    def fail(self, reason: str) -> bool:
        """Mark the room ``Failed`` with ``reason``; False if it already was."""
        with self._lock:
            if self._progress.status == KVPoll.Failed:
                return False
            return self._fail_locked(reason, None)

    def _fail_locked(self, reason: str, sent_tokens: int | None) -> bool:
        sent = self._progress.sent_tokens if sent_tokens is None else sent_tokens
        self._progress = Progress(KVPoll.Failed, sent)
        self._reason = reason
        return True
