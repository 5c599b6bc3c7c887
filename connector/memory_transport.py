"""An in-process backend with the Mooncake backend's interface and failure behaviour.

Both peers live in one process (the fast test tier runs the encode side's sender manager
and the language side's receiver manager side by side): a write is a ``memmove`` from one
registered region into another, checked the way the transfer engine checks it. It is never
a way between processes; a session id names a transport of this process only.

What it keeps of Mooncake's behaviour, because the connector depends on it:

* a write returns once every byte has landed, or raises :class:`TransferError`;
* a write to an unknown or closed peer, or to memory the peer has not registered (or has
  unregistered, e.g. while asleep), fails instead of landing anywhere: checked when it is
  submitted and again, with the source, under one lock at the moment of the copy, so a region
  released meanwhile is never read or written;
* ``close`` refuses new writes and waits for the ones under way.

``link_bytes_per_s`` makes a write take the time a link of that rate would, so what overlaps
with one write on a real link (the early resume of a second round, a sleep landing mid-write)
overlaps here. Concurrent writes each get the whole rate (a loose model: Mooncake shares the
link), and a dead peer fails a write at once (Mooncake takes its progress timeout).
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
# Taken for every registry change and every copy: one lock, so no two transports' locks nest.
_lock = threading.Lock()


class MemoryTransport(Transport):
    def __init__(self, hostname: str = "127.0.0.1", link_bytes_per_s: float | None = None) -> None:
        self.session_id = f"{hostname}:{next(_ports)}"
        self._link_bytes_per_s = link_bytes_per_s
        self._regions: dict[int, int] = {}  # registered address -> length
        self._writes = 0
        self._writes_changed = threading.Condition(_lock)
        self._closed = False
        with _lock:
            _live[self.session_id] = self

    def register(self, regions: list[tuple[int, int]]) -> None:
        with _lock:
            for addr, length in regions:
                if length <= 0:
                    raise RuntimeError(f"register_memory({addr:#x}, {length}) refused: empty region")
                self._regions[addr] = length

    def unregister(self, addresses: list[int]) -> None:
        with _lock:
            for addr in addresses:
                self._regions.pop(addr, None)

    def _covers(self, addr: int, length: int) -> bool:
        return any(base <= addr and addr + length <= base + size for base, size in self._regions.items())

    def _check(self, peer_session: str, ranges: list[tuple[int, int, int]]) -> None:
        """Raise unless every ``(src, dst, length)`` range can be written now; ``_lock`` held."""
        peer = _live.get(peer_session)
        for src, dst, length in ranges:
            if peer is None or peer._closed:
                why = f"peer {peer_session} unreachable"
            elif not self._covers(src, length):
                why = f"source {src:#x}+{length} is not registered memory"
            elif not peer._covers(dst, length):
                why = f"{length} bytes at {dst:#x} are not registered by {peer_session}"
            else:
                continue
            raise TransferError(f"write of {sum(r[2] for r in ranges)} bytes to {peer_session}: {why}")

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        ranges = list(zip(src_addrs, dst_addrs, lengths, strict=True))
        with _lock:
            if self._closed:
                raise TransferError("transport is closed")
            self._check(peer_session, ranges)  # as Mooncake refuses at submit
            self._writes += 1
        try:
            if self._link_bytes_per_s:
                time.sleep(sum(lengths) / self._link_bytes_per_s)
            with _lock:  # again at the copy: a region released meanwhile is never touched
                self._check(peer_session, ranges)
                for src, dst, length in ranges:
                    ctypes.memmove(dst, src, length)
        finally:
            with _lock:
                self._writes -= 1
                self._writes_changed.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        with _lock:
            if self._closed:
                return
            self._closed = True
            self._writes_changed.wait_for(lambda: self._writes == 0, timeout)
            _live.pop(self.session_id, None)
