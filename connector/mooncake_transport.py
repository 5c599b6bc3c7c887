"""Mooncake Transfer Engine backend (P2PHANDSHAKE metadata; TCP by default, RDMA when set).

All Mooncake specifics live here. Two completion strategies:

* ``poll`` (default): ``transfer_submit_write`` per contiguous range, then
  ``transfer_check_status`` with a short, growing sleep. Measured about 0.9x a plain socket
  on 2 cores (``scripts/bench_transfer.py --completion``).
* ``sync``: one ``batch_transfer_sync_write``; Mooncake busy-spins a core until completion,
  which costs throughput when the machine has few cores.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from connector.transport import TransferError, Transport

log = logging.getLogger(__name__)

# A frozen peer must fail in seconds. MC_TCP_PROGRESS_TIMEOUT_SEC really tears the connection
# down; MC_TRANSFER_TIMEOUT alone returns -1 while the bytes keep flowing (research/mooncake.md §5).
MOONCAKE_ENV_DEFAULTS = {
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "3",
    "MC_TRANSFER_TIMEOUT": "10",
    "MC_LOG_LEVEL": "ERROR",
}
COMPLETIONS = ("poll", "sync")
_POLL_MIN_S, _POLL_MAX_S = 50e-6, 0.5e-3
# Before polling a write, sleep for the time it takes at this rate (about twice what loopback
# TCP reaches here), so the poller does not steal the cores Mooncake's I/O threads need.
_OPTIMISTIC_BYTES_PER_S = 5e9


class MooncakeTransport(Transport):
    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
                 completion: str = "poll") -> None:
        if completion not in COMPLETIONS:
            raise ValueError(f"completion must be one of {COMPLETIONS}, got {completion!r}")
        for key, value in MOONCAKE_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(
                "the Mooncake transfer engine is not importable: install the 'mooncake' extra "
                "(mooncake-transfer-engine-non-cuda on CPU machines, plus Debian's libibverbs1)"
                f": {exc}") from exc
        self._engine = TransferEngine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise RuntimeError(f"Mooncake initialize({hostname!r}, protocol={protocol!r}, device={device!r}) returned {rc}")
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self.completion = completion
        self._closed = False
        self._lock = threading.Lock()  # guards close() against concurrent writes

    def register(self, regions: list[tuple[int, int]]) -> None:
        for addr, length in regions:
            if self._engine.register_memory(addr, length) != 0:
                raise RuntimeError(f"Mooncake register_memory({addr:#x}, {length}) failed")

    def unregister(self, addresses: list[int]) -> None:
        for addr in addresses:
            if self._engine.unregister_memory(addr) != 0:
                log.warning("Mooncake unregister_memory(%#x) failed", addr)

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        if self._closed:
            raise TransferError("transport is closed")
        if self.completion == "sync":
            rc = self._engine.batch_transfer_sync_write(peer_session, src_addrs, dst_addrs, lengths)
            if rc != 0:
                raise TransferError(f"write of {sum(lengths)} bytes to {peer_session} failed (rc={rc})")
            return
        self._write_polled(peer_session, src_addrs, dst_addrs, lengths)

    def _write_polled(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        pending: list[int] = []
        failures: list[str] = []
        for src, dst, length in zip(srcs, dsts, lens, strict=True):
            batch = self._engine.transfer_submit_write(peer, src, dst, length)
            if batch == 0:
                failures.append(f"submit of {length} bytes at {dst:#x} refused")
                break
            pending.append(batch)
        if pending:
            time.sleep(sum(lens) / _OPTIMISTIC_BYTES_PER_S)
        delay = _POLL_MIN_S
        # Every submitted write must settle before returning, even after a failure, so the
        # caller knows nothing of this call is still in flight.
        while pending:
            still = []
            for batch in pending:
                rc = self._engine.transfer_check_status(batch)
                if rc == 0:
                    still.append(batch)
                elif rc < 0:
                    failures.append("timed out" if rc == -2 else f"failed (rc={rc})")
            pending = still
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        if failures:
            raise TransferError(f"write of {sum(lens)} bytes to {peer}: {failures[0]}")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                del self._engine
