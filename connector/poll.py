"""Room status values and the monotonic progress rule shared by both sides."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass

from connector.failures import FailureKind, TransferFailure


class KVPoll(enum.IntEnum):
    """SGLang's transfer status values (same numbers on the wire)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


@dataclass(frozen=True)
class Progress:
    """Where a room stands: the status of the round that began at ``sent_tokens``."""

    status: KVPoll
    sent_tokens: int = 0

    @property
    def terminal(self) -> bool:
        return self.status in (KVPoll.Failed, KVPoll.Success)


class RoomState:
    """Thread-safe progress of one room, as the wire sees it.

    Progress only moves forward, ordered by ``(sent_tokens, status)``: a resume moves a room
    from ``Transferring`` back to ``WaitingForInput`` at a larger ``sent_tokens``, so rounds
    are told apart by ``sent_tokens`` and never by block ids. ``Failed`` always wins and is
    final; ``Success`` is final except that ``Failed`` may still replace it.
    """

    def __init__(self, status: KVPoll = KVPoll.Bootstrapping) -> None:
        self._lock = threading.Lock()
        self._progress = Progress(status)
        self._kind: FailureKind | None = None
        self._reason = ""
        self._by_peer = False

    @property
    def progress(self) -> Progress:
        return self._progress

    @property
    def status(self) -> KVPoll:
        return self._progress.status

    @property
    def reason(self) -> str:
        return self._reason

    @property
    def kind(self) -> FailureKind | None:
        return self._kind

    def advance(self, status: KVPoll, sent_tokens: int | None = None) -> bool:
        """Move to ``status`` (not ``Failed``: see :meth:`fail`) at ``sent_tokens`` (default:
        unchanged); False if it would go back."""
        assert status != KVPoll.Failed, "use fail() to fail a room"
        with self._lock:
            current = self._progress
            if current.terminal:
                return False
            new = Progress(status, current.sent_tokens if sent_tokens is None else sent_tokens)
            if (new.sent_tokens, new.status) <= (current.sent_tokens, current.status):
                return False
            self._progress = new
            return True

    def fail(self, kind: FailureKind, reason: str, by_peer: bool = False) -> bool:
        """Mark the room ``Failed`` (``by_peer``: the other side said so); False if it already was."""
        with self._lock:
            if self._progress.status == KVPoll.Failed:
                return False
            self._progress = Progress(KVPoll.Failed, self._progress.sent_tokens)
            self._kind, self._reason, self._by_peer = kind, reason, by_peer
            return True

    def failure(self, room: int) -> TransferFailure:
        assert self._kind is not None
        return TransferFailure(self._kind, f"room {room}: {self._kind.value}: {self._reason}", self._by_peer)
