"""The byte mover behind the connector: a small interface, one implementation per backend."""

from __future__ import annotations

import abc
from collections.abc import Callable


class TransferError(RuntimeError):
    """A write that did not complete; destination bytes are undefined afterwards."""


class WriteUnsettled(TransferError):
    """A write given up on while the engine still holds parts of it: they may still land (a
    connect into a cut link that succeeds once it heals). Until ``settled()`` returns True its
    source must stay as it is and its destination must not be given to anyone else."""

    def __init__(self, message: str, settled: Callable[[], bool]) -> None:
        super().__init__(message)
        self.settled = settled


class Transport(abc.ABC):
    """Moves bytes from local registered memory into a peer's registered memory.

    ``write`` returns only when every byte has landed (the peer acknowledged) or raises
    :class:`TransferError`; in both cases nothing of that call is still in flight, except after
    :class:`WriteUnsettled`, whose ``settled`` says when that is so.
    """

    session_id: str

    @abc.abstractmethod
    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register ``(address, length)`` regions so peers may write into them."""

    @abc.abstractmethod
    def unregister(self, addresses: list[int]) -> None:
        """Withdraw regions registered earlier."""

    @abc.abstractmethod
    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        """Write each ``src -> dst`` range to ``peer_session``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine; the object is unusable afterwards."""

    def shared_engine(self) -> object | None:
        """The engine itself, for a Mooncake Store client in the same process to move its bytes
        with (one engine per process: its ports, its threads); None where there is none to share."""
        return None
