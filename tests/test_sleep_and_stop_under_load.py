"""An encoder that falls asleep, and either worker stopped with SIGTERM, while request pairs
are in flight: every request ends at once (result or clear error) on both sides, every block
comes back, and a worker restarted on the same ports serves at once. SGLang's encoder."""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sglang_stack import metric
from test_faults import wait_for
from test_workers import Pair, assert_pools_free
from transfer_large_image import make_image, run_request

from connector import ConnectorConfig
from harness.workers import WorkerProcess
from sglang_ext.launch_server import CLOSE_WAIT_S
from worker_infra.http import SHUTDOWN_GRACE_S

pytestmark = [pytest.mark.load, pytest.mark.serial]  # every request ends within a stated time

# 1 s heartbeats (test_faults_under_load's): 0.5 s probes missed while 8 pairs loaded the encoder on
# 2 cores, and a peer declared dead before the signal failed its rooms with 502 on both sides.
INTERVAL, MISSES = 1.0, 2
FAST_HEARTBEAT = ("--heartbeat-interval", str(INTERVAL), "--heartbeat-max-failure", str(MISSES))
SLACK = 1.5  # a loaded machine
# A stopped worker's handlers get SHUTDOWN_GRACE_S, the encoder's close CLOSE_WAIT_S, then it exits.
STOP_S = SHUTDOWN_GRACE_S + CLOSE_WAIT_S + SLACK
# The other side's half ends when the stopping worker tells it, or at the latest when its
# heartbeats find that worker gone (docs/failure_bounds.md: INTERVAL x (MISSES + 2)).
OTHER_SIDE_S = STOP_S + INTERVAL * (MISSES + 2)
# What a refused room's language half would wait for were it not told: its join timeout.
NOT_TOLD_S = ConnectorConfig.join_timeout
SIZES = [(3840, 2160), (1920, 1080), (1024, 768), (2048, 2048)]


@pytest.fixture(scope="module")
def model(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("stop-images")
    out = []
    for i, (w, h) in enumerate(SIZES):
        out.append(str(root / f"{w}x{h}.png"))
        make_image(w, h, seed=300 + i).save(out[-1])
    return out


def start_pairs(pair: Pair, paths: list[str], pool: ThreadPoolExecutor, count: int, seed: int) -> list:
    """``count`` request pairs, /encode or /generate first at random, up to 0.3 s apart."""
    rng = random.Random(seed)
    futures = []
    for i in range(count):
        room = next(pair.rooms)
        futures.append(pool.submit(run_request, pair.encode.url, pair.language.url, pair.encode.bootstrap_port,
                                   f"r{room}", room, [paths[i % len(paths)]], 60, encode_first=rng.random() < 0.5,
                                   gap=rng.uniform(0, 0.3)))
    return futures


def test_an_encoder_falling_asleep_with_8_pairs_in_flight_leaves_no_language_room_hanging(paths, model) -> None:
    pair = Pair(model_path=model)
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = start_pairs(pair, paths, pool, 8, seed=8)
            # The sleep comes once a forward pass is done: a request past it is kept over the sleep
            # (or done before it); one before it is refused. A fixed delay missed every forward pass
            # on a loaded machine.
            deadline = time.monotonic() + 60
            while not metric(pair.encode, 'epd_encoder_items_total{source="encoded"}'):
                assert time.monotonic() < deadline, "no forward pass in 60 s"
                time.sleep(0.02)
            reply = requests.post(f"{pair.encode.url}/sleep", params={"preserve_state": "true"}, timeout=60)
            assert reply.status_code == 200, reply.text
            time.sleep(2.0)
            assert requests.post(f"{pair.encode.url}/wake_up", timeout=60).status_code == 200
            results = [f.result() for f in futures]
        for r in results:
            if r["encode_status"] == 200:  # kept over the sleep, or done before it
                assert r["match"], r
                continue
            # Refused while asleep: the language half fails at once too, with the same 503 (told,
            # not left to its join timeout; the bound is halfway to it).
            assert r["encode_status"] == r["language_status"] == 503, r
            assert "asleep" in r["encode_error"] and "asleep" in r["language_error"], r
            assert r["language_done_at"] - r["encode_done_at"] < NOT_TOLD_S / 2, r
        assert sum(r["encode_status"] == 200 for r in results) >= 1
        assert_pools_free(pair)
        assert pair.request([paths[0]])["match"]
    finally:
        pair.stop()


def arrived(worker: WorkerProcess) -> int:
    """Requests that reached the worker: those it holds (an encode worker's between arrival and
    answer, a language worker's being resolved, queued or transferred) and those it answered."""
    health = requests.get(f"{worker.url}/health", timeout=10).json()
    held = health["pending"] if worker.mode == "encode" else health["resolving"] + health["queued"] + health["transferring"]
    return held + int(metric(worker, "epd_requests_total{"))  # any outcome


def aborted_after_delivery(encode: WorkerProcess, room: int, timeout: float = 5.0) -> bool:
    """Whether the encode worker logs (within ``timeout``) that the language side's abort of
    ``room`` came after the room's embedding was delivered."""
    line = f"room {room}: aborted by language peer"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(line in text and "after its embedding was delivered" in text for text in encode.log):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("side", ["encode", "language"])
def test_sigterm_under_load_ends_every_request_and_frees_the_ports(paths, model, side: str) -> None:
    pair = Pair(*FAST_HEARTBEAT, model_path=model)
    try:
        with ThreadPoolExecutor(9) as pool:  # a thread for each call: none waits for one
            # A request whose other half never comes: it is surely in flight at the signal.
            lonely = next(pair.rooms)
            idle = (pool.submit(requests.post, f"{pair.language.url}/generate", timeout=60, json={
                "rid": "generate-only", "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.encode.bootstrap_port,
                "bootstrap_room": lonely}) if side == "language" else
                pool.submit(requests.post, f"{pair.encode.url}/encode", timeout=60,
                            json={"rid": "encode-only", "bootstrap_room": lonely, "images": [paths[2]]}))
            worker = pair.language if side == "language" else pair.encode
            wait_for(lambda: arrived(worker) == 1, 30, "the lonely request at its worker")
            before = {w: arrived(w) for w in (pair.language, pair.encode)}
            futures = start_pairs(pair, paths, pool, 8, seed=21)
            # every pair's two halves sent (they go up to 0.3 s apart): none is sent after the signal
            wait_for(lambda: all(arrived(w) >= before[w] + 8 for w in before), 30, "both halves of every pair")
            signalled = time.monotonic()
            worker.proc.send_signal(signal.SIGTERM)
            assert worker.proc.wait(10) == 0
            exited = time.monotonic() - signalled
            results = [f.result() for f in futures]
            idle_result = idle.result()
        assert exited < STOP_S, f"the {side} worker took {exited:.1f}s to stop"
        stopped = "language" if side == "language" else "encode"
        for r in results:
            if r["match"]:
                continue
            status, error = r[f"{stopped}_status"], r[f"{stopped}_error"]
            # In flight at the signal: a 503 saying so; sent after it: no listener (status 0).
            assert status == 0 or (status == 503 and "shutting down" in error), r
            assert r[f"{stopped}_done_at"] - signalled < STOP_S, r
            other = "encode" if side == "language" else "language"
            # A room whose last round landed as the signal came: the encoder's 200 is true, and
            # either the language side's 503 says the embedding had arrived, or its abort reached
            # the encoder after the room had ended there (the status and the abort crossed).
            delivered = r[f"{other}_status"] == 200 and side == "language" and (
                "its embedding had arrived" in error or aborted_after_delivery(pair.encode, r["room"]))
            assert r[f"{other}_status"] != 200 or delivered, f"the {other} side finished a room the other gave up: {r}"
            assert r[f"{other}_done_at"] - signalled < OTHER_SIDE_S, r
        assert idle_result.status_code == 503 and idle_result.headers["Retry-After"] == "5"
        assert f"the {side} worker is shutting down" in idle_result.json()["error"]
        restarted = WorkerProcess(worker.mode, *FAST_HEARTBEAT, *(("--model-path", model) if side == "encode" else ()),
                                  port=worker.port, bootstrap_port=worker.bootstrap_port)
        if side == "language":
            pair.language = restarted
        else:
            pair.encode = restarted
        assert pair.request([paths[1]])["match"]
        assert_pools_free(pair)
    finally:
        for w in (pair.language, pair.encode):
            w.stop()
