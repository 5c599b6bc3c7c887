"""The byte mover behind the connector: a small interface, one implementation per backend."""

from __future__ import annotations

import abc


class TransferError(RuntimeError):
    """A write that did not complete; destination bytes are undefined afterwards."""


class Transport(abc.ABC):
    """Moves bytes from local registered memory into a peer's registered memory.

    ``write`` returns only when every byte has landed (the peer acknowledged) or raises
    :class:`TransferError`; in both cases nothing of that call is still in flight.
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
