"""E/P/D: our encode worker, SGLang's PD prefill fed by our connector (``--disaggregation-mode
prefill --language-only``), SGLang's own decode server, behind smg as SGLang's PD router
(``--pd-disaggregation``, unmodified); each started with ``python -m sglang.launch_server``, on this
CPU with the plugin's CPU defaults for PD (``sglang_ext/pd.py``).

Every generated id through the router is checked against transformers' monolithic ``generate``
from the pixels on the same checkpoint (``monolithic.greedy_mismatch``, strict), a 3840x2160 image
in resume rounds included, with the negative test that the comparison catches another image.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import requests
from monolithic import greedy_mismatch, long_run_mismatch
from sglang_stack import (
    NEW_TOKENS,
    SGLANG_LAUNCH,
    connector_health,
    encoder_health,
    generate_videos,
    metric,
    prompt,
    video_greedy,
    write_clips,
    write_images,
)
from test_faults import wait_for

from harness.workers import SGLANG_READY, WorkerProcess, free_port, smg_pd_router, start_together

pytestmark = pytest.mark.sglang

# SGLang's PD KV transfer over Mooncake's TCP transport (SGLang's own flag: this machine has no RDMA)
PD_FLAGS = ("--disaggregation-transfer-backend", "mooncake_tcp", "--max-total-tokens", "32768",
            "--skip-server-warmup")
ROUNDS = 'epd_resume_rounds_total{role="language"}'
# The encoder finds a dead prefill within 1 s x (2 + 1) (docs/failure_bounds.md); the decode
# (SGLang's KV receiver, read from the same variables, at least 2 s apart) a dead prefill's
# bootstrap server within 2 s x 2, and releases the KV it held for a request whose prefill is
# gone after 5 s without the prefill's drain acknowledgement (SGLang's default: 30 s).
ENCODER_HEARTBEAT = ("--heartbeat-interval", "1", "--heartbeat-max-failure", "2")
DECODE_ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
              "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "5"}
# smg answers a request whose server died as soon as the connection to it breaks (measured: 0.5 s
# after a decode's kill, 1.1 s after a prefill's); the bound allows a loaded machine.
KILL_ANSWER_S = 15.0
# smg takes a server it could not reach out of rotation until a health probe answers (every 60 s
# by default): every 2 s here, so that a restarted server is back within seconds.
ROUTER_PROBES = ("--health-check-interval-secs", "2")
# The pools of the servers that live on are whole once the heartbeats above have found the dead
# one (the encoder's 3 s, the decode's 4 s) and a decode that held KV for a dead prefill's request
# has released it (5 s), on a loaded machine. No request here names a ``rid`` of its own: smg
# retries a failed PD request with the same body, which a server still holding the first attempt
# refuses as a duplicate.
POOLS_WHOLE_S = 30.0
TRANSFERS = 'epd_transfer_latency_seconds_count{role="language"}'


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("pd-images"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    return write_clips(tmp_path_factory.mktemp("pd-clips"))


def start_prefill(folder: str, encode: WorkerProcess, kv_bootstrap: int, port: int | None = None) -> WorkerProcess:
    return WorkerProcess("prefill", "--language-only", "--model-path", folder, "--encoder-urls", encode.url,
                         "--disaggregation-bootstrap-port", str(kv_bootstrap), "--enable-metrics", *PD_FLAGS,
                         command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=300, port=port)


def start_decode(folder: str, port: int | None = None) -> WorkerProcess:
    return WorkerProcess("decode", "--model-path", folder, *PD_FLAGS, command=SGLANG_LAUNCH, ready=SGLANG_READY,
                         timeout=300, port=port, env=DECODE_ENV)


@pytest.fixture(scope="module")
def epd(folder, tmp_path_factory):
    """The stack (``encode``, ``prefill``, ``decode``, ``router`` URL, ``kv_bootstrap`` port): the
    encode worker first (the prefill checks it at start), then the prefill and the decode in one
    wait, then the router. A test may replace the prefill or the decode (a restart on its ports)."""
    encode = WorkerProcess("encode", "--model-path", folder, *ENCODER_HEARTBEAT, command=SGLANG_LAUNCH)
    stack = SimpleNamespace(encode=encode, kv_bootstrap=free_port())
    try:
        stack.prefill, stack.decode = start_together(lambda: start_prefill(folder, encode, stack.kv_bootstrap),
                                                     lambda: start_decode(folder))
    except BaseException:
        encode.stop()
        raise
    try:
        with smg_pd_router([(stack.prefill.url, stack.kv_bootstrap)], [stack.decode.url],
                           tmp_path_factory.mktemp("pd-router") / "smg.log", options=ROUTER_PROBES) as stack.router:
            yield stack
    finally:
        stack.decode.stop()
        stack.prefill.stop()
        encode.stop()


def generate(router: str, paths: list[str], rid: str, new_tokens: int = NEW_TOKENS) -> dict:
    body = {"rid": rid, "text": prompt(len(paths)), "image_data": paths,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    answer = requests.post(f"{router}/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def received(prefill: WorkerProcess, rid: str) -> str:
    """The prefill's line for ``rid``'s media through the connector (tokens, resume rounds)."""
    lines = [line for line in prefill.log if f"rid={rid}:" in line and "resume rounds" in line]
    assert len(lines) == 1, "".join(prefill.log[-40:])
    return lines[0]


@pytest.mark.parametrize("size", ["448x448", "1920x1080", "3840x2160"])
def test_greedy_ids_through_the_pd_router_equal_monolithic(epd, images, reference, size) -> None:
    """The prefill takes the image's rows from the encoder (a 3840x2160 image's 10,500 tokens in a
    resume round past the 8192-token first allocation) and sends the KV to the decode, which
    generates every id transformers' monolithic model does."""
    prefill, router = epd.prefill, epd.router
    counted = metric(prefill, ROUNDS), metric(prefill, TRANSFERS)
    body = generate(router, [images[size]], f"pd-{size}")
    assert greedy_mismatch(body["output_ids"], reference([images[size]])) is None
    rounds = int(re.search(r"(\d+) resume rounds", received(prefill, f"pd-{size}")).group(1))
    assert rounds == (1 if size == "3840x2160" else 0)
    # the client gets the decode's answer (the router passes it on); the transfer's figures are
    # on the prefill's /metrics, as on a language server
    assert (metric(prefill, ROUNDS), metric(prefill, TRANSFERS)) == (counted[0] + rounds, counted[1] + 1)


def test_the_comparison_catches_another_image(epd, images, reference) -> None:
    router = epd.router
    body = generate(router, [images["other"]], "pd-other")
    assert greedy_mismatch(body["output_ids"], reference([images["448x448"]])) is not None
    assert greedy_mismatch(body["output_ids"], reference([images["other"]])) is None


def test_two_images_in_one_request(epd, images, reference) -> None:
    router = epd.router
    pair = [images["448x448"], images["other"]]
    assert greedy_mismatch(generate(router, pair, "pd-two")["output_ids"], reference(pair)) is None


def test_text_health_and_the_openai_client_through_the_router(epd, images, folder) -> None:
    """A request without media, each server's own health check (the prefill's is a PD request of
    SGLang's: its bootstrap fields are the prefill's, never read as an encoder's room), and the
    official ``openai`` client with an image through the router."""
    from openai import OpenAI

    prefill, decode, router = epd.prefill, epd.decode, epd.router
    text = requests.post(f"{router}/generate", timeout=120, json={
        "text": "Say something.", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
    assert text.status_code == 200 and len(text.json()["output_ids"]) == 4, text.text
    for server in (prefill, decode):
        assert requests.get(f"{server.url}/health", timeout=60).status_code == 200
    data = base64.b64encode(Path(images["448x448"]).read_bytes()).decode()
    client = OpenAI(base_url=f"{router}/v1", api_key="none", timeout=240, max_retries=0)
    reply = client.chat.completions.create(
        model=folder, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                               {"type": "text", "text": "Describe it."}]}])
    assert reply.usage.completion_tokens == NEW_TOKENS and reply.choices[0].message.content


def test_a_video_through_the_pd_router_equals_monolithic(epd, clips, folder, model) -> None:
    """A video's rows from the encoder (the frames SGLang samples), the ids transformers' own
    processor and model give on those frames; another clip's ids differ."""
    router = epd.router
    expected = video_greedy(folder, model)
    body = generate_videos(SimpleNamespace(url=router), [clips["392x280x8"]], "pd-video")
    assert greedy_mismatch(body["output_ids"], expected([clips["392x280x8"]])) is None
    assert greedy_mismatch(body["output_ids"], expected([clips["448x252x120"]])) is not None


def test_sglangs_benchmark_client_through_the_router_gets_every_token(epd, folder, tmp_path) -> None:
    """SGLang's own benchmark client, unmodified, on its image dataset through the PD router: 6
    requests, every one successful with exactly its 8 tokens (the client sends ignore_eos)."""
    host, port = epd.router.removeprefix("http://").rsplit(":", 1)
    out = subprocess.run(
        [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", host, "--port", port,
         "--model", folder, "--tokenizer", folder, "--dataset-name", "image", "--num-prompts", "6", "--image-count",
         "1", "--image-resolution", "448x448", "--random-input-len", "32", "--random-output-len", "8",
         "--random-range-ratio", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout  # it writes a results file in its folder
    assert re.search(r"^Successful requests:\s+6\s*$", out, re.M), out[-3000:]
    assert re.search(r"^Total generated tokens:\s+48\s*$", out, re.M), out[-3000:]


LOAD_CLIENTS = 48


def test_48_clients_at_once_through_the_router_each_get_transformers_ids_and_every_pool_comes_back(
        epd, images, reference) -> None:
    """48 concurrent requests over the module's three pictures, each with a ``cache_salt`` of its
    own (a tenant's: no embedding cache serves it another's rows, so every picture is encoded
    again) and no ``rid``: every one answered 200 with transformers' ids for its picture, then
    every pool whole (the encoder's rooms and blocks, the prefill's connector blocks, both
    servers' requests and KV). The pictures are the checkpoint's decisive media (a random picture
    can meet a tie in the reference: docs/correctness.md)."""
    names = ["1920x1080" if i % 6 == 0 else ("448x448" if i % 2 else "other") for i in range(LOAD_CLIENTS)]
    encoded_before = metric(epd.encode, 'epd_encoder_items_total{source="encoded"}')

    def ask(client: int) -> requests.Response:
        return requests.post(f"{epd.router}/generate", timeout=300, json={
            "text": prompt(1), "image_data": [images[names[client]]], "cache_salt": f"tenant-{client}",
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})

    with ThreadPoolExecutor(LOAD_CLIENTS) as pool:
        answers = list(pool.map(ask, range(LOAD_CLIENTS)))
    assert [a.status_code for a in answers] == [200] * LOAD_CLIENTS, [a.text[:200] for a in answers if a.status_code != 200]
    assert metric(epd.encode, 'epd_encoder_items_total{source="encoded"}') - encoded_before == LOAD_CLIENTS
    for name, answer in zip(names, answers, strict=True):
        assert greedy_mismatch(answer.json()["output_ids"], reference([images[name]])) is None, name
    pools_whole(epd, epd.prefill, epd.decode)


SLEEP_TOKENS = 200  # the long answer's: a decode of some seconds, for a sleep to land mid-decode


def decode_batches(decode: WorkerProcess) -> int:
    return sum("Decode batch" in line for line in decode.log)


def sleep_both(epd, level: int) -> None:
    """The prefill (our ``/sleep``: SGLang's pause extended to the connector) and the decode
    (SGLang's own ``/pause_generation``, plus ``/release_memory_occupation`` at level 2), at once."""
    mode = "in_place" if level == 1 else "retract"
    with ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(requests.post, f"{epd.prefill.url}/sleep",
                              params={"level": level, "preserve_state": "true"}, timeout=120)
        decode = pool.submit(requests.post, f"{epd.decode.url}/pause_generation", json={"mode": mode}, timeout=120)
        assert prefill.result().status_code == 200, prefill.result().text
        assert decode.result().status_code == 200, decode.result().text
    assert prefill.result().json()["is_sleeping"], prefill.result().json()
    if level == 2:
        released = requests.post(f"{epd.decode.url}/release_memory_occupation", json={}, timeout=120)
        assert released.status_code == 200, released.text


def wake_both(epd, level: int) -> None:
    if level == 2:
        resumed = requests.post(f"{epd.decode.url}/resume_memory_occupation", json={}, timeout=120)
        assert resumed.status_code == 200, resumed.text
    woke = requests.post(f"{epd.decode.url}/continue_generation", json={}, timeout=120)
    assert woke.status_code == 200, woke.text
    woke = requests.post(f"{epd.prefill.url}/wake_up", timeout=120)
    assert woke.status_code == 200 and woke.json()["is_sleeping"] is False, woke.text


def test_a_sleep_of_prefill_and_decode_mid_transfer_and_mid_decode_keeps_every_token(epd, images, reference) -> None:
    """Prefill and decode asleep at once (level 1, then level 2) while one request decodes (a long
    answer, its decode batches under way) and another's 3840x2160 image is in transfer from the
    encoder to the prefill: neither answers, nor decodes, while they sleep; after the wake-up both
    end with the ids the same requests got unslept, which equal transformers' (the long one as
    ``long_run_mismatch`` compares a long run), and every pool is whole."""
    def bodies() -> tuple[dict, dict]:
        return ({"text": prompt(1), "image_data": [images["1920x1080"]],
                 "sampling_params": {"max_new_tokens": SLEEP_TOKENS, "temperature": 0, "ignore_eos": True}},
                {"text": prompt(1), "image_data": [images["3840x2160"]],
                 "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})

    unslept = [requests.post(f"{epd.router}/generate", json=body, timeout=300) for body in bodies()]
    assert all(answer.status_code == 200 for answer in unslept), [answer.text[:300] for answer in unslept]
    why, _ = long_run_mismatch(unslept[0].json()["output_ids"], reference([images["1920x1080"]], SLEEP_TOKENS))
    assert why is None, why
    assert greedy_mismatch(unslept[1].json()["output_ids"], reference([images["3840x2160"]])) is None
    for level in (1, 2):
        answers = asleep_mid_request(epd, level, *bodies())
        for answer, before in zip(answers, unslept, strict=True):
            assert answer.status_code == 200, answer.text[:300]
            assert answer.json()["output_ids"] == before.json()["output_ids"], f"level {level}"
        pools_whole(epd, epd.prefill, epd.decode)


def asleep_mid_request(epd, level: int, long_body: dict, large_body: dict) -> list[requests.Response]:
    """The long request once it decodes, the 4K one once its image is in transfer; both servers
    asleep at ``level`` for 2 s (no answer, no decode batch meanwhile), then awake: the answers."""
    with ThreadPoolExecutor(2) as pool:
        decoding = decode_batches(epd.decode)
        long = pool.submit(requests.post, f"{epd.router}/generate", json=long_body, timeout=300)
        wait_for(lambda: decode_batches(epd.decode) > decoding or long.done(), 120, "the long answer's decode")
        large = pool.submit(requests.post, f"{epd.router}/generate", json=large_body, timeout=300)
        wait_for(lambda: connector_health(epd.prefill)["transferring"] or large.done(), 120, "the 4K transfer")
        assert not long.done() and not large.done(), f"level {level}: a request ended before the sleep"
        sleep_both(epd, level)
        time.sleep(0.5)  # a decode step under way at the pause may still log
        paused = decode_batches(epd.decode)
        time.sleep(2.0)
        assert not long.done() and not large.done(), f"level {level}: a request ended while asleep"
        assert decode_batches(epd.decode) == paused, f"level {level}: the decode went on while asleep"
        wake_both(epd, level)
        return [long.result(), large.result()]


def kill(worker: WorkerProcess) -> None:
    """``kill -9`` of the server and every process it started, as a host that dies takes them."""
    tree = [psutil.Process(worker.proc.pid), *psutil.Process(worker.proc.pid).children(recursive=True)]
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.kill()
    worker.proc.wait(30)


def kv_in_use(server: WorkerProcess) -> tuple[int, int]:
    """(requests running or waiting, KV tokens held by requests) on an SGLang server (``/v1/loads``;
    what its radix cache keeps and could evict is not held)."""
    load = requests.get(f"{server.url}/v1/loads", timeout=10).json()["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"], load["num_used_tokens"]


def pools_whole(epd, *servers: WorkerProcess) -> float:
    """Within :data:`POOLS_WHOLE_S`: the encoder holds no room and every block of its pool is free,
    and each of ``servers`` holds no request and no KV token (a prefill: no connector block either).
    The seconds it took."""
    held: dict = {}

    def whole() -> bool:
        encoder = encoder_health(epd.encode)
        held["encoder"] = (encoder["active_rooms"], encoder["num_blocks"] - encoder["free_blocks"])
        for server in servers:
            held[server.mode] = kv_in_use(server)
            if server.mode == "prefill":
                held["prefill blocks"] = metric(server, 'epd_pool_blocks_used{role="language"}')
        return not any(any(v) if isinstance(v, tuple) else v for v in held.values())

    try:
        return wait_for(whole, POOLS_WHOLE_S, "every pool whole")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: still held {held}") from None


def served_again(epd, images, reference, what: str) -> None:
    """Once the router has the restarted server in rotation: a request with an image answered with
    transformers' ids (the router may send one more to the server it found dead: those are retried)."""
    start = time.monotonic()
    deadline, tries = start + 120, 0
    while True:
        tries += 1
        body = {"text": prompt(1), "image_data": [images["448x448"]],
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
        answer = requests.post(f"{epd.router}/generate", json=body, timeout=300)
        if answer.status_code == 200:
            break
        assert time.monotonic() < deadline, answer.text
        time.sleep(1)
    assert greedy_mismatch(answer.json()["output_ids"], reference([images["448x448"]])) is None
    print(f"{what}: served after {time.monotonic() - start:.1f} s ({tries} tries)")


def killed_mid_request(epd, images, victim: str, struck) -> tuple[requests.Response, float]:
    """A 3840x2160 request with a long answer through the router; ``victim`` (the prefill or the
    decode) killed once ``struck()`` says the request reached it. The client's answer and its time
    after the kill."""
    body = {"text": prompt(1), "image_data": [images["3840x2160"]],
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(requests.post, f"{epd.router}/generate", json=body, timeout=300)
        wait_for(lambda: struck() or answer.done(), 120, f"the request at the {victim}")
        assert not answer.done(), answer.result().text[:300]
        killed_at = time.monotonic()
        kill(getattr(epd, victim))
        reply = answer.result()
        return reply, time.monotonic() - killed_at


def test_a_decode_killed_mid_decode_answers_its_client_and_a_restarted_one_serves(epd, images, reference, folder) -> None:
    """kill -9 of the decode while it generates (its log has a decode batch for the request): the
    client gets smg's error at once, the prefill and the encoder hold nothing of the request, and
    a decode restarted on the same port serves."""
    decoding = len([line for line in epd.decode.log if "Decode batch" in line])
    reply, answered = killed_mid_request(
        epd, images, "decode", lambda: len([line for line in epd.decode.log if "Decode batch" in line]) > decoding)
    assert reply.status_code == 502 and "PD disaggregation request failed" in reply.text, reply.text[:300]
    assert answered < KILL_ANSWER_S, answered
    print(f"\ndecode killed: {reply.status_code} {reply.text[:120]!r} after {answered:.2f} s; pools whole after "
          f"{pools_whole(epd, epd.prefill):.2f} s")
    epd.decode = start_decode(folder, port=epd.decode.port)
    served_again(epd, images, reference, "after-decode-kill")
    pools_whole(epd, epd.prefill, epd.decode)


def test_a_prefill_killed_mid_transfer_answers_its_client_and_a_restarted_one_serves(epd, images, reference,
                                                                                     folder) -> None:
    """kill -9 of the prefill while its room for a 3840x2160 image is open at the encoder: the
    client gets smg's error at once, the encoder's room ends and its pool is whole, the decode
    frees what it held for the request, and a prefill restarted on the same ports serves."""
    reply, answered = killed_mid_request(epd, images, "prefill", lambda: connector_health(epd.prefill)["transferring"])
    assert reply.status_code == 502 and "PD disaggregation request failed" in reply.text, reply.text[:300]
    assert answered < KILL_ANSWER_S, answered
    print(f"\nprefill killed: {reply.status_code} {reply.text[:120]!r} after {answered:.2f} s; pools whole after "
          f"{pools_whole(epd, epd.decode):.2f} s")
    restarted = time.monotonic()
    epd.prefill = start_prefill(folder, epd.encode, epd.kv_bootstrap, port=epd.prefill.port)
    print(f"prefill restarted in {time.monotonic() - restarted:.1f} s")
    served_again(epd, images, reference, "after-prefill-kill")
    pools_whole(epd, epd.prefill, epd.decode)
