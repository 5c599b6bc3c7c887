"""The Mooncake backend's completion handling: real engines over TCP on 127.0.0.1, with the
status or submit answer scripted where Mooncake cannot be made to give it on demand."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from connector import mooncake_transport
from connector.mooncake_transport import MooncakeTransport
from connector.transport import TransferError, WriteUnsettled

pytestmark = pytest.mark.fast

NBYTES = 8 << 20
TRANSFER_TIMEOUT_S = 1  # MC_TRANSFER_TIMEOUT of the links' sender
# the sender gives up on a write after its transfer timeout plus its size at the default --min-link-rate
GIVE_UP_S = TRANSFER_TIMEOUT_S + NBYTES / 50e6


class ScriptedEngine:
    """Mooncake's engine, except for the answers listed: those are given first, in order."""

    def __init__(self, engine, statuses: tuple[int, ...] = (), submit: int | None = None,
                 hold: threading.Event | None = None) -> None:
        self._engine, self._statuses, self._submit = engine, list(statuses), submit
        self.hold, self.polled = hold, threading.Event()  # while hold is clear: "still running"

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def transfer_check_status(self, batch: int) -> int:
        self.polled.set()
        if self.hold is not None and not self.hold.is_set():
            return 0
        return self._statuses.pop(0) if self._statuses else self._engine.transfer_check_status(batch)

    def transfer_submit_write(self, *args) -> int:
        return self._engine.transfer_submit_write(*args) if self._submit is None else self._submit


Link = tuple[MooncakeTransport, MooncakeTransport, np.ndarray, np.ndarray]


def _open_link() -> Link:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MC_TRANSFER_TIMEOUT", str(TRANSFER_TIMEOUT_S))
        src_side, dst_side = MooncakeTransport(), MooncakeTransport()
    src = np.random.default_rng(0).integers(0, 256, NBYTES, dtype=np.uint8)
    dst = np.zeros(NBYTES, np.uint8)
    src_side.register([(src.ctypes.data, src.nbytes)])
    dst_side.register([(dst.ctypes.data, dst.nbytes)])
    return src_side, dst_side, src, dst


def _close_link(opened: Link) -> None:
    opened[0].close()
    opened[1].close()


@pytest.fixture(scope="module")
def engines() -> Iterator[Link]:
    """One pair of engines for the module's tests (each release takes Mooncake up to a second)."""
    opened = _open_link()
    yield opened
    _close_link(opened)


@pytest.fixture
def link(engines: Link) -> Iterator[Link]:
    """The module's engines, the sender's answers scripted by the test and put back after it."""
    src_side, _, _, dst = engines
    engine = src_side._engine
    dst[:] = 0
    yield engines
    src_side._engine = engine


@pytest.fixture
def own_link() -> Iterator[Link]:
    """Engines of the test's own (it closes one)."""
    opened = _open_link()
    yield opened
    _close_link(opened)


def write(side: MooncakeTransport, peer: MooncakeTransport, src: np.ndarray, dst: np.ndarray) -> None:
    side.write(peer.session_id, [src.ctypes.data], [dst.ctypes.data], [src.nbytes])


def test_a_timed_out_status_is_polled_until_the_write_settles(link) -> None:
    src_side, dst_side, src, dst = link
    src_side._engine = ScriptedEngine(src_side._engine, statuses=(-2, -2, -2))
    write(src_side, dst_side, src, dst)  # -2 means "timeout fired, not settled": not a finished write
    assert hashlib.sha256(dst).digest() == hashlib.sha256(src).digest()


@pytest.mark.serial
def test_a_write_that_never_settles_fails_after_the_transfer_timeout(link) -> None:
    src_side, dst_side, src, dst = link
    engine = src_side._engine = ScriptedEngine(src_side._engine, hold=threading.Event())
    started = time.monotonic()
    with pytest.raises(WriteUnsettled, match=r"1 part\(s\) not settled after") as given_up:
        write(src_side, dst_side, src, dst)
    # at its give-up time: past it the write is looked at every millisecond at most, so the second
    # above it is only for the machine's scheduling
    assert GIVE_UP_S < time.monotonic() - started < GIVE_UP_S + 1.0
    # Given up on, but held: the caller is told when it settles (here: Mooncake answers again).
    assert not given_up.value.settled()
    engine.hold.set()
    assert given_up.value.settled()


@pytest.mark.parametrize("refusal", [0, 2**64 - 1])
def test_a_refused_submit_is_a_transfer_error(link, refusal: int) -> None:
    src_side, dst_side, src, dst = link
    src_side._engine = ScriptedEngine(src_side._engine, submit=refusal)
    with pytest.raises(TransferError, match="refused"):
        write(src_side, dst_side, src, dst)


def test_close_waits_for_the_write_under_way_and_then_refuses_new_ones(own_link) -> None:
    src_side, dst_side, src, dst = own_link
    engine = src_side._engine = ScriptedEngine(src_side._engine, hold=threading.Event())
    writer = threading.Thread(target=write, args=(src_side, dst_side, src, dst))
    writer.start()
    assert engine.polled.wait(10)
    closer = threading.Thread(target=src_side.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() released the engine under a running write"
    engine.hold.set()
    writer.join(10)
    closer.join(10)
    assert not closer.is_alive()
    assert hashlib.sha256(dst).digest() == hashlib.sha256(src).digest()
    with pytest.raises(TransferError, match="closed"):
        write(src_side, dst_side, src, dst)


@pytest.mark.parametrize("ceiling, logged", [("120000\n", True), ("1000\n", False), (None, False)])
def test_a_back_off_ceiling_above_a_second_is_logged_once_at_start(tmp_path, caplog, ceiling, logged: bool) -> None:
    """The host's ``net.ipv4.tcp_rto_max_ms`` (absent before Linux 6.15): above 1 s the worker
    says, at start, what it costs after a partition."""
    sysctl = tmp_path / "tcp_rto_max_ms"
    if ceiling is not None:
        sysctl.write_text(ceiling)
    with caplog.at_level(logging.INFO, logger="connector.mooncake_transport"):
        mooncake_transport.note_rto_max(sysctl)
    notes = [r.getMessage() for r in caplog.records if "tcp_rto_max_ms" in r.getMessage()]
    assert notes == (["net.ipv4.tcp_rto_max_ms is 120000: after a network partition, Mooncake's connections made "
                      "into it back off up to 120 s; 1000 is recommended on hosts whose links can be cut"]
                     if logged else [])
