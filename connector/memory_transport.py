"""An in-process backend with the Mooncake backend's interface and failure behaviour.

Both peers live in one process (the fast test tier runs the encode side's sender manager
and the language side's receiver manager side by side): a write is a ``memmove`` from one
registered region into another, checked the way the transfer engine checks it. It is never
a way between processes; a session id names a transport of this process only.

What it keeps of Mooncake's behaviour, because the connector depends on it:

* a write returns once every byte has landed, or raises :class:`TransferError` having
  written nothing more after the raise;
* a write to an unknown, closed or broken peer, or to memory the peer has not registered
  (or has unregistered, e.g. while asleep), fails instead of landing anywhere;
* ``close`` refuses new writes and waits for the ones under way.

``break_link`` makes every write to a peer fail, as a dead peer does. ``link_bytes_per_s``
makes a write take the time a link of that rate would, so that what overlaps with a write on
a real link (the early resume of a second round, a sleep that lands mid-write) overlaps here.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time

from connector.transport import TransferError, Transport

# Session ids look like Mooncake's (``host:port``), so the wire messages carry them unchanged;
# the port is a counter, unique in this process, and nothing listens on it.
_ports = itertools.count(40_000)
_live: dict[str, MemoryTransport] = {}
_live_lock = threading.Lock()


class MemoryTransport(Transport):
    def __init__(self, hostname: str = "127.0.0.1", link_bytes_per_s: float | None = None) -> None:
        self.session_id = f"{hostname}:{next(_ports)}"
        self._link_bytes_per_s = link_bytes_per_s
        self._regions: dict[int, int] = {}  # registered address -> length
        self._broken: set[str] = set()  # peer sessions whose writes fail
        self._writes = 0
        self._changed = threading.Condition()
        self._closed = False
        with _live_lock:
            _live[self.session_id] = self

    def register(self, regions: list[tuple[int, int]]) -> None:
        with self._changed:
            for addr, length in regions:
                if length <= 0:
                    raise RuntimeError(f"register_memory({addr:#x}, {length}) refused: empty region")
                self._regions[addr] = length

    def unregister(self, addresses: list[int]) -> None:
        with self._changed:
            for addr in addresses:
                self._regions.pop(addr, None)

    def break_link(self, peer_session: str) -> None:
        """From now on, every write to ``peer_session`` fails (a peer that died)."""
        with self._changed:
            self._broken.add(peer_session)

    def _covers(self, addr: int, length: int) -> bool:
        return any(base <= addr and addr + length <= base + size for base, size in self._regions.items())

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        with self._changed:
            if self._closed:
                raise TransferError("transport is closed")
            broken = peer_session in self._broken
            self._writes += 1
        try:
            with _live_lock:
                peer = _live.get(peer_session)
            if peer is None or broken:
                raise TransferError(f"write of {sum(lengths)} bytes to {peer_session}: peer unreachable")
            for src, dst, length in zip(src_addrs, dst_addrs, lengths, strict=True):
                with self._changed:
                    if not self._covers(src, length):
                        raise TransferError(f"source {src:#x}+{length} is not registered memory")
                if self._link_bytes_per_s:
                    time.sleep(length / self._link_bytes_per_s)
                # The peer's regions are checked and written under its lock, so an unregister
                # (a pool released for a sleep) never races a write into the freed memory.
                with peer._changed:
                    if peer._closed or not peer._covers(dst, length):
                        raise TransferError(f"write of {length} bytes at {dst:#x} to {peer_session}: "
                                            "not registered by the peer")
                    ctypes.memmove(dst, src, length)
        finally:
            with self._changed:
                self._writes -= 1
                self._changed.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        with self._changed:
            if self._closed:
                return
            self._closed = True
            self._changed.wait_for(lambda: self._writes == 0, timeout)
        with _live_lock:
            _live.pop(self.session_id, None)
