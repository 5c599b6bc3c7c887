"""Why a request or room failed: one enum, mapped once to an HTTP status, ``Retry-After``, a
metric label and the wire's reason prefix. Every error a worker answers carries one
(:class:`TransferFailure`, ``worker_infra.http.HTTPError``, the language side's refusals).

A failure travels between the workers as the reason frame of a ``Failed`` status, written
``"<kind>: <message>"``, so the other side fails its half of the request with the same kind (an
encode refused for being over capacity becomes a 503 with ``Retry-After`` on the language
side too). A reason without a known kind prefix (a fork peer's, or none) reads as
``PEER_FAILED``.
"""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    """``value`` is the metric label and the wire prefix."""

    BAD_REQUEST = "bad_request"  # the request itself is invalid
    UNAUTHORIZED = "unauthorized"  # an admin route without the admin API key
    FORBIDDEN = "forbidden"  # names a host this worker may not contact
    BAD_CHECKPOINT = "bad_checkpoint"  # a wake-up refused its checkpoint: nothing was loaded
    TOO_LARGE = "too_large"  # the embedding cannot fit a pool, ever
    CONFLICT = "conflict"  # rid or room already in use
    OVERLOADED = "overloaded"  # over a queue, staging or pool bound: retry later
    ASLEEP = "asleep"  # the worker sleeps (or fell asleep without keeping requests)
    SHUTTING_DOWN = "shutting_down"
    CANCELLED = "cancelled"  # the client went away or aborted the request
    ABORTED = "aborted"  # the other side aborted the room
    PEER_DEAD = "peer_dead"  # heartbeats or pings unanswered
    PEER_UNREACHABLE = "peer_unreachable"  # route lookup or control message failed
    UNAVAILABLE = "unavailable"  # no peer answers its liveness checks (all dead or cut off): retry later
    PEER_FAILED = "peer_failed"  # the other side failed the room for a reason of its own
    MISMATCH = "mismatch"  # pool geometry differs between the peers
    PROTOCOL = "protocol"  # a malformed or inconsistent message
    TRANSFER = "transfer"  # a write did not land
    TIMEOUT = "timeout"
    INTERNAL = "internal"

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS.get(self, 502)

    @property
    def retry_after(self) -> str | None:
        """``Retry-After`` seconds for failures that a later retry can fix."""
        return _RETRY_AFTER.get(self)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": self.retry_after} if self.retry_after else {}

    @classmethod
    def answered(cls, status: int) -> FailureKind:
        """The kind of a peer's answer with ``status`` (another worker's refusal): the first
        kind that answers it, else bad request for any other 4xx and a peer failure for the rest."""
        for kind, mapped in _HTTP_STATUS.items():
            if mapped == status:
                return kind
        return cls.BAD_REQUEST if 400 <= status < 500 else cls.PEER_FAILED


_HTTP_STATUS = {
    FailureKind.BAD_REQUEST: 400,
    FailureKind.UNAUTHORIZED: 401,
    FailureKind.FORBIDDEN: 403,
    FailureKind.BAD_CHECKPOINT: 422,
    FailureKind.TOO_LARGE: 413,
    FailureKind.CONFLICT: 409,
    FailureKind.OVERLOADED: 503,
    FailureKind.ASLEEP: 503,
    FailureKind.SHUTTING_DOWN: 503,
    FailureKind.UNAVAILABLE: 503,
    FailureKind.CANCELLED: 499,
    FailureKind.TIMEOUT: 504,
    FailureKind.INTERNAL: 500,
}

_RETRY_AFTER = {FailureKind.OVERLOADED: "2", FailureKind.ASLEEP: "5", FailureKind.SHUTTING_DOWN: "5",
                FailureKind.UNAVAILABLE: "5"}

# Kinds the other side passes on as they are: they describe the request, not the peer.
_PASSED_ON = {FailureKind.BAD_REQUEST, FailureKind.TOO_LARGE, FailureKind.OVERLOADED, FailureKind.ASLEEP,
              FailureKind.SHUTTING_DOWN, FailureKind.MISMATCH, FailureKind.TIMEOUT}


class TransferFailure(RuntimeError):
    """A room or request that ended in failure; ``kind`` says why, the message names the peer;
    ``by_peer``: the other side failed the room (its kind passed on), not this one."""

    def __init__(self, kind: FailureKind, message: str, by_peer: bool = False) -> None:
        super().__init__(message)
        self.kind, self.by_peer = kind, by_peer


def wire_reason(kind: FailureKind, message: str) -> str:
    """The reason frame of a ``Failed`` status."""
    return f"{kind.value}: {message}"


def parse_wire_reason(text: str) -> tuple[FailureKind, str]:
    """``(kind, message)`` of a peer's reason frame, as this side should fail its half.

    Kinds about the request (over capacity, too large, ...) are kept; any other reason means
    the peer failed the room for its own reasons.
    """
    head, sep, rest = text.partition(": ")
    try:
        kind = FailureKind(head) if sep else None
    except ValueError:
        kind = None
    if kind is None:
        return FailureKind.PEER_FAILED, text or "no reason given"
    return (kind if kind in _PASSED_ON else FailureKind.PEER_FAILED), rest
