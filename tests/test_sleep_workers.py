"""Sleep and wake of real worker processes (SGLang's encoder) while real transfers run."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from test_faults import wait_for
from test_workers import Pair, assert_pools_free, images  # noqa: F401  (fixture)
from transfer_large_image import make_image, run_request

from connector.poll import KVPoll
from connector.receiver import EmbeddingReceiver, finish_receiving
from harness.workers import WorkerProcess, start_together

QUEUE = ("--queue-while-sleeping",)


def sleep_(worker, level=1, preserve=True, timeout=120) -> dict:
    resp = requests.post(f"{worker.url}/sleep", params={"level": level, "preserve_state": str(preserve).lower()},
                         timeout=timeout)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wake(worker, timeout=120, **params) -> requests.Response:
    return requests.post(f"{worker.url}/wake_up", params=params, timeout=timeout)


def rooms_at(encode) -> int:
    return requests.get(f"{encode.url}/health", timeout=10).json()["active_rooms"]


def wait_inited(language, encode, rooms_before: int = 0) -> None:
    """Until the language worker's one request is transferring and its init has reached the
    encoder (one more room open there than ``rooms_before``): the room is open on both sides."""
    def inited() -> bool:
        transferring = requests.get(f"{language.url}/health", timeout=10).json()["transferring"]
        return transferring == 1 and rooms_at(encode) > rooms_before

    wait_for(inited, 30, "the request's init at the encoder")


@pytest.fixture(scope="module")
def model(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def pair(model):
    p = Pair(*QUEUE, model_path=model, language_args=("--embedding-cache-buffer-size", "96", "--embedding-default-allocate-buffer-size",
                                     "4096"))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def reference(pair, images) -> dict[str, str]:  # noqa: F811
    """Digests of an uninterrupted run."""
    out = {}
    for name in ("4k", "2k", "small"):
        res = pair.request([images[name]])
        assert res["match"]
        out[name] = res["sha256"]
    return out


def request_async(pair, pool, paths, rid=None):
    return pool.submit(pair.request, paths, rid)


# Each moment (before init/encode, while encoding, mid-transfer, later) on each side; the level
# alternates so that every (side, level) and (moment, level) pair comes once too: all pairs of the
# three settings in 8 runs instead of 16.
PAIRWISE = [(moment, side, 1 + (i + (side == "encode")) % 2)
            for i, moment in enumerate([0.0, 0.4, 1.2, 2.5]) for side in ("language", "encode")]


@pytest.mark.parametrize("moment, side, level", PAIRWISE)
def test_preserved_requests_finish_bit_identical_after_wake(pair, images, reference, side, level, moment) -> None:  # noqa: F811
    worker = pair.language if side == "language" else pair.encode
    with ThreadPoolExecutor(3) as pool:
        if moment == 0.0:
            sleep_(worker, level, True)
        running = [request_async(pair, pool, [images["4k"]]), request_async(pair, pool, [images["2k"]])]
        if moment:
            time.sleep(moment)
            sleep_(worker, level, True)
        time.sleep(0.5)
        assert requests.get(f"{worker.url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        assert wake(worker).status_code == 200
        results = [f.result() for f in running]
    assert [r.get("sha256") for r in results] == [reference["4k"], reference["2k"]], [str(r) for r in results]
    assert all(r["match"] for r in results)
    assert_pools_free(pair)


@pytest.mark.parametrize("side", ["language", "encode"])
def test_without_preserve_state_requests_fail_clearly_and_blocks_come_back(pair, images, side) -> None:  # noqa: F811
    worker = pair.language if side == "language" else pair.encode
    room = next(pair.rooms)
    body = {"rid": f"np-{side}", "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.encode.bootstrap_port,
            "bootstrap_room": room}
    rooms_before = rooms_at(pair.encode)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(requests.post, f"{pair.language.url}/generate", json=body, timeout=60)
        wait_inited(pair.language, pair.encode, rooms_before)
        sleep_(worker, 2, False)
        resp = pending.result()
    assert resp.status_code == 503 and resp.headers["Retry-After"] == "5"  # either side: retry later
    assert "went to sleep (preserve_state=false)" in resp.json()["error"]
    assert wake(worker).status_code == 200
    enc = requests.post(f"{pair.encode.url}/encode", json={"rid": body["rid"], "bootstrap_room": room,
                                                          "images": [images["small"]]}, timeout=60)
    # The room ended on both sides: its encode fails at once with the reason, nothing is encoded.
    words = "aborted by language peer" if side == "language" else "went to sleep (preserve_state=false)"
    assert enc.status_code in (502, 503) and words in enc.json()["error"], enc.text
    assert_pools_free(pair)


def test_requests_arriving_while_asleep_get_503_with_retry_after(model, images) -> None:  # noqa: F811
    pair = Pair(model_path=model)
    try:
        sleep_(pair.language)
        resp = requests.post(f"{pair.language.url}/generate", timeout=10, json={
            "rid": "late", "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.encode.bootstrap_port,
            "bootstrap_room": 5})
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "5"
        assert "asleep" in resp.json()["error"]
        sleep_(pair.encode)
        resp = requests.post(f"{pair.encode.url}/encode", json={"rid": "late", "bootstrap_room": 5,
                                                               "images": [images["small"]]}, timeout=10)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "5"
        assert wake(pair.language).status_code == 200 and wake(pair.encode).status_code == 200
        assert pair.request([images["small"]])["match"]
    finally:
        pair.stop()


def test_queue_while_sleeping_holds_requests_until_wake(pair, images, reference) -> None:  # noqa: F811
    sleep_(pair.language)
    sleep_(pair.encode)
    with ThreadPoolExecutor(1) as pool:
        pending = request_async(pair, pool, [images["small"]])
        time.sleep(1.0)
        assert not pending.done()
        wake(pair.encode)
        wake(pair.language)
        assert pending.result()["sha256"] == reference["small"]


def test_sleep_and_wake_are_serialised_and_repeats_are_no_ops(pair) -> None:
    with ThreadPoolExecutor(4) as pool:
        sleeps = list(pool.map(lambda _: sleep_(pair.language), range(4)))
        assert sum(s["changed"] for s in sleeps) == 1
        wakes = list(pool.map(lambda _: wake(pair.language).json(), range(4)))
        assert sum(w["changed"] for w in wakes) == 1
    assert requests.get(f"{pair.language.url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    assert wake(pair.language).json() == {"changed": False, "is_sleeping": False}
    text = requests.get(f"{pair.language.url}/metrics", timeout=10).text
    assert re.search(r'epd_wakes_total\{role="language"\} [1-9]', text)
    assert re.search(r'epd_sleeps_total\{level="1",preserve_state="true",role="language"\} [1-9]', text)


def test_bad_sleep_parameters_are_refused(pair) -> None:
    resp = requests.post(f"{pair.language.url}/sleep", params={"level": 3}, timeout=10)
    assert resp.status_code == 400 and "level must be 1 or 2" in resp.json()["error"]
    resp = requests.post(f"{pair.encode.url}/sleep", params={"preserve_state": "maybe"}, timeout=10)
    assert resp.status_code == 400 and "preserve_state must be true or false" in resp.json()["error"]
    assert requests.get(f"{pair.encode.url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}


def test_restart_from_checkpoint_dir_continues_the_transfers(model, images, reference, tmp_path: Path) -> None:  # noqa: F811
    ckpt = str(tmp_path / "ckpt")
    encode, language = start_together(lambda: WorkerProcess("encode", *QUEUE, "--model-path", model),
                                      lambda: WorkerProcess("language", "--checkpoint-dir", ckpt))
    try:
        body = {"rid": "keep", "bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port,
                "bootstrap_room": 9090}
        with ThreadPoolExecutor(1) as pool:
            pool.submit(requests.post, f"{language.url}/generate", json=body, timeout=60)
            wait_inited(language, encode)  # nothing sent yet: the encoder has no image for the room
            kept = sleep_(language)
            assert kept["kept_requests"] == 1 and kept["kept_bytes"] > 0
            os.kill(language.proc.pid, signal.SIGKILL)  # its client's connection drops with it
            language.proc.wait()
        assert {p.name for p in Path(ckpt).iterdir()} == {"language.json", "language.safetensors", "language.sha256"}
        language = WorkerProcess("language", "--checkpoint-dir", ckpt)
        assert "asleep: a checkpoint waits" in language.ready_line
        assert requests.get(f"{language.url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        woke = wake(language).json()
        assert woke["restored_requests"] == 1
        with ThreadPoolExecutor(1) as pool:
            attached = pool.submit(requests.post, f"{language.url}/generate", json=body, timeout=120)
            enc = requests.post(f"{encode.url}/encode", json={"rid": "keep", "bootstrap_room": 9090,
                                                              "images": [images["4k"]]}, timeout=120)
            result = attached.result().json()
        assert enc.json()["sha256"] == result["sha256"] == reference["4k"]
        assert not any(Path(ckpt).iterdir())  # consumed
    finally:
        language.stop()
        encode.stop()


def test_corrupt_truncated_or_mismatched_checkpoints_are_refused_whole(model, images, tmp_path: Path) -> None:  # noqa: F811
    ckpt = tmp_path / "ckpt"
    encode, language = start_together(lambda: WorkerProcess("encode", *QUEUE, "--model-path", model),
                                      lambda: WorkerProcess("language", "--checkpoint-dir", str(ckpt)))
    body = {"rid": "c", "bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port, "bootstrap_room": 31}
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(requests.post, f"{language.url}/generate", json=body, timeout=60)
            wait_inited(language, encode)
            sleep_(language)
            language.stop()
        good = {p.name: p.read_bytes() for p in ckpt.iterdir()}

        def refused(words: str) -> None:
            resp = wake(language)
            assert resp.status_code == 422 and words in resp.json()["error"], resp.text
            health = requests.get(f"{language.url}/health", timeout=10).json()
            assert health["state"] == "asleep" and health["transferring"] == 0 and health["queued"] == 0

        # two workers booted asleep on the folder at once: one that does not match it, and one
        # whose wake-ups each read the folder again, so a refused one can be retried once the
        # files are put right (here: damaged otherwise)
        language, other = start_together(
            lambda: WorkerProcess("language", "--checkpoint-dir", str(ckpt), "--hidden-size", "1024"),
            lambda: WorkerProcess("language", "--checkpoint-dir", str(ckpt)))
        refused("hidden_size=3584; this worker has hidden_size=1024")
        language.stop()
        language = other
        for name, damage, words in [
                ("language.safetensors", lambda b: b[:-1] + bytes([b[-1] ^ 1]), "corrupt or truncated"),
                ("language.json", lambda b: b[: len(b) // 2], "corrupt or truncated"),
                ("language.sha256", None, "language.sha256 is missing")]:
            for fname, data in good.items():
                (ckpt / fname).write_bytes(data)
            if damage:
                (ckpt / name).write_bytes(damage(good[name]))
            else:
                (ckpt / name).unlink()
            refused(words)
        assert wake(language, discard_checkpoint="true").json()["restored_requests"] == 0
        assert not any(ckpt.iterdir())
    finally:
        language.stop()
        encode.stop()


@pytest.mark.soak
def test_soak_4_sleep_wake_cycles_while_8_requests_flow(model, tmp_path: Path) -> None:
    """Level 1 and level 2 at random on either worker while 8 flows of 448x448 to 4K images run:
    every request matches. (A level-2 wake-up reloads SGLang's encoder's weights from disk: about
    4 s a cycle here, so 4 cycles.)"""
    paths = []
    for i, (w, h) in enumerate([(448, 448), (1024, 768), (2048, 2048), (3840, 2160)] * 2):
        paths.append(str(tmp_path / f"{i}.png"))
        make_image(w, h, seed=i).save(paths[-1])
    first_round = 2048  # tokens: the language side's default allocation, before a request's size is known
    pair = Pair(*QUEUE, model_path=model, language_args=("--embedding-cache-buffer-size", "120",
                                                             "--embedding-default-allocate-buffer-size", str(first_round)))
    rng = random.Random(50)
    stop, errors, done = threading.Event(), [], []
    rooms = iter(range(10**6, 10**7))
    lock = threading.Lock()

    def flow(path: str) -> None:
        while not stop.is_set():
            with lock:
                room = next(rooms)
            res = run_request(pair.encode.url, pair.language.url, pair.encode.bootstrap_port, f"s{room}", room,
                              [path], 300)
            (done if res["match"] else errors).append(res)

    start = time.monotonic()
    try:
        with ThreadPoolExecutor(len(paths)) as pool:
            flows = [pool.submit(flow, p) for p in paths]
            for _ in range(4):
                worker = rng.choice([pair.encode, pair.language])
                time.sleep(rng.uniform(0.0, 0.4))
                sleep_(worker, rng.choice([1, 2]), True)
                time.sleep(rng.uniform(0.0, 0.2))
                assert wake(worker).status_code == 200
            stop.set()
            for f in flows:
                f.result()
        wall = time.monotonic() - start
        print(f"\nsoak: 4 sleep/wake cycles, {len(done)} requests matched, {len(errors)} failed, {wall:.1f}s")
        assert not errors, errors[:3]
        assert len(done) >= len(paths)
        # the 2048x2048 and 4K flows' requests are larger than the first round: each needed 2+ rounds
        larger = [r for r in done if r["tokens"] > first_round]
        assert larger and all(r["resume_rounds"] >= 1 for r in larger), [(r["tokens"], r["resume_rounds"]) for r in larger]
        assert_pools_free(pair)
    finally:
        stop.set()
        pair.stop()


def test_encode_restart_from_checkpoint_dir_continues_rooms_in_every_phase(model, make_language, images,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    """Encoder asleep with a checkpoint, killed, restarted on the same folder and woken: rooms that
    were between rounds, resumed while it slept, inited while it slept, or never inited all finish
    with the bytes it encoded, and the language side kept them alive while no process answered."""
    ckpt = tmp_path / "encode-ckpt"
    args = ("--model-path", model, "--checkpoint-dir", str(ckpt))
    encode = WorkerProcess("encode", *args)
    # 1 s, not less: the encoder writing its checkpoint under a loaded test run can miss a 0.5 s
    # health deadline twice, which would (rightly) declare it dead before it is asleep on disk.
    lang = make_language(num_blocks=400, heartbeat_interval=1.0)
    m, addr = lang.manager, f"127.0.0.1:{encode.bootstrap_port}"

    def post_encode(room: int) -> str:
        resp = requests.post(f"{encode.url}/encode", json={"rid": f"r{room}", "bootstrap_room": room,
                                                          "images": [images["4k"]], "wait_for_delivery": False},
                             timeout=60)
        assert resp.status_code == 200 and resp.json()["num_tokens"] == 10549, resp.text
        return resp.json()["sha256"]

    def init(room: int) -> EmbeddingReceiver:
        receiver = m.create_receiver(addr, room)
        receiver.init(m.allocator.allocate(32))  # 4096 of 10549 tokens: more rounds follow
        return receiver

    try:
        digests = {room: post_encode(room) for room in (1, 2, 3, 4)}
        receivers = {1: init(1), 2: init(2)}
        wait_for(lambda: all(r.poll() == KVPoll.Transferring for r in receivers.values()), 20, "first rounds")
        assert sleep_(encode)["kept_bytes"] > 0
        assert receivers[2].try_resume()  # reaches the sleeping process only
        receivers[4] = init(4)  # likewise
        wait_for(lambda: m.stats["durable_sleepers_seen"] == 1, 10, "the language side to see it asleep on disk")
        os.kill(encode.proc.pid, signal.SIGKILL)
        encode.proc.wait()
        saved = json.loads((ckpt / "encode.json").read_text())
        assert sorted((e["room"], e["sent_tokens"]) for e in saved["rooms"]) == [(1, 4096), (2, 4096), (3, 0), (4, 0)]

        time.sleep(4.0)  # four heartbeats without an answer: a durable sleeper's rooms must wait
        assert all(r.poll() != KVPoll.Failed for r in receivers.values())
        encode = WorkerProcess("encode", *args, bootstrap_port=encode.bootstrap_port)
        assert "asleep: a checkpoint waits" in encode.ready_line
        health = requests.get(f"http://{addr}/health", timeout=10)
        assert health.text == "SLEEPING checkpointed"
        assert wake(encode).json()["restored_requests"] == 4
        wait_for(lambda: m.stats["peer_restarted"] == 1, 10, "the language side to see the new process")
        receivers[3] = init(3)
        for room, receiver in receivers.items():
            emb = finish_receiving(receiver, 60)
            assert emb.sha256() == digests[room], f"room {room}"
            emb.release()
        assert not any(ckpt.iterdir())  # consumed by the wake-up
        wait_for(lambda: requests.get(f"{encode.url}/health", timeout=10).json()["free_blocks"] == 512, 10,
                  "the encode pool to be free")
    finally:
        encode.stop()


def test_corrupt_or_mismatched_encode_checkpoint_is_refused_whole(model, images, tmp_path: Path) -> None:  # noqa: F811
    ckpt = tmp_path / "ckpt"
    encode = WorkerProcess("encode", "--model-path", model, "--checkpoint-dir", str(ckpt))
    booted: list[WorkerProcess] = []
    try:
        resp = requests.post(f"{encode.url}/encode", json={"rid": "c", "bootstrap_room": 5, "images": [images["2k"]],
                                                          "wait_for_delivery": False},
                             timeout=60)
        assert resp.status_code == 200
        assert sleep_(encode)["kept_bytes"] > 0
        encode.stop()
        good = {p.name: p.read_bytes() for p in ckpt.iterdir()}
        assert set(good) == {"encode.json", "encode.safetensors", "encode.sha256"}
        # three workers booted asleep on the folder at once (each wake-up reads it again): two that
        # do not match it, and one that finds it damaged, then discards it
        cases = [(("--multimodal-block-size", "64"), "block_size=128; this worker has block_size=64"),
                 (("--embedding-cache-buffer-size", "16"), "holds rooms of up to 42 blocks; this worker's pool has 16"),
                 ((), "corrupt or truncated")]
        booted = start_together(*(lambda args=args: WorkerProcess("encode", "--model-path", model, "--checkpoint-dir",
                                                                  str(ckpt), *args) for args, _ in cases))
        for encode, (args, words) in zip(booted, cases, strict=True):
            if not args:  # the last: the folder damaged once the others have read it whole
                (ckpt / "encode.safetensors").write_bytes(good["encode.safetensors"][:-7])
            resp = wake(encode)
            assert resp.status_code == 422 and words in resp.json()["error"], resp.text
            health = requests.get(f"{encode.url}/health", timeout=10).json()
            assert health["state"] == "asleep" and health["active_rooms"] == 0
        for worker in booted[:2]:
            worker.stop()
        encode = booted[2]
        assert wake(encode, discard_checkpoint="true").json()["restored_requests"] == 0
        assert not any(ckpt.iterdir())
    finally:
        for worker in [encode, *booted]:
            worker.stop()


def test_a_checkpoint_that_cannot_be_written_keeps_the_rooms_in_memory(model, images, tmp_path: Path) -> None:  # noqa: F811
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    encode = WorkerProcess("encode", "--model-path", model, "--checkpoint-dir", str(blocker / "ckpt"))
    try:
        resp = requests.post(f"{encode.url}/encode", json={"rid": "w", "bootstrap_room": 6, "images": [images["1k"]],
                                                          "wait_for_delivery": False},
                             timeout=60)
        assert resp.status_code == 200
        slept = sleep_(encode)
        assert f"checkpoint not written to {blocker / 'ckpt'}" in slept["checkpoint_error"]
        health = requests.get(f"http://127.0.0.1:{encode.bootstrap_port}/health", timeout=10)
        assert health.text == "SLEEPING"  # not durable: peers must not wait for a restart
        assert wake(encode).json()["restored_requests"] == 1
    finally:
        encode.stop()


def test_both_workers_restart_from_their_checkpoints(model, images, tmp_path: Path) -> None:  # noqa: F811
    """Language inits and sleeps, the image is encoded while it sleeps, the encoder sleeps, both
    are killed and restarted on their folders: the language side notices the new encoder by its
    incarnation, and the transfer completes for a client that asks again."""
    enc_dir, lang_dir = str(tmp_path / "encode"), str(tmp_path / "language")
    lang_env = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5"}
    encode, language = start_together(
        lambda: WorkerProcess("encode", "--model-path", model, "--checkpoint-dir", enc_dir),
        lambda: WorkerProcess("language", "--checkpoint-dir", lang_dir, env=lang_env))
    body = {"rid": "both", "bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port,
            "bootstrap_room": 77}
    try:
        with ThreadPoolExecutor(1) as pool:
            pool.submit(requests.post, f"{language.url}/generate", json=body, timeout=60)
            wait_inited(language, encode)  # the encoder has no data for the room yet
            assert sleep_(language)["kept_requests"] == 1
            enc = requests.post(f"{encode.url}/encode", json={"rid": "both", "bootstrap_room": 77,
                                                              "images": [images["4k"]], "wait_for_delivery": False},
                                timeout=60)
            assert enc.status_code == 200, enc.text
            assert sleep_(encode)["kept_bytes"] > 0
            for worker in (language, encode):
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
        encode, language = start_together(
            lambda: WorkerProcess("encode", "--model-path", model, "--checkpoint-dir", enc_dir,
                                  bootstrap_port=encode.bootstrap_port),
            lambda: WorkerProcess("language", "--checkpoint-dir", lang_dir, env=lang_env))
        assert wake(encode).json()["restored_requests"] == 1
        assert wake(language).json()["restored_requests"] == 1
        result = requests.post(f"{language.url}/generate", json=body, timeout=60).json()
        assert result["sha256"] == enc.json()["sha256"], result
        assert not any(Path(enc_dir).iterdir()) and not any(Path(lang_dir).iterdir())
    finally:
        language.stop()
        encode.stop()
