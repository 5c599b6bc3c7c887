"""Workers and the store's master sharing a host: a second encode worker given the bootstrap port
of the first exits at once with one line naming the flag to set (it does not steal or share the
port), ``mooncake_master`` started as the docs start it listens only on the address it is given,
and a worker stops at once when the master has stopped answering."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from sglang_stack import encoder_health

from harness.workers import MooncakeMaster, WorkerProcess

FLAG = "--disaggregation-bootstrap-port"
# a worker's stop: halfway between its own (well under a second) and the store client's
# destructor's wait for a master that does not answer (16 s measured, with the GIL held)
STOP_BOUND_S = 8.0


def test_a_second_encode_worker_on_a_taken_bootstrap_port_exits_naming_the_flag() -> None:
    first = WorkerProcess("encode", fake_encoder=True)
    try:
        with pytest.raises(RuntimeError) as refused:
            WorkerProcess("encode", fake_encoder=True, bootstrap_port=first.bootstrap_port, timeout=60)
        message = str(refused.value)
        assert f"127.0.0.1:{first.bootstrap_port}" in message and "address already in use" in message.lower(), message
        assert f"each encode worker on a host needs its own {FLAG}" in message, message
        assert "Traceback" not in message, message
        assert first.proc.poll() is None  # the first one serves on
    finally:
        first.stop()


def test_the_master_listens_only_on_the_address_it_is_given(tmp_path) -> None:
    master = MooncakeMaster(tmp_path / "master.log", host="127.0.0.1")
    try:
        listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process(master.process.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", master.port) in listening and len(listening) >= 2, listening  # RPC and metrics
        assert {ip for ip, _ in listening} == {"127.0.0.1"}, listening
    finally:
        master.stop()


def test_an_encode_worker_stops_at_once_with_the_stores_master_frozen(tmp_path) -> None:
    """A master that stopped answering (frozen, or its host gone: no reset comes back) costs a
    stopping worker nothing: the store client, whose destructor waits on the master, is never
    destroyed (a stop waited 60 s and more before)."""
    master = MooncakeMaster(tmp_path / "master.log")
    encoder = WorkerProcess("encode", "--mm-global-cache-master", master.address, fake_encoder=True)
    try:
        assert encoder_health(encoder)["status"] in ("ok", "degraded")
        os.kill(master.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        encoder.stop(timeout=3 * STOP_BOUND_S)
        assert time.monotonic() - started < STOP_BOUND_S
    finally:
        encoder.stop()
        master.kill()
