"""Mooncake Transfer Engine backend (P2PHANDSHAKE metadata; TCP by default, RDMA when set).

All Mooncake specifics live here. Two completion strategies:

* ``poll`` (default): ``transfer_submit_write`` per contiguous range, a sleep for most of the
  time the write should take at the rate recent writes reached, then ``transfer_check_status``
  every 50 us, backing off only once the write is well overdue. Measured about 0.9x a plain
  socket on 2 cores (``scripts/bench_transfer.py --completion``); learning the rate instead of
  assuming a fixed optimistic one made 64 MiB writes 6 to 9% faster (fewer wake-ups beside
  Mooncake's threads), and a fine poll near the end instead of a growing one another 2 to 7%.
* ``sync``: one ``batch_transfer_sync_write``; Mooncake busy-spins a core until completion,
  which costs throughput when the machine has few cores.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from connector.transport import TransferError, Transport, WriteUnsettled

if TYPE_CHECKING:
    from connector.config import ConnectorConfig

log = logging.getLogger(__name__)

# A frozen peer must fail in seconds. MC_TCP_PROGRESS_TIMEOUT_SEC really tears the connection
# down; MC_TRANSFER_TIMEOUT alone returns -1 while the bytes keep flowing (research/mooncake.md §5).
MOONCAKE_ENV_DEFAULTS = {
    "MC_TCP_PROGRESS_TIMEOUT_SEC": "3",
    "MC_TRANSFER_TIMEOUT": "10",
    "MC_TCP_STATUS_TIMEOUT_SEC": "5",  # a peer that took the bytes but never acknowledges them
    "MC_LOG_LEVEL": "ERROR",
}
COMPLETIONS = ("poll", "sync")
_POLL_S = 50e-6  # between looks once the write is due: finishing late costs more than looking
_POLL_LATE_MAX_S = 1e-3  # a write past twice its expected time is looked at less and less often
# Before polling a write, sleep for this share of the time it should take at the rate recent
# large writes reached, so the poller wakes a few times per write instead of dozens and leaves
# the cores to Mooncake's I/O threads. Until a write was timed, assume a rate about twice what
# loopback TCP reaches here.
_SLEEP_SHARE = 0.9
_FIRST_RATE_BYTES_PER_S = 5e9
_RATE_SAMPLE_MIN_BYTES = 4 << 20  # smaller writes are dominated by fixed costs
_RATE_WEIGHT = 0.3  # of the newest sample in the moving average
_RATE_FLOOR = 0.5e9  # a burst of slow writes must not make the next one sleep long past its end
# Linux 6.15+: the ceiling of every TCP connection's retransmission back-off in this network
# namespace, Mooncake's own connections included (no option of ours reaches those).
_RTO_MAX_SYSCTL = Path("/proc/sys/net/ipv4/tcp_rto_max_ms")
RECOMMENDED_RTO_MAX_MS = 1000
# transfer_submit_write's failure value: 0 up to 0.3.13, (batch_id_t)-1 in later releases.
_SUBMIT_FAILED = (0, 2**64 - 1)


def note_rto_max(sysctl: Path = _RTO_MAX_SYSCTL) -> None:
    """Log, as a transport starts (one per worker), a back-off ceiling above the recommended one: after a partition a
    connect Mooncake made into the cut link holds up the peer's writes for up to it
    (docs/failure_bounds.md, "Partitions")."""
    try:
        ceiling_ms = int(sysctl.read_text())
    except (OSError, ValueError):  # an older kernel: it has no ceiling to set
        return
    if ceiling_ms > RECOMMENDED_RTO_MAX_MS:
        log.info("net.ipv4.tcp_rto_max_ms is %d: after a network partition, Mooncake's connections made into it "
                 "back off up to %.0f s; %d is recommended on hosts whose links can be cut", ceiling_ms,
                 ceiling_ms / 1000, RECOMMENDED_RTO_MAX_MS)


class MooncakeTransport(Transport):
    @classmethod
    def for_worker(cls, config: ConnectorConfig) -> MooncakeTransport:
        """The engine of a worker with ``config``, named by the address its peers reach it at."""
        return cls(config.public_host, config.protocol, config.ib_device, config.completion, config.min_link_rate)

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp", device: str = "",
                 completion: str = "poll", min_link_rate: float = 50e6) -> None:
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
        if protocol == "tcp":
            note_rto_max()
        self.completion = completion
        self._rate = _FIRST_RATE_BYTES_PER_S  # bytes/s the link gave recent large writes (moving average)
        # Mooncake's own timeouts settle every TCP write well within this plus its size at
        # min_link_rate; past it, something below us hangs and the write is reported failed
        # instead of waited on for ever.
        self._settle_timeout_s = float(os.environ["MC_TRANSFER_TIMEOUT"])
        self._min_link_rate = min_link_rate
        self._writes = 0  # writes under way: they share the link, and close() waits for them
        self._writes_changed = threading.Condition()
        self._held: list[_HeldParts] = []  # of writes given up on, not settled yet: close() waits for them too
        self._closed = False

    def shared_engine(self) -> object:
        return self._engine.get_engine()

    def register(self, regions: list[tuple[int, int]]) -> None:
        for addr, length in regions:
            if self._engine.register_memory(addr, length) != 0:
                raise RuntimeError(f"Mooncake register_memory({addr:#x}, {length}) failed")

    def unregister(self, addresses: list[int]) -> None:
        for addr in addresses:
            if self._engine.unregister_memory(addr) != 0:
                log.warning("Mooncake unregister_memory(%#x) failed", addr)

    def write(self, peer_session: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]) -> None:
        with self._writes_changed:
            if self._closed:
                raise TransferError("transport is closed")
            self._writes += 1
            sharing = self._writes
        try:
            if self.completion == "sync":
                rc = self._engine.batch_transfer_sync_write(peer_session, src_addrs, dst_addrs, lengths)
                if rc != 0:
                    raise TransferError(f"write of {sum(lengths)} bytes to {peer_session} failed (rc={rc})")
            else:
                self._submit_and_wait(peer_session, src_addrs, dst_addrs, lengths, sharing)
        finally:
            with self._writes_changed:
                self._writes -= 1
                self._writes_changed.notify_all()

    def _submit_and_wait(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int], sharing: int) -> None:
        start, nbytes = time.perf_counter(), sum(lens)
        pending: list[int] = []
        failures: list[str] = []
        try:
            for src, dst, length in zip(srcs, dsts, lens, strict=True):
                batch = self._engine.transfer_submit_write(peer, src, dst, length)
                if batch in _SUBMIT_FAILED:
                    failures.append(f"submit of {length} bytes at {dst:#x} refused")
                    break
                pending.append(batch)
        except Exception as exc:  # what was submitted before still has to settle below
            failures.append(f"submit raised {type(exc).__name__}: {exc}")
        expected = nbytes / self._rate
        if pending:
            # Alone on the link it cannot land sooner; beside other writes it lands later and
            # the poll covers the rest, so this never oversleeps a write that shares the link.
            time.sleep(_SLEEP_SHARE * expected)
        late_at = start + 2 * expected
        give_up_at = start + self._settle_timeout_s + nbytes / self._min_link_rate
        delay, polls = _POLL_S, 0
        # Every submitted write must settle before returning, even after a failure, so the
        # caller knows nothing of this call is still in flight.
        while pending:
            polls += 1
            still = []
            for batch in pending:
                rc = self._engine.transfer_check_status(batch)
                if rc in (0, -2):  # -2: Mooncake's timeout fired but the batch has not settled yet
                    still.append(batch)
                elif rc < 0:
                    failures.append(f"failed (rc={rc})")
            pending = still
            if pending:
                if time.perf_counter() > give_up_at:
                    held = _HeldParts(self._engine, pending)
                    with self._writes_changed:  # those settled meanwhile are dropped
                        self._held = [*(h for h in self._held if not h.settled()), held]
                    raise WriteUnsettled(f"write of {nbytes} bytes to {peer}: {len(pending)} part(s) not settled "
                                         f"after {time.perf_counter() - start:.1f}s", held.settled)
                time.sleep(delay)
                if time.perf_counter() > late_at:
                    delay = min(delay * 2, _POLL_LATE_MAX_S)
        if failures:
            raise TransferError(f"write of {nbytes} bytes to {peer}: {failures[0]}")
        if nbytes >= _RATE_SAMPLE_MIN_BYTES:
            # Writes that ran beside others got a share of the link: count the link's rate.
            shared = (sharing + self._writes) / 2
            self._learn_rate(nbytes * shared / (time.perf_counter() - start), overslept=polls == 1)

    def _learn_rate(self, sample: float, overslept: bool) -> None:
        if overslept:  # it had landed before the first look, so the sample is only a lower bound
            rate = max(self._rate, sample) * 1.5
        else:
            rate = self._rate + _RATE_WEIGHT * (sample - self._rate)
        self._rate = max(rate, _RATE_FLOOR)

    def close(self, timeout: float = 30.0, release: bool = True) -> None:
        """Refuse new writes, wait for those under way (their buffers are still being read),
        then release the engine (unless ``release`` is false: a process about to exit leaves it
        to the exit, which takes nothing; Mooncake's own release takes 0.5-1 s)."""
        with self._writes_changed:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + timeout
            while not self._all_settled():
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("closing with %d Mooncake write(s) still under way after %gs; the engine is "
                                "left to process exit", self._writes + len(self._held), timeout)
                    return
                self._writes_changed.wait(min(left, 0.1))  # held parts settle without a notify: look again
        if release:
            del self._engine

    def _all_settled(self) -> bool:
        self._held = [held for held in self._held if not held.settled()]
        return self._writes == 0 and not self._held


class _HeldParts:
    """The parts of a given-up write that Mooncake still holds (each a batch to look at until it settles)."""

    def __init__(self, engine, batches: list[int]) -> None:  # noqa: ANN001 (Mooncake's engine)
        self._engine, self._batches = engine, batches
        self._lock = threading.Lock()  # a settled batch is freed by Mooncake: never looked at twice

    def settled(self) -> bool:
        """Whether no part can land any more (each landed or failed)."""
        with self._lock:
            self._batches = [b for b in self._batches if self._engine.transfer_check_status(b) in (0, -2)]
            return not self._batches
