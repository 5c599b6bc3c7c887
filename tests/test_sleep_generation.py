"""Sleep and wake with running generations (language worker, real processes): whatever the
moment (waiting for its embedding, in prefill, decoding, streaming), every request goes on
after the wake-up with exactly the tokens of an uninterrupted run, greedy and seeded, at sleep
level 1 (weights kept in host memory) and 2 (weights dropped and read again)."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from test_generate_api import CHAT, ROOMS, P, fold_stream, generate, images, metric, wait_idle  # noqa: F401  (fixture)
from workers import WorkerProcess, model_workers


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def workers(folder):
    with model_workers(folder, "--embedding-default-allocate-buffer-size", "128") as pair:
        yield pair


def specs(paths: dict[str, str]) -> list[tuple[dict, list[str], bool]]:
    """(body, images, stream): greedy and seeded, streamed and not, text and image, a long prompt."""
    return [
        ({"text": CHAT.format("Tell me a story."), "sampling_params": {"max_new_tokens": 600}}, [], True),
        ({"text": CHAT.format(f"{P}Describe."), "sampling_params": {"max_new_tokens": 30, "temperature": 0.8,
                                                                    "top_p": 0.9, "seed": 3}},
         [paths["square"]], False),
        ({"text": "word " * 1000, "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "seed": 8}}, [], True),
    ]


def start(workers, body: dict, paths: list[str], stream: bool, encode_after: threading.Event) -> dict:
    """Like ``generate``, but the images go to the encoder only once ``encode_after`` is set."""
    encode, lang = workers
    body = dict(body, stream=stream)
    room = ROOMS.take()
    if paths:
        body |= {"bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port, "bootstrap_room": room}

    def send_images():
        encode_after.wait(120)
        return requests.post(f"{encode.url}/encode", json={"rid": str(room), "bootstrap_room": room, "images": paths},
                             timeout=300)

    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(send_images) if paths else None
        answer = requests.post(f"{lang.url}/generate", json=body, timeout=300, stream=stream)
        assert answer.status_code == 200, answer.text
        result = fold_stream(answer) if stream else answer.json()
        if sent is not None:
            assert sent.result().status_code == 200, sent.result().text
    return result


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_in_every_phase_give_the_uninterrupted_tokens(workers, images, level) -> None:  # noqa: F811
    sleep_in_every_phase(workers, images, level)


def test_with_sleep_kv_recompute_the_tokens_are_the_same(seeded_checkpoint, images) -> None:  # noqa: F811
    folder = seeded_checkpoint(3584)
    with model_workers(folder, "--embedding-default-allocate-buffer-size", "128", "--sleep-kv", "recompute") as pair:
        asleep = sleep_in_every_phase(pair, images, 1)
    assert asleep["kv_bytes"] == 0  # dropped, recomputed at wake-up


def sleep_in_every_phase(workers, images: dict[str, str], level: int) -> dict:  # noqa: F811
    """The cases of ``specs`` alone, then together with a sleep and a wake-up while the greedy
    stream decodes (the image request waits for its embedding over the sleep, the long prompt
    may be in prefill); the sleep's reply."""
    _, lang = workers
    cases = specs(images)
    alone = [generate(workers, body, paths, stream) for body, paths, stream in cases]
    encode_after = threading.Event()  # the image request waits for its embedding over the sleep
    before = metric(lang, "epd_generated_tokens_total")
    with ThreadPoolExecutor(len(cases)) as pool:
        running = [pool.submit(start, workers, body, paths, stream, encode_after) for body, paths, stream in cases]
        try:
            deadline = time.monotonic() + 120
            # the greedy stream is decoding and the image request waits for its embedding
            while (metric(lang, "epd_generated_tokens_total") < before + 10
                   or requests.get(f"{lang.url}/health").json()["transferring"] != 1):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            slept = requests.post(f"{lang.url}/sleep?level={level}&preserve_state=true", timeout=120)
            assert slept.status_code == 200, slept.text
            asleep = slept.json()
            assert asleep["kept_generations"] >= 1 and asleep["kept_requests"] == 1, asleep
            frozen = metric(lang, "epd_generated_tokens_total")
            time.sleep(0.5)
            assert metric(lang, "epd_generated_tokens_total") == frozen  # nothing runs while asleep
        finally:  # whatever failed above, nobody is left waiting
            requests.post(f"{lang.url}/wake_up", timeout=120)
            encode_after.set()
        woken = [f.result() for f in running]
    for (body, _, _), ours, reference in zip(cases, woken, alone, strict=True):
        assert ours["output_ids"] == reference["output_ids"], body["sampling_params"]
        assert ours["text"] == reference["text"]
    health = wait_idle(lang)
    assert health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]
    assert metric(lang, "epd_kv_tokens_used") == 0
    return asleep


def test_kept_kv_is_reported_in_bytes(workers) -> None:
    _, lang = workers
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(requests.post, f"{lang.url}/generate", json={
            "text": "abc", "sampling_params": {"max_new_tokens": 400}}, timeout=120)
        deadline = time.monotonic() + 60
        while requests.get(f"{lang.url}/health").json()["generating"] != 1 or metric(
                lang, "epd_generations_running") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        asleep = requests.post(f"{lang.url}/sleep?level=1&preserve_state=true", timeout=60).json()
        assert requests.post(f"{lang.url}/wake_up", timeout=60).status_code == 200
        done = running.result().json()
    # 2 KiB per token for the seeded 1-layer model (4 KV heads x 128 x 2 bytes, keys and values)
    assert asleep["kept_generations"] == 1 and asleep["kv_bytes"] % 2048 == 0 and asleep["kv_bytes"] >= 3 * 2048
    # it ran on over the sleep to its end: its length, or the end of its text
    assert done["meta_info"]["completion_tokens"] == 400 or done["meta_info"]["finish_reason"]["type"] == "stop", done


def test_a_stream_pauses_over_the_sleep_and_loses_or_repeats_nothing(workers) -> None:
    _, lang = workers
    body = {"text": CHAT.format("Count."), "sampling_params": {"max_new_tokens": 400}, "stream": True}
    reference = generate(workers, {k: v for k, v in body.items() if k != "stream"})
    arrivals: list[tuple[float, list[int]]] = []  # read on a thread: the client keeps reading over the sleep

    def read() -> None:
        with requests.post(f"{lang.url}/generate", json=body, stream=True, timeout=120) as answer:
            for line in answer.iter_lines():
                if line.startswith(b"data: {"):
                    arrivals.append((time.monotonic(), json.loads(line[6:])["output_ids"]))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        asleep = requests.post(f"{lang.url}/sleep?level=1&preserve_state=true", timeout=60).json()
        slept_at = time.monotonic()
        time.sleep(1.0)
        woke_at = time.monotonic()
    finally:
        assert requests.post(f"{lang.url}/wake_up", timeout=60).status_code == 200
    reader.join(120)
    assert asleep["kept_generations"] == 1, asleep  # it was mid-stream
    assert [t for _, chunk in arrivals for t in chunk] == reference["output_ids"]
    assert not [at for at, _ in arrivals if slept_at < at < woke_at]  # nothing while asleep
    assert any(at > woke_at for at, _ in arrivals)  # and the rest after


def test_abort_while_asleep_and_a_model_that_cannot_be_loaded_again(workers, folder, tmp_path) -> None:
    """Level 2 drops the weights: a folder that lost its weights meanwhile keeps the worker
    asleep with the reason; once they are back, the wake-up goes on exactly. A request aborted
    while asleep ends at once and gives its KV back."""
    _, lang = workers
    keep = {"text": CHAT.format("Keep me."), "sampling_params": {"max_new_tokens": 60}}
    reference = generate(workers, keep)
    with ThreadPoolExecutor(2) as pool:
        kept = pool.submit(requests.post, f"{lang.url}/generate", json=dict(keep, rid="kept"), timeout=120)
        dropped = pool.submit(requests.post, f"{lang.url}/generate", json={
            "rid": "dropped", "text": "x", "sampling_params": {"max_new_tokens": 500}}, timeout=120)
        _wait(lambda: metric(lang, "epd_generations_running") == 2)
        assert requests.post(f"{lang.url}/sleep?level=2&preserve_state=true", timeout=60).json()["kept_generations"] == 2
        assert requests.post(f"{lang.url}/abort_request", json={"rid": "dropped"}).json()["aborted"] is True
        assert dropped.result().json()["meta_info"]["finish_reason"] == {"type": "abort",
                                                                         "message": "aborted by /abort_request"}
        weights = f"{folder}/model.safetensors"
        os.replace(weights, tmp_path / "w")
        refused = requests.post(f"{lang.url}/wake_up", timeout=60)
        assert refused.status_code == 500 and "could not load the language model from" in refused.json()["error"]
        assert requests.get(f"{lang.url}/is_sleeping").json()["is_sleeping"] is True
        os.replace(tmp_path / "w", weights)
        assert requests.post(f"{lang.url}/wake_up", timeout=60).status_code == 200
        assert kept.result().json()["output_ids"] == reference["output_ids"]
    assert wait_idle(lang)["generating"] == 0 and metric(lang, "epd_kv_tokens_used") == 0


def test_a_wake_up_after_a_sleep_without_preserve_state_serves_again(workers) -> None:
    _, lang = workers
    assert requests.post(f"{lang.url}/sleep?level=2&preserve_state=false", timeout=60).status_code == 200
    assert requests.post(f"{lang.url}/wake_up", timeout=60).status_code == 200
    body = {"text": CHAT.format("Again."), "sampling_params": {"max_new_tokens": 8}}
    assert len(generate(workers, body)["output_ids"]) == 8


def _wait(check, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_both_workers_killed_asleep_restart_from_disk_and_every_request_goes_on(folder, images, tmp_path) -> None:  # noqa: F811
    """Both workers asleep with checkpoint folders while a greedy stream and a seeded image
    request decode and a third request waits for its embedding; both are killed (-9) and
    restarted on their folders. A checkpoint whose generations do not fit a smaller KV budget
    is refused (422) and the worker stays asleep (a damaged checkpoint or another model's:
    ``test_sleep_workers.py`` and ``test_sleep_pitfalls.py``); the good one boots asleep, wakes,
    and a client that asks again for each rid gets the whole output of an uninterrupted run."""
    enc_dir, lang_dir = tmp_path / "encode", tmp_path / "language"
    env = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5"}  # the new encoder is noticed soon

    def language_worker(*extra: str) -> WorkerProcess:
        return WorkerProcess("language", "--model-path", folder, "--embedding-default-allocate-buffer-size", "128",
                             "--checkpoint-dir", str(lang_dir), *extra, env=env)

    encode = WorkerProcess("encode", "--model-path", folder, "--checkpoint-dir", str(enc_dir))
    language = language_worker()
    rooms = {"seeded": ROOMS.take(), "waits": ROOMS.take()}
    cases = {
        "greedy": ({"text": CHAT.format("Tell me a story."), "sampling_params": {"max_new_tokens": 400}}, [], True),
        "seeded": ({"text": CHAT.format(f"{P}Describe."), "sampling_params": {
            "max_new_tokens": 300, "temperature": 0.8, "top_p": 0.9, "seed": 3}}, [images["square"]], False),
        "waits": ({"text": CHAT.format(f"{P}What is it?"), "sampling_params": {"max_new_tokens": 20}},
                  [images["wide"]], False),
    }
    bodies = {rid: dict(body, rid=rid, stream=stream) | ({"bootstrap_host": "127.0.0.1", "bootstrap_port":
                                                          encode.bootstrap_port, "bootstrap_room": rooms[rid]}
                                                         if paths else {}) for rid, (body, paths, stream) in cases.items()}

    def encode_images(rid: str) -> requests.Response:
        return requests.post(f"{encode.url}/encode", json={"rid": rid, "bootstrap_room": rooms[rid],
                                                           "images": cases[rid][1]}, timeout=120)

    def ask(rid: str) -> dict:
        answer = requests.post(f"{language.url}/generate", json=bodies[rid], timeout=300, stream=bodies[rid]["stream"])
        assert answer.status_code == 200, answer.text
        return fold_stream(answer) if bodies[rid]["stream"] else answer.json()

    try:
        alone = {rid: generate((encode, language), body, paths, stream) for rid, (body, paths, stream) in cases.items()}
        with ThreadPoolExecutor(4) as pool:
            for rid in cases:  # their clients' connections drop with the kill
                pool.submit(requests.post, f"{language.url}/generate", json=bodies[rid], timeout=120)
            pool.submit(encode_images, "seeded")
            _wait(lambda: metric(language, "epd_generations_running") == 2 and requests.get(
                f"{language.url}/health").json()["transferring"] == 1 and metric(
                language, "epd_generated_tokens_total") > sum(len(r["output_ids"]) for r in alone.values()) + 10)
            asleep = requests.post(f"{language.url}/sleep?level=2&preserve_state=true", timeout=60).json()
            assert (asleep["kept_generations"], asleep["kept_requests"]) == (2, 1), asleep
            assert "checkpoint_error" not in asleep
            assert requests.post(f"{encode.url}/sleep?level=1&preserve_state=true", timeout=60).status_code == 200
            for worker in (language, encode):
                os.kill(worker.proc.pid, signal.SIGKILL)
                worker.proc.wait()
        good = {p.name: p.read_bytes() for p in lang_dir.iterdir()}
        assert set(good) == {"language.json", "language.safetensors", "language.sha256"}
        language = language_worker("--max-total-tokens", "600")
        refused = requests.post(f"{language.url}/wake_up", timeout=60)
        assert refused.status_code == 422 and "the KV budget is 600" in refused.json()["error"], refused.text
        assert requests.get(f"{language.url}/health", timeout=10).json()["state"] == "asleep"
        language.stop()
        assert {p.name: p.read_bytes() for p in lang_dir.iterdir()} == good  # a refusal changes nothing
        encode = WorkerProcess("encode", "--model-path", folder, "--checkpoint-dir", str(enc_dir),
                               bootstrap_port=encode.bootstrap_port)
        language = language_worker()
        assert "asleep: a checkpoint waits" in language.ready_line
        assert requests.post(f"{encode.url}/wake_up", timeout=60).status_code == 200
        woke = requests.post(f"{language.url}/wake_up", timeout=60).json()
        assert (woke["restored_generations"], woke["restored_requests"]) == (2, 1), woke
        with ThreadPoolExecutor(3) as pool:
            answers = {rid: pool.submit(ask, rid) for rid in cases}
            assert encode_images("waits").status_code == 200
            for rid, answer in answers.items():
                assert answer.result()["output_ids"] == alone[rid]["output_ids"], rid
                assert answer.result()["text"] == alone[rid]["text"]
        assert not any(lang_dir.iterdir()) and not any(enc_dir.iterdir())
        health = wait_idle(language)
        assert health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]
        assert metric(language, "epd_kv_tokens_used") == 0
    finally:
        language.stop()
        encode.stop()


def rss_bytes(worker: WorkerProcess) -> int:
    """Resident memory once it holds still (a wake-up faults the new pool in on a thread)."""
    def now() -> int:
        status = Path(f"/proc/{worker.proc.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024

    last, deadline = now(), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.5)
        current = now()
        if abs(current - last) < last // 200:
            return current
        last = current
    return last


@pytest.mark.soak
def test_soak_50_sleep_wake_cycles_on_both_workers_while_16_requests_generate(folder, images) -> None:  # noqa: F811
    """16 requests of mixed sizes (text and images, greedy and seeded, some streaming) generate
    over and over while both workers sleep (level 1 or 2, preserve_state) and wake at random
    moments: every output equals the request's uninterrupted one, every stream is whole, and
    afterwards no block or KV token is held. Memory: 10 such cycles first (the allocator's
    high-water marks under this load are not a leak), then 50; neither worker's resident
    memory after them is 5% above what it was before them."""
    kinds = [[], [images["small"]], [images["square"]], [images["wide"]]]
    cases = [({"text": CHAT.format(f"{P * len(paths)}Request {i}." + " more" * (i * 7)),
               "sampling_params": {"max_new_tokens": 8 + 5 * i} | (
                   {"temperature": 0.9, "top_p": 0.95, "seed": i} if i % 3 else {})}, paths, i % 2 == 0)
             for i, paths in enumerate(kinds * 4)]
    with model_workers(folder, "--embedding-default-allocate-buffer-size", "128",
                       both=("--queue-while-sleeping",)) as pair:
        encode, lang = pair
        alone = [generate(pair, body, paths, stream)["output_ids"] for body, paths, stream in cases]
        rng = random.Random(14)
        mismatches: list = []

        def cycles(count: int) -> collections.Counter:
            stop, done = threading.Event(), collections.Counter()

            def flow(i: int) -> None:
                body, paths, stream = cases[i]
                while not stop.is_set():
                    out = generate(pair, body, paths, stream)["output_ids"]
                    done[i] += 1
                    if out != alone[i]:
                        mismatches.append((i, out, alone[i]))

            with ThreadPoolExecutor(len(cases)) as pool:
                flows = [pool.submit(flow, i) for i in range(len(cases))]
                try:
                    for _ in range(count):
                        worker = rng.choice(pair)
                        time.sleep(rng.uniform(0.0, 0.3))
                        slept = requests.post(f"{worker.url}/sleep?level={rng.choice([1, 2])}&preserve_state=true",
                                              timeout=120)
                        assert slept.status_code == 200, slept.text
                        time.sleep(rng.uniform(0.0, 0.2))
                        assert requests.post(f"{worker.url}/wake_up", timeout=120).status_code == 200
                finally:
                    stop.set()
                    for f in flows:
                        f.result()
            health = wait_idle(lang)
            assert health["generating"] == 0 and health["free_blocks"] == health["num_blocks"]
            assert metric(lang, "epd_kv_tokens_used") == 0
            return done

        cycles(10)
        rss_before = {w.mode: rss_bytes(w) for w in pair}
        done = cycles(50)
        assert not mismatches, mismatches[:2]
        assert all(done[i] >= 1 for i in range(len(cases))), done
        assert requests.get(f"{encode.url}/health", timeout=10).json()["status"] == "ok"
        rss_after = {w.mode: rss_bytes(w) for w in pair}
        print(f"\nsoak: 50 cycles, {sum(done.values())} requests exact; RSS MiB before "
              f"{ {k: v >> 20 for k, v in rss_before.items()} } after { {k: v >> 20 for k, v in rss_after.items()} }")
        for mode, before in rss_before.items():
            assert rss_after[mode] <= before * 1.05, (mode, before, rss_after[mode])


def test_pitfall_6_concurrent_sleeps_and_wake_ups_are_serialised(workers) -> None:
    """Sleeps and wake-ups sent at once from many clients while two requests generate: each
    one either changes the state or is a no-op (never two sleeps, or two wake-ups, that both
    changed it), and the generations end exactly as alone."""
    _, lang = workers
    bodies = [{"text": CHAT.format("Serialised."), "sampling_params": {"max_new_tokens": 300}},
              {"text": "x", "sampling_params": {"max_new_tokens": 300, "temperature": 1.0, "seed": 6}}]
    alone = [generate(workers, body)["output_ids"] for body in bodies]
    changes: list[str] = []

    def call(kind: str) -> None:
        url = f"{lang.url}/sleep?level=1&preserve_state=true" if kind == "sleep" else f"{lang.url}/wake_up"
        answer = requests.post(url, timeout=120)
        assert answer.status_code == 200, answer.text
        if answer.json()["changed"]:
            changes.append(kind)

    with ThreadPoolExecutor(len(bodies) + 8) as pool:
        running = [pool.submit(generate, workers, body) for body in bodies]
        _wait(lambda: metric(lang, "epd_generations_running") == 2)
        rng = random.Random(6)
        list(pool.map(call, [rng.choice(["sleep", "wake"]) for _ in range(24)]))
        call("wake")
        outputs = [r.result()["output_ids"] for r in running]
    assert outputs == alone
    # awake before and after: serialised, every sleep that changed something had its own wake-up
    counts = collections.Counter(changes)
    assert counts["sleep"] == counts["wake"] >= 1, counts
    assert wait_idle(lang)["generating"] == 0 and metric(lang, "epd_kv_tokens_used") == 0
