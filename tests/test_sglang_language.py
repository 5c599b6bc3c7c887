"""SGLang's own server as the language worker (``--disaggregation-mode language`` through
``python -m sglang.launch_server``), fed by SGLang's own encoder in our encode worker
(``--disaggregation-mode encode`` through the same launcher) through the resumable connector.

One encode worker and one SGLang language server for the module (SGLang takes about a minute to
start on this CPU). Every generated id is checked against transformers' monolithic ``generate``
from the pixels on the same checkpoint, through SGLang's native ``/generate``, its stream and
its OpenAI API (the official ``openai`` client): equal at every step (``monolithic.greedy_mismatch``;
SGLang's tower and language model round some bf16 values differently from transformers', by far
less than the seeded checkpoint's steps lead).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import requests
import torch
from monolithic import Greedy, bf16_step, greedy_mismatch, long_run_mismatch
from sglang_stack import (
    NEW_TOKENS,
    SGLANG_LAUNCH,
    SIZES,
    encoder_health,
    generate,
    generate_as_reference,
    generate_videos,
    metric,
    prompt,
    smg_gateway,
    video_greedy,
    write_clips,
    write_images,
)
from transfer_large_image import make_image

from harness.workers import SGLANG_READY, WorkerProcess, start_together
from sglang_ext.language_flags import GENERATIONS_ROLE, cpu_kv_tokens

pytestmark = pytest.mark.sglang



@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("sglang-images"))


@pytest.fixture(scope="module")
def workers(folder, tmp_path_factory):
    """The encoder and the SGLang language server every test uses; a second language server on
    the same encoder (smg's second one, then killed and started again on its checkpoint folder)
    starts beside the first, so both start in one wait."""
    encode = WorkerProcess("encode", "--model-path", folder, "--admin-api-key", ADMIN_KEY, command=SGLANG_LAUNCH)
    LANGUAGE_ARGS[:] = ["language", "--model-path", folder, "--encoder-urls", encode.url, "--max-total-tokens", "32768",
                        "--skip-server-warmup", "--enable-metrics"]
    # the second server on SGLang's defaults where the first names its own: its KV pool is this mode's
    # CPU default, and it warms up at start (also when it starts again, asleep, on its checkpoint)
    second_args = ["language", "--model-path", folder, "--encoder-urls", encode.url, "--enable-metrics",
                   "--checkpoint-dir", str(tmp_path_factory.mktemp("sglang-checkpoint")), "--admin-api-key", ADMIN_KEY]
    try:
        language, second_language = start_together(*(
            lambda args=args: WorkerProcess(*args, command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=300)
            for args in (LANGUAGE_ARGS, second_args)))
    except BaseException:
        encode.stop()
        raise
    SECOND.append(second_language)
    SECOND_ARGS[:] = second_args
    yield encode, language
    SECOND[-1].stop()
    language.stop()
    encode.stop()


ADMIN_KEY = "admin-key-for-the-tests"  # the encoder's and the second language server's --admin-api-key
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LANGUAGE_ARGS: list[str] = []  # how the module's language servers start
SECOND: list[WorkerProcess] = []  # the second language server (smg's second worker), the last started last
SECOND_ARGS: list[str] = []


@pytest.fixture(scope="module")
def video_reference(folder, model):
    return video_greedy(folder, model)


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    return write_clips(tmp_path_factory.mktemp("sglang-clips"))


@pytest.mark.parametrize("size", list(SIZES))
def test_greedy_ids_equal_monolithic(workers, images, reference, size) -> None:
    """448x448 fits the default allocation; 3840x2160 (10,560 image tokens) needs a resume round,
    and its prompt is prefilled in SGLang's chunks (4096 tokens by default; the chunks after the
    first attend to a cached prefix). ``meta_info`` carries the transfer beside SGLang's own."""
    _, language = workers
    meta = generate_as_reference(language, [images[size]], f"mono-{size}", reference)["meta_info"]
    assert meta["completion_tokens"] == NEW_TOKENS
    assert meta["resume_rounds"] == (1 if size == "3840x2160" else 0)
    assert meta["transfer_ms"] > 0 and meta["encode_ms"] > 0 and meta["cached_images"] == 0, meta


def test_two_images_in_one_prompt_equal_monolithic(workers, images, reference) -> None:
    _, language = workers
    generate_as_reference(language, [images["other"], images["448x448"]], "two-images", reference)


def test_the_comparison_catches_another_image(workers, images, reference) -> None:
    """The check above can fail on this path: the 448x448 picture's ids against the reference of
    the 640x336 one are rejected, at a step the comparison names."""
    _, language = workers
    answer = generate(language, [images["448x448"]], "another-image")
    assert answer.status_code == 200, answer.text
    why = greedy_mismatch(answer.json()["output_ids"], reference([images["other"]]))
    assert why is not None and why.startswith("step "), why


# Held-out media: random-pixel pictures drawn at run time, which no head seed was chosen for. A
# reference step's lead moved by at most 0.12 nats between a bf16 and a float32 forward of the
# same ids (docs/correctness.md); a picture is compared where its every step leads by twice that.
HELD_OUT_LEAD = 0.25
HELD_OUT_KEPT, HELD_OUT_DRAWS = 3, 60  # about one picture in four is kept (11 drawn for 3 in one run)


def test_random_pictures_drawn_at_run_time_equal_monolithic_where_the_reference_decides(
        workers, reference, tmp_path) -> None:
    """Random-pixel pictures of 224x224 to 1920x1080 from a seed of this run: those whose reference
    leads by HELD_OUT_LEAD at every step (chosen by the reference alone) give the stack's ids
    exactly; the seed and the pictures drawn are printed for a rerun."""
    import numpy as np
    from PIL import Image

    _, language = workers
    seed = time.time_ns() % 2**32
    rng = np.random.default_rng(seed)
    kept, drawn = [], []
    while len(kept) < HELD_OUT_KEPT and len(drawn) < HELD_OUT_DRAWS:
        width, height = int(rng.integers(224, 1921)), int(rng.integers(224, 1081))
        path = str(tmp_path / f"{len(drawn)}-{width}x{height}.png")
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        lead = float(reference([path]).margins().min())
        drawn.append((f"{width}x{height}", round(lead, 3)))
        if lead >= HELD_OUT_LEAD:
            kept.append(path)
    print(f"\nheld-out seed {seed}: drawn (size, smallest lead) {drawn}")
    assert len(kept) == HELD_OUT_KEPT, f"seed {seed}: {drawn}"
    for i, path in enumerate(kept):
        generate_as_reference(language, [path], f"held-out-{i}", reference)


def test_every_choice_of_an_n_2_request_uses_the_embedding_from_the_connector(workers, images, reference) -> None:
    """``n=2``: SGLang makes a batch of the request; each choice's images come through the
    connector (before, SGLang processed them itself, "falling back to local mm processing"), both
    greedy choices equal the reference, and each choice's ``meta_info`` (a fresh rid of SGLang's)
    carries the transfer its images took, streamed or not."""
    _, language = workers
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "n": 2}
    answer = generate(language, [images["other"]], "two-choices", sampling_params=params)
    assert answer.status_code == 200, answer.text
    choices = answer.json()
    assert len(choices) == 2, choices
    for choice in choices:
        assert greedy_mismatch(choice["output_ids"], reference([images["other"]])) is None
        meta = choice["meta_info"]  # from the embedding cache or not (the image came before in this module)
        assert meta["resume_rounds"] == 0 and {"transfer_ms", "encode_ms", "cached_images"} <= meta.keys(), meta
    streamed = generate(language, [images["other"]], "two-choices-streamed", sampling_params=params, stream=True)
    assert streamed.status_code == 200, streamed.text
    last = {}
    for line in streamed.text.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: "):])
            last[chunk["index"]] = chunk["meta_info"]
    assert sorted(last) == [0, 1] and all(meta["resume_rounds"] == 0 and "cached_images" in meta
                                          for meta in last.values()), last
    assert not [line for line in language.log if "falling back to local mm processing" in line]


def test_the_language_server_holds_no_vision_tower(workers) -> None:
    """Its model is built without the tower, whose weights are never loaded
    (``sglang_ext.no_encoder_tower``); every image test of this module passes through it."""
    _, language = workers
    dropped = [line for line in language.log if "built without its vision tower" in line]
    assert dropped and "Qwen2_5_VLForConditionalGeneration" in dropped[0], dropped


def test_videos_equal_monolithic(workers, clips, video_reference) -> None:
    """Each clip alone, then both in one prompt (two parts, one per video): SGLang's encoder
    samples and encodes them, the seconds per temporal patch come along for the positions."""
    _, language = workers
    for name, clip in clips.items():
        body = generate_videos(language, [clip], f"video-{name}")
        assert greedy_mismatch(body["output_ids"], video_reference([clip])) is None, name
    both = generate_videos(language, list(clips.values()), "two-videos")
    assert greedy_mismatch(both["output_ids"], video_reference(list(clips.values()))) is None
    assert both["meta_info"]["video_tokens"] == 4 * (10 * 14 + 9 * 16), both["meta_info"]
    assert video_reference([clips["392x280x8"]]).ids != video_reference([clips["448x252x120"]]).ids


def test_a_repeated_image_is_served_from_the_radix_cache(workers, images, reference) -> None:
    """Same image, same embedding, same hash: the second request's prompt is a cache hit."""
    _, language = workers
    first = generate(language, [images["1920x1080"]], "radix-1").json()
    second = generate(language, [images["1920x1080"]], "radix-2").json()
    assert second["output_ids"] == first["output_ids"]
    assert greedy_mismatch(first["output_ids"], reference([images["1920x1080"]])) is None
    assert second["meta_info"]["cached_tokens"] >= second["meta_info"]["prompt_tokens"] - 8, second["meta_info"]


def test_a_received_images_item_hash_is_the_connectors_digest_and_equals_sglangs_own(workers, tmp_path) -> None:
    """The first request's image is received: its item hash is the digest the connector took of
    the rows (SGLang does not hash them again). The second's comes from the embedding cache (rows
    joined anew, no digest): SGLang hashes it itself, and the prompt is a radix-cache hit, which
    it can only be if the two values are equal."""
    _, language = workers
    path = tmp_path / "digest.png"
    make_image(640, 480, seed=91).save(path)
    uri = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()  # the embedding cache keeps data: URIs
    first = generate(language, [uri], "digest-received").json()
    second = generate(language, [uri], "digest-cached").json()
    assert (first["meta_info"]["cached_images"], second["meta_info"]["cached_images"]) == (0, 1)
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= second["meta_info"]["prompt_tokens"] - 8, second["meta_info"]
    said = {rid: re.search(r"(\d+) item hash\(es\) from the connector's digest, (\d+) handed over", line).groups()
            for line in language.log for rid in ("digest-received", "digest-cached") if f"rid={rid}:" in line}
    assert said == {"digest-received": ("1", "1"), "digest-cached": ("0", "0")}, said
    assert not handover_segments(language), "the scheduler removes each segment it maps"


def handover_segments(language: WorkerProcess) -> list[str]:
    """The shared-memory segments SGLang's main process (the language server's pid) has made
    for its scheduler and that are still there (SGLang's names: ``sgl_shm_mm_<pid>_<random>``)."""
    assert "language" in " ".join(psutil.Process(language.proc.pid).cmdline())
    return [path.name for path in Path("/dev/shm").glob(f"sgl_shm_mm_{language.proc.pid}_*")]


def test_a_request_refused_after_its_embedding_arrived_leaves_no_shared_memory(workers, tmp_path) -> None:
    """Its embedding is handed over in shared memory made before SGLang checks the request; SGLang
    then refuses it (more tokens asked than the context holds): the segment, never sent to the
    scheduler, is removed when the request ends, and the server serves the next one."""
    _, language = workers
    path = str(tmp_path / "refused.png")
    make_image(640, 480, seed=93).save(path)
    refused = generate(language, [path], "handover-refused", new_tokens=10**7)
    assert refused.status_code == 400 and "context length" in refused.text, refused.text
    assert any("rid=handover-refused:" in line and "1 handed over in shared memory" in line for line in language.log)
    deadline = time.monotonic() + 10
    while handover_segments(language) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not handover_segments(language)
    assert generate(language, [path], "handover-next").status_code == 200


def test_metrics_are_sglangs_and_the_connectors(workers, images) -> None:
    """``/metrics`` (SGLang's, with ``--enable-metrics``) carries the connector's ``epd_*`` beside them."""
    _, language = workers
    assert generate(language, [images["448x448"]], "metrics").status_code == 200
    text = requests.get(f"{language.url}/metrics", timeout=30).text
    assert re.search(r"^sglang:prompt_tokens_total\{.*\} [1-9]", text, re.M), text[:3000]
    assert re.search(r'^epd_pool_blocks_free\{role="language"\} [1-9]', text, re.M), text[:3000]
    assert re.search(r'^epd_requests_total\{outcome="success",role="language"\} [1-9]', text, re.M), text


def test_metrics_show_each_series_once(workers, images) -> None:
    """A Prometheus scrape refuses a page with a series twice: SGLang's multiprocess files hold the
    connector's counters too, which its own registry shows already."""
    from prometheus_client.parser import text_string_to_metric_families

    _, language = workers
    assert generate(language, [images["448x448"]], "metrics-once").status_code == 200
    assert generate(language, ["/etc/shadow"], "metrics-refused").status_code == 400  # failure counters too
    text = requests.get(f"{language.url}/metrics", timeout=30).text
    series = [(s.name, tuple(sorted(s.labels.items()))) for family in text_string_to_metric_families(text)
              for s in family.samples]
    repeated = {key for key in series if series.count(key) > 1}
    assert not repeated and len(series) > 100, sorted(repeated)[:10]
    assert any(name.startswith("epd_") for name, _ in series) and any(name.startswith("sglang:") for name, _ in series)


def test_a_body_or_prompt_over_its_bound_is_refused_before_it_is_held(workers) -> None:
    """A body over ``--max-request-body-bytes`` (64 MiB) is 413 from its Content-Length before any
    byte of it is read, or, sent chunked, as soon as it passes the bound; a prompt too long for any
    context is 400 before SGLang tokenizes it (a 20 MB ``text`` held the process at 4.5 GB for a
    minute before). The server's memory stays where it was, and it serves on."""
    _, language = workers
    main = psutil.Process(language.proc.pid)
    rss_before = main.memory_info().rss
    host, port = language.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100000000\r\n\r\n")
        answer = b""
        while chunk := raw.recv(65536):  # the server closes the connection after its 413
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"--max-request-body-bytes" in answer, answer

    def chunks():
        for _ in range(64):
            yield b" " * (1 << 20)
        yield b"{"  # one byte over the bound

    started = time.monotonic()
    chunked = requests.post(f"{language.url}/generate", data=chunks(), timeout=60,
                            headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and "over this server's limit" in chunked.json()["message"], chunked.text
    text = json.dumps({"text": "hello world " * 1_700_000, "sampling_params": {"max_new_tokens": 1}})
    long_text = requests.post(f"{language.url}/generate", data=text, timeout=60,
                              headers={"Content-Type": "application/json"})
    assert long_text.status_code == 400 and "cannot fit the model's context" in long_text.text, long_text.text
    chat = requests.post(f"{language.url}/v1/chat/completions", timeout=60, json={
        "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hello " * 200_000}]})
    assert chat.status_code == 400 and "cannot fit the model's context" in chat.json()["message"], chat.text
    assert time.monotonic() - started < 30
    assert main.memory_info().rss - rss_before < 600 << 20
    assert generate(language, [], "after-bounds", text="Hello").status_code == 200


def test_more_images_than_the_cap_are_refused_before_any_encoder_is_asked(workers, images) -> None:
    """``--max-images-per-request`` (16, SGLang's ``--limit-mm-data-per-request``): 400 for a
    ``/generate`` with 17 images and a chat with 17 image parts; no part reaches an encoder."""
    from openai import BadRequestError, OpenAI

    _, language = workers

    def parts_sent() -> float:
        text = requests.get(f"{language.url}/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(r"^epd_encoder_parts_total\{.*\} (\S+)$", text, re.M))

    before = parts_sent()
    answer = generate(language, [images["448x448"]] * 17, "too-many-images")
    assert answer.status_code == 400 and "exceeds limit 16" in answer.text, answer.text
    client = OpenAI(base_url=f"{language.url}/v1", api_key="none", timeout=60, max_retries=0)
    part = {"type": "image_url", "image_url": {"url": f"file://{images['448x448']}"}}
    with pytest.raises(BadRequestError, match="exceeds limit 16"):
        client.chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": [part] * 17}])
    assert parts_sent() == before


def test_no_open_route_shows_a_secret_and_admin_routes_on_client_targets_need_the_key(workers) -> None:
    """With ``--admin-api-key``: ``/server_info`` and ``/get_server_info`` (open routes) and the log
    show no key, not even in ``launch_command``. Routes that act on a path, host or object the
    client names need the admin key: 401 without it, and 403 on a server started without one
    (SGLang leaves them open there)."""
    second, (_, language) = SECOND[-1], workers
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(f"{second.url}{path}", timeout=30)
        assert info.status_code == 200 and ADMIN_KEY not in info.text, path
        assert info.json()["admin_api_key"] == "<redacted>" and "--admin-api-key <redacted>" in info.json()[
            "launch_command"]
    assert not [line for line in second.log if ADMIN_KEY in line]
    body = {"model_path": "/etc"}
    assert requests.post(f"{second.url}/update_weights_from_disk", json=body, timeout=30).status_code == 401
    assert requests.post(f"{language.url}/update_weights_from_disk", json=body, timeout=30).status_code == 403
    assert requests.post(f"{language.url}/load_lora_adapter", timeout=30,
                         json={"lora_name": "x", "lora_path": "/etc"}).status_code == 403


def test_on_a_cpu_the_kv_pool_fits_the_machine(workers, folder) -> None:
    """Without ``--max-total-tokens`` our mode sizes SGLang's KV pool on a CPU (the smaller of 1/8
    of the memory and 4 contexts), says so when it starts, and the scheduler stays small (SGLang's
    own sizing took 6.3 M tokens, 15 GB resident)."""
    second = SECOND[-1]
    budget = cpu_kv_tokens(folder)
    assert requests.get(f"{second.url}/server_info", timeout=30).json()["max_total_tokens"] == budget.tokens
    assert any("this mode's CPU default" in line and f"{budget.tokens} tokens" in line for line in second.log)
    scheduler = max(psutil.Process(second.proc.pid).children(recursive=True), key=lambda p: p.memory_info().rss)
    assert scheduler.memory_info().rss < 4 << 30


def test_only_the_hosts_address_is_listened_on_by_sglangs_processes(workers) -> None:
    """``--host 127.0.0.1``: SGLang's scheduler and detokenizer listen on nothing else (its
    torch.distributed store listened on every interface; with one rank it is a file store now).
    The main process's other listeners are Mooncake's (docs/deployment.md: what each port accepts)."""
    _, language = workers
    for child in psutil.Process(language.proc.pid).children(recursive=True):
        listening = [c.laddr for c in child.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert all(addr.ip == "127.0.0.1" for addr in listening), (child.name(), listening)


def test_small_routes_and_refusals_say_whose_fault_it_is(workers) -> None:
    """``/is_sleeping`` is served; an encoder a two-request ``/generate`` names that is not
    allowed is refused (403) before it is contacted; an error answer quotes no server path or
    stack frame."""
    _, language = workers
    assert requests.get(f"{language.url}/is_sleeping", timeout=10).json() == {"is_sleeping": False}
    named = requests.post(f"{language.url}/generate", timeout=30, json={
        "text": "Hello", "bootstrap_host": "10.9.8.7", "bootstrap_port": 8998, "bootstrap_room": 7})
    assert named.status_code == 403 and "not an encoder this worker may contact" in named.text, named.text
    no_json = requests.post(f"{language.url}/generate", data=b'{"text": "hi"}', timeout=30)  # not application/json
    assert no_json.status_code == 400 and ".py" not in no_json.text and 'File \\"' not in no_json.text, no_json.text


def test_the_stream_is_sglangs_own(workers, images, reference) -> None:
    """``stream: true``: SGLang's events (``meta_info`` in each), ending in ``[DONE]``."""
    _, language = workers
    answer = requests.post(f"{language.url}/generate", stream=True, timeout=240, json={
        "rid": "stream", "text": prompt(1), "image_data": images["448x448"], "stream": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert answer.status_code == 200
    events = [line[len(b"data: "):] for line in answer.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["meta_info"]["resume_rounds"] == 0 and c["meta_info"]["transfer_ms"] > 0 for c in chunks), chunks
    ids = chunks[-1]["output_ids"] if len(chunks[-1]["output_ids"]) == NEW_TOKENS else \
        [t for c in chunks for t in c["output_ids"]]
    assert greedy_mismatch(ids, reference([images["448x448"]])) is None


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch(workers, images, reference) -> None:
    """``sampling_seed`` (the OpenAI routes' ``seed``) at temperature 1: the same ids alone and
    among four other sampled requests of other images and seeds and a greedy one (SGLang alone
    draws from its process-wide generator, and hashes a row's noise in a way its neighbours
    choose: ``sglang_ext/seeds.py``); another seed draws others. The greedy request in the mix
    equals transformers' monolithic ids up to a near tie: its logits may differ in the last bits
    with its batch on a CPU (SGLang's batch-invariant kernels are GPU-only), which a near tie
    can turn into another id (see docs/sglang_language_side.md)."""
    _, language = workers

    def sampled(path: str, seed: int, rid: str) -> list[int]:
        answer = generate(language, [path], rid, sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        return answer.json()["output_ids"]

    alone = sampled(images["448x448"], 1234, "seed-alone")
    others = [images["other"], images["1920x1080"], images["other"], images["448x448"]]
    with ThreadPoolExecutor(6) as pool:
        mixed = pool.submit(sampled, images["448x448"], 1234, "seed-mixed")
        greedy = pool.submit(generate, language, [images["1920x1080"]], "seed-greedy-mixed")
        for i, path in enumerate(others):
            pool.submit(sampled, path, 77 + i, f"seed-other-{i}")
    assert mixed.result() == alone
    assert greedy_mismatch(greedy.result().json()["output_ids"], reference([images["1920x1080"]])) is None
    assert sampled(images["448x448"], 1235, "seed-other-seed") != alone
    from openai import OpenAI

    client = OpenAI(base_url=f"{language.url}/v1", api_key="none", timeout=120, max_retries=0)
    content = [{"type": "image_url", "image_url": {"url": images["448x448"]}}, {"type": "text", "text": "Hi"}]
    chats = [client.chat.completions.create(model="m", max_tokens=8, temperature=1.0, seed=99, logprobs=True,
                                            messages=[{"role": "user", "content": content}]) for _ in range(2)]
    assert [t.token for t in chats[0].choices[0].logprobs.content] == \
        [t.token for t in chats[1].choices[0].logprobs.content]


def test_the_openai_client_gets_logprobs_and_n(workers, images, reference, folder) -> None:
    from openai import OpenAI

    _, language = workers
    data = base64.b64encode(open(images["448x448"], "rb").read()).decode()
    client = OpenAI(base_url=f"{language.url}/v1", api_key="none", timeout=240, max_retries=0)
    reply = client.chat.completions.create(
        model=folder, max_tokens=NEW_TOKENS, temperature=0, logprobs=True, top_logprobs=2, n=2,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                                               {"type": "text", "text": "Describe it."}]}],
        extra_body={"ignore_eos": True})
    assert len(reply.choices) == 2
    assert reply.usage.completion_tokens == 2 * NEW_TOKENS
    for choice in reply.choices:
        assert len(choice.logprobs.content) == NEW_TOKENS
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_sglangs_benchmark_client_gets_every_token(workers, folder, tmp_path) -> None:
    """SGLang's own benchmark client, unmodified, with backends ``sglang`` and ``sglang-oai-chat`` on
    its image dataset (448x448) and ``sglang-oai`` on random ids (the image dataset refuses that
    backend itself), the three at once: 8 requests each, every one successful with exactly its 16
    tokens (the client sends ignore_eos)."""
    _, language = workers
    runs = {}
    for backend, dataset in (("sglang", "image"), ("sglang-oai-chat", "image"), ("sglang-oai", "random-ids")):
        (tmp_path / backend).mkdir()
        runs[backend] = subprocess.Popen(
            [sys.executable, "-m", "sglang.benchmark.serving", "--backend", backend, "--host", "127.0.0.1", "--port",
             str(language.port), "--model", folder, "--tokenizer", folder, "--dataset-name", dataset, "--num-prompts",
             "8", "--image-count", "1", "--image-resolution", "448x448", "--random-input-len", "32",
             "--random-output-len", "16", "--random-range-ratio", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, cwd=tmp_path / backend)  # it writes a results file
    for backend, run in runs.items():
        out, _ = run.communicate(timeout=240)
        assert run.returncode == 0, f"{backend}: {out[-3000:]}"
        assert re.search(r"^Successful requests:\s+8\s*$", out, re.M), f"{backend}: {out[-3000:]}"
        assert re.search(r"^Total generated tokens:\s+128\s*$", out, re.M), f"{backend}: {out[-3000:]}"


def test_aiperf_gets_every_token_of_streamed_image_chats(workers, folder, tmp_path) -> None:
    """NVIDIA's AIPerf, unmodified, as a user runs it (``scripts/setup.sh`` installs it in
    ``.venv-aiperf``): OpenAI chats with one synthetic 640x480 PNG each, streamed, 3 at a time, 6
    requests: every one completed without an error, each with its 8 tokens (counted by the
    server; ``ignore_eos``)."""
    _, language = workers
    aiperf = Path(__file__).resolve().parent.parent / ".venv-aiperf" / "bin" / "aiperf"
    out = subprocess.run(
        [str(aiperf), "profile", "--model", "qwen", "--url", language.url, "--endpoint-type", "chat", "--streaming",
         "--tokenizer", folder, "--image-width-mean", "640", "--image-height-mean", "480", "--image-batch-size", "1",
         "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "8", "--extra-inputs", "ignore_eos:true",
         "--use-server-token-count", "--concurrency", "3", "--request-count", "6", "--artifact-dir", str(tmp_path),
         "--ui-type", "none"], capture_output=True, text=True, timeout=240,
        # AIPerf refuses a tokenizer path with HF_HUB_OFFLINE set (the suite sets it: no hub is reached)
        env={k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert result["is_complete"] and result["error_summary"] == [], result["error_summary"]
    assert result["request_count"]["avg"] == 6, result["request_count"]
    assert result["output_sequence_length"]["min"] == result["output_sequence_length"]["max"] == 8


def test_guidellm_gets_every_token_of_streamed_image_chats(workers, tmp_path) -> None:
    """GuideLLM, unmodified, as a user runs it (``scripts/setup.sh`` installs it in
    ``.venv-guidellm``): OpenAI chats from a local JSONL file, one 640x480 image each (GuideLLM
    sends it as a JPEG data URL), streamed, 3 at a time, 6 requests of 8 tokens each (its
    ``output_tokens_count`` column: ``max_completion_tokens`` and ``ignore_eos``): every one
    succeeded, none errored, each with its 8 tokens and its image's tokens as the server counted
    them."""
    _, language = workers
    rows = []
    for i in range(6):
        make_image(640, 480, seed=700 + i).save(tmp_path / f"{i}.png")
        rows.append(json.dumps({"prompt": f"Describe picture {i}.", "image": str(tmp_path / f"{i}.png"),
                                "output_tokens_count": 8}))
    (tmp_path / "chats.jsonl").write_text("\n".join(rows) + "\n")
    guidellm = Path(__file__).resolve().parent.parent / ".venv-guidellm" / "bin" / "guidellm"
    out = subprocess.run(
        [str(guidellm), "run", "--backend", f"kind=openai_http,target={language.url},model=qwen",
         "--data", f"kind=json_file,path={tmp_path / 'chats.jsonl'}", "--profile", "kind=concurrent,streams=3",
         "--constraint", "kind=max_requests,count=6", "--output", f"kind=json,path={tmp_path / 'report.json'}",
         "--disable-console-interactive"], capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    benchmark = json.loads((tmp_path / "report.json").read_text())["benchmarks"][0]
    totals = benchmark["metrics"]["request_totals"]
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (6, 0, 0), (
        totals, [r.get("info") for r in benchmark["requests"]["errored"]][:2])
    done = benchmark["requests"]["successful"]
    assert [r["output_tokens"] for r in done] == [8] * 6
    # Each carried its image: 640x480 pixels sent, and the server counted its few hundred tokens
    # besides the few of the text.
    assert all(r["input_metrics"]["image_pixels"] == 640 * 480 and r["prompt_tokens"] > 300 for r in done), [
        (r["input_metrics"]["image_pixels"], r["prompt_tokens"]) for r in done]


# sglang.srt.entrypoints.http_server.HEALTH_CHECK_TIMEOUT (SGLANG_HEALTH_CHECK_TIMEOUT): how long
# SGLang's own /health handler waits for a token (importing the module here takes seconds)
SGLANG_HEALTH_WAIT_S = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))


def wait_until_encoding(encode: WorkerProcess, timeout: float = 30.0) -> None:
    """Until the encoder holds an ``/encode`` (its ``/health``'s ``pending``): the language server
    registered the request and its room before it asked (a 4K image then takes seconds there)."""
    deadline = time.monotonic() + timeout
    while encoder_health(encode)["pending"] == 0:
        assert time.monotonic() < deadline, f"no /encode reached the encoder within {timeout:g} s"
        time.sleep(0.05)


def assert_asleep_health(language) -> None:
    """SGLang's ``/health`` and ``/health_generate`` of a sleeping server: 503 at once (its own
    handler would wait ``SGLANG_HEALTH_WAIT_S`` for a token), saying so, with ``Retry-After``."""
    for path in ("/health", "/health_generate"):
        began = time.monotonic()
        answer = requests.get(f"{language.url}{path}", timeout=2 * SGLANG_HEALTH_WAIT_S)
        # halfway to the handler's wait: not waited out, however loaded the machine
        assert time.monotonic() - began < SGLANG_HEALTH_WAIT_S / 2, (path, time.monotonic() - began)
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "5", (path, answer.text)
        assert answer.json()["sleeping"] is True, answer.text


def test_sleep_and_wake_keep_a_request_waiting_for_its_embedding(workers, images, reference) -> None:
    """``/sleep?preserve_state=true`` while a 4K image is at the encoder: SGLang pauses
    (retract), the connector keeps the room and releases its pool; after ``/wake_up`` the
    transfer goes on (with its resume round) and the answer equals monolithic. A request that
    arrives meanwhile gets 503 with ``Retry-After``, and so does ``/health``, at once."""
    encode, language = workers
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, language, [images["3840x2160"]], "sleep-transfer")
        wait_until_encoding(encode)  # the request and its room are the server's: the sleep keeps them
        slept = requests.post(f"{language.url}/sleep", params={"preserve_state": "true"}, timeout=120)
        assert slept.status_code == 200, slept.text
        assert slept.json()["is_sleeping"] and slept.json()["kept_requests"] == 1, slept.json()
        refused = generate(language, [images["448x448"]], "while-asleep")  # a new one is refused meanwhile
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", (refused.headers, refused.text)
        assert "asleep" in refused.json()["error"]["message"], refused.text
        assert_asleep_health(language)
        time.sleep(1.0)
        assert not pending.done()
        woke = requests.post(f"{language.url}/wake_up", timeout=120)
        assert woke.status_code == 200 and woke.json()["is_sleeping"] is False, woke.text
        assert requests.get(f"{language.url}/health", timeout=30).status_code == 200
        answer = pending.result(timeout=240)
    assert answer.status_code == 200, answer.text
    assert greedy_mismatch(answer.json()["output_ids"], reference([images["3840x2160"]])) is None
    assert answer.json()["meta_info"]["resume_rounds"] >= 1  # its resume round, and one more after the wake-up


@pytest.mark.serial  # it times when tokens arrive
def test_sleep_and_wake_mid_decode_lose_no_token(workers, images, reference) -> None:
    """Four greedy streams (one batch request, so SGLang schedules them together both times)
    asleep at level 1 (SGLang pauses in place, KV kept) after their third token end with exactly
    the ids the same four streams get without a sleep: the sleep changes no token. Each stream
    equals monolithic's 160 ids as ``monolithic.long_run_mismatch`` compares a long run (up to
    a step whose reference lead is within one bf16 step of its logit, if one comes)."""
    _, language = workers
    new_tokens = 160
    paths = [images["448x448"], images["other"], images["1920x1080"], images["448x448"]]
    body = {"text": [prompt(1)] * 4, "image_data": [[p] for p in paths],
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    answer = requests.post(f"{language.url}/generate", stream=True, timeout=240,
                           json=body | {"rid": [f"sleep-decode-{i}" for i in range(4)], "stream": True})
    chunks: list[tuple[float, dict]] = []  # (arrival, event)
    started = threading.Event()

    def read() -> None:
        for line in answer.iter_lines():
            if line.startswith(b"data: {"):
                chunks.append((time.monotonic(), json.loads(line[6:])))
                if len(chunks) == 3 * 4:
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(120)
    arrivals = [t for t, _ in chunks[:12]]
    step = max(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))  # a decode step of the four
    slept = requests.post(f"{language.url}/sleep", params={"preserve_state": "true"}, timeout=120)
    asleep_at = time.monotonic()
    assert slept.status_code == 200, slept.text
    # No token while asleep. Tokens made before the pause may still be on their way: they are in
    # once none came for ten decode steps (and half a second, a token's way to this client);
    # decoding that went on would send one every step. Then none for the rest of the sleep.
    quiet = max(10 * step, 0.5)
    while time.monotonic() - chunks[-1][0] < quiet:
        assert time.monotonic() - asleep_at < 10, [round(t - asleep_at, 3) for t, _ in chunks]  # they kept coming
        time.sleep(0.05)
    drained = len(chunks)
    time.sleep(1.0)
    woke_at = time.monotonic()
    assert len(chunks) == drained, [round(t - asleep_at, 3) for t, _ in chunks]
    assert requests.post(f"{language.url}/wake_up", timeout=120).status_code == 200
    reader.join(240)
    assert any(t > woke_at for t, _ in chunks)  # it was mid-decode: tokens came after the wake-up
    streams: dict[int, list[dict]] = {}
    for _, chunk in chunks:
        streams.setdefault(chunk.get("index", 0), []).append(chunk)
    slept_ids = []
    for index in range(4):
        final = streams[index][-1]
        assert final["meta_info"]["completion_tokens"] == new_tokens
        assert final["meta_info"]["num_retractions"] == 0  # in place: nothing recomputed
        slept_ids.append(final["output_ids"] if len(final["output_ids"]) == new_tokens
                         else [t for c in streams[index] for t in c["output_ids"]])
    awake = requests.post(f"{language.url}/generate", timeout=240,
                          json=body | {"rid": [f"no-sleep-decode-{i}" for i in range(4)]})
    assert awake.status_code == 200, awake.text
    assert slept_ids == [out["output_ids"] for out in awake.json()]
    compared = []
    for ids, path in zip(slept_ids, paths, strict=True):
        why, steps = long_run_mismatch(ids, reference([path], new_tokens))
        assert why is None, why
        compared.append(steps)
    print(f"\nlevel-1 sleep mid-decode: 4 x {new_tokens} ids equal without the sleep; steps equal to "
          f"monolithic's: {compared}")


def test_a_level_2_sleep_retracts_and_every_token_still_comes(workers, images, reference) -> None:
    """Level 2: SGLang retracts the running stream (its KV freed) and releases its memory
    occupation; after the wake-up it recomputes the KV by a prefill (where the run without a sleep
    decoded step by step) and the stream ends with the ids of that run. The recomputation rounds
    otherwise, each logit at most ``RECOMPUTED_LOGIT_STEPS`` bf16 steps away: the chosen tokens'
    log-probabilities move by no more than that allows (:func:`recompute_moves`), at the
    magnitudes of transformers' monolithic run of the same ids. The ids are equal at every step,
    unless one comes where the run without a sleep led its runner-up by no more than the two
    logits' moves (a near tie the rounding may turn): the comparison ends there."""
    _, language = workers
    new_tokens = 160
    awake = generate(language, [images["448x448"]], "no-sleep-l2", return_logprob=True, top_logprobs_num=2,
                     sampling_params={"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}).json()
    monolithic = reference([images["448x448"]], new_tokens)
    why, same = long_run_mismatch(awake["output_ids"], monolithic)  # its steps are those of the same tokens
    assert why is None, why

    def compared(values: torch.Tensor) -> list[float]:
        """Per step; past a near tie where the reference parted from the stack, the largest before it."""
        return [float(values[i] if i < same else values[:max(same, 1)].max()) for i in range(new_tokens)]

    bound = compared(recompute_moves(monolithic))
    tie = compared(2 * RECOMPUTED_LOGIT_STEPS * monolithic.logit_steps())  # the chosen and the runner-up's moves
    answer = requests.post(f"{language.url}/generate", stream=True, timeout=240, json={
        "rid": "sleep-l2", "text": prompt(1), "image_data": images["448x448"], "stream": True, "return_logprob": True,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})
    chunks: list[dict] = []
    lines = answer.iter_lines()
    for line in lines:
        if line.startswith(b"data: {"):
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 3:
                break
    slept = requests.post(f"{language.url}/sleep", params={"level": "2", "preserve_state": "true"}, timeout=120)
    assert slept.status_code == 200, slept.text
    assert slept.json()["level"] == 2 and slept.json()["is_sleeping"]
    before = [t for c in chunks for t in c["output_ids"]]
    assert requests.post(f"{language.url}/wake_up", timeout=120).status_code == 200
    for line in lines:
        if line.startswith(b"data: {"):
            chunks.append(json.loads(line[6:]))
    final = chunks[-1]
    assert final["meta_info"]["completion_tokens"] == new_tokens
    ids = final["output_ids"] if len(final["output_ids"]) == new_tokens else [t for c in chunks for t in c["output_ids"]]
    assert len(ids) == new_tokens and ids[:len(before)] == awake["output_ids"][:len(before)]
    parted = next((i for i, (a, b) in enumerate(zip(ids, awake["output_ids"], strict=True)) if a != b), new_tokens)
    if parted < new_tokens:
        top = awake["meta_info"]["output_top_logprobs"][parted]
        assert top[0][0] - top[1][0] <= tie[parted], (parted, top[:2], tie[parted], ids, awake["output_ids"])
    logprobs = final["meta_info"]["output_token_logprobs"]
    if len(logprobs) != new_tokens:
        logprobs = [entry for c in chunks for entry in c["meta_info"]["output_token_logprobs"]]
    moved = [abs(ours[0] - theirs[0]) for ours, theirs in zip(logprobs, awake["meta_info"]["output_token_logprobs"],
                                                             strict=True)][:parted]
    ratios = [m / b for m, b in zip(moved, bound[:parted], strict=True)]
    print(f"\nlevel-2 recompute: chosen log-probabilities moved by at most {max(moved):.4f} nats, "
          f"{max(ratios):.3f} of what the rounding allows ({sum(m > 0 for m in moved)} of {parted} steps "
          f"moved; ids equal for {parted} of {new_tokens} steps, the reference's for {same})")
    assert max(ratios) <= 1, [(i, round(m, 4), bound[i]) for i, m in enumerate(moved) if m > bound[i]]


# How many bf16 steps (of its own magnitude) a logit recomputed by a prefill may land from where the
# decode put it: the two round values that differ already (the recompute's hidden state rounds
# otherwise), by up to a step, and their roundings by up to one more. Measured with the sleep after
# 3 to 130 tokens: one step at most (the chosen logit's move), never two.
RECOMPUTED_LOGIT_STEPS = 2


def recompute_moves(reference: Greedy) -> torch.Tensor:
    """Per step, how far the chosen token's log-probability, ``z_c - logsumexp(z)``, moves when
    every logit lands at most ``RECOMPUTED_LOGIT_STEPS`` bf16 steps away: that many steps of the
    chosen logit, plus the log-sum-exp's move, the probability-weighted mean of every logit's (the
    chosen logit does not dominate it: this checkpoint's distributions are flat). The magnitudes
    are the reference's logits: its log-probabilities plus the log-sum-exp its chosen logit gives."""
    chosen = reference.logprobs.gather(1, torch.tensor(reference.ids)[:, None])[:, 0]
    logits = reference.logprobs + (reference.chosen_logits - chosen)[:, None]
    probs = reference.logprobs.exp()
    spread = torch.where(probs > 0, probs * bf16_step(logits), 0).sum(-1)
    return RECOMPUTED_LOGIT_STEPS * (reference.logit_steps() + spread)


def test_abort_reaches_a_request_waiting_for_its_embedding(workers, images) -> None:
    """SGLang's ``/abort_request`` for a request whose 4K image is still at the encoder: the
    client is answered at once and the connector's room ends (its pool is all free again)."""
    encode, language = workers
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, language, [images["3840x2160"]], "abort-waiting")
        wait_until_encoding(encode)  # the rid is the server's: an abort before it would find nothing
        aborted_at = time.monotonic()
        assert requests.post(f"{language.url}/abort_request", json={"rid": "abort-waiting"}, timeout=30).status_code \
            == 200
        answer = pending.result(timeout=60)
    assert time.monotonic() - aborted_at < 10
    assert answer.status_code == 499, answer.text
    assert "aborted by /abort_request" in answer.json()["error"]["message"]
    deadline = time.monotonic() + 30
    while not all_free(health := requests.get(f"{language.url}/epd/health", timeout=10).json()) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert all_free(health), health


def all_free(health: dict) -> bool:
    return health["free_blocks"] == health["num_blocks"] and not health["transferring"] and not health["queued"]


def test_smg_in_front_of_two_language_workers_answers_as_they_do(workers, folder, images, tmp_path) -> None:
    """The smg gateway (plain routing, round robin over ``--worker-urls``) in front of two
    SGLang language workers fed by one encoder: native and OpenAI answers through it equal the
    direct ones, and both workers serve."""
    encode, language = workers
    direct = generate(language, [images["other"]], "smg-direct").json()["output_ids"]
    second = SECOND[-1]
    with smg_gateway([language.url, second.url], tmp_path / "smg.log") as url:
        body = {"text": prompt(1), "image_data": images["other"],
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
        for i in range(4):
            answer = requests.post(f"{url}/generate", json=body | {"rid": f"smg-{i}"}, timeout=240)
            assert answer.status_code == 200, answer.text
            assert answer.json()["output_ids"] == direct
        served = [sum(f"rid=smg-{i}:" in line for i in range(4) for line in w.log) for w in (language, second)]
        assert all(served) and sum(served) == 4, served
        data = base64.b64encode(open(images["other"], "rb").read()).decode()
        chat = {"model": folder, "max_tokens": NEW_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
            {"type": "text", "text": "Describe it."}]}]}
        answers = [requests.post(f"{u}/v1/chat/completions", json=chat, timeout=240) for u in (language.url, url, url)]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        texts = [a.json()["choices"][0]["message"]["content"] for a in answers]
        assert texts[0] == texts[1] == texts[2]


def test_a_language_server_killed_asleep_restarts_from_disk_and_its_requests_go_on(workers, images, reference) -> None:
    """``/sleep?level=2&preserve_state=true`` with ``--checkpoint-dir`` while one stream decodes and
    a 4K image is still at the encoder and the two choices of an ``n=2`` request decode, then kill
    -9 and a start on the same folder: the server boots asleep (a new request gets 503), and after
    ``/wake_up`` all go on; each client asking again by rid (a choice: by its own) gets the whole
    output, and the choices' image is not encoded again. The server starts on SGLang's defaults: its warm-up (a
    generation, which a sleeping server refuses, and whose failure ended SGLang's server) is
    skipped when it starts asleep. The 4K answer equals monolithic; the stream and each choice
    end with exactly the ids the same requests got from the server before the sleep, without
    one (the restart recomputes their KV by a prefill from the checkpointed tokens)."""
    language = SECOND[-1]
    new_tokens = 600  # still decoding when the sleep comes
    decode_body = {"rid": "restart-decode", "text": prompt(1), "image_data": images["448x448"], "stream": True,
                   "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    choices_body = {"rid": "restart-n2", "text": prompt(1), "image_data": images["other"], "stream": True,
                    "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "n": 2}}
    big_body = {"rid": "restart-4k", "text": prompt(1), "image_data": [images["3840x2160"]],
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(2) as pool:  # the same requests without the fault, side by side
        baselines = [pool.submit(requests.post, f"{language.url}/generate", timeout=600,
                                 json={**body, "stream": False, "rid": f"baseline-{i}"})
                     for i, body in enumerate((decode_body, choices_body))]
        baseline_ids = []
        for baseline in baselines:
            assert baseline.result().status_code == 200, baseline.result().text
            out = baseline.result().json()
            baseline_ids.append((out if isinstance(out, dict) else out[0])["output_ids"])
    before: list[int] = []
    answer = requests.post(f"{language.url}/generate", stream=True, timeout=240, json=decode_body)
    lines = answer.iter_lines()  # kept: a dropped reader would close the stream, and SGLang would abort it
    for line in lines:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            before = event["output_ids"] if len(event["output_ids"]) > len(before) else before + event["output_ids"]
            if len(before) >= 3:
                break
    # an n=2 request decoding too: each choice (a rid of SGLang's, in its meta_info) is kept with
    # the embedding the request received, and goes on as one generation
    choices = requests.post(f"{language.url}/generate", stream=True, timeout=240, json=choices_body)
    choice_lines, choice_rids = choices.iter_lines(), {}  # kept, as above
    for line in choice_lines:
        if line.startswith(b"data: {") and (event := json.loads(line[6:]))["output_ids"]:
            choice_rids[event["index"]] = event["meta_info"]["id"]
            if len(choice_rids) == 2:
                break
    with ThreadPoolExecutor(1) as pool:
        pool.submit(requests.post, f"{language.url}/generate", json=big_body, timeout=60)  # dies with the kill
        wait_until_encoding(workers[0])  # the 4K's request and room are the server's: the sleep keeps them
        refused = requests.post(f"{language.url}/sleep", params={"level": "2", "preserve_state": "true"}, timeout=60)
        assert refused.status_code == 401, refused.text  # --admin-api-key: SGLang's middleware guards our routes
        slept = requests.post(f"{language.url}/sleep", params={"level": "2", "preserve_state": "true"}, timeout=120,
                              headers=ADMIN)
        assert slept.status_code == 200, slept.text
        assert slept.json()["checkpointed_generations"] == 4 and slept.json()["kept_requests"] == 1, slept.json()
        for process in [*psutil.Process(language.proc.pid).children(recursive=True), psutil.Process(language.proc.pid)]:
            process.kill()
        language.proc.wait()
    restarted = WorkerProcess(*SECOND_ARGS, command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=300)
    SECOND.append(restarted)
    # SGLang's launcher froze GC once warm by asking the paused scheduler (10 s, then a traceback):
    # answered at once while asleep, done at the wake-up
    assert not [line for line in restarted.log if "freeze_gc failed" in line], restarted.log[-20:]
    refused = generate(restarted, [images["448x448"]], "asleep-on-start")
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "5", refused.text
    assert_asleep_health(restarted)
    assert requests.post(f"{restarted.url}/wake_up", timeout=60).status_code == 401
    woke = requests.post(f"{restarted.url}/wake_up", timeout=120, headers=ADMIN)
    assert woke.status_code == 200, woke.text
    big = requests.post(f"{restarted.url}/generate", json=big_body, timeout=240)
    assert big.status_code == 200, big.text
    assert greedy_mismatch(big.json()["output_ids"], reference([images["3840x2160"]])) is None
    again = requests.post(f"{restarted.url}/generate", json=decode_body, timeout=240, stream=True)
    events = [json.loads(line[6:]) for line in again.iter_lines() if line.startswith(b"data: {")]
    ids, meta = events[-1]["output_ids"], events[-1]["meta_info"]
    assert len(ids) == new_tokens and meta["completion_tokens"] == new_tokens, meta
    assert meta["restored_tokens"] >= len(before) and ids[:len(before)] == before
    assert ids == baseline_ids[0]
    for rid in choice_rids.values():  # each choice, asked for by its rid
        choice = requests.post(f"{restarted.url}/generate", timeout=240, json={**choices_body, "rid": rid, "stream": False,
                                                                              "sampling_params": {"max_new_tokens": 1}})
        assert choice.status_code == 200, choice.text
        ids, meta = choice.json()["output_ids"], choice.json()["meta_info"]
        assert len(ids) == new_tokens and meta["restored_tokens"] >= 1, meta
        assert ids == baseline_ids[1]
    # only the 4K image, still at the encoder at the sleep, was encoded again; the choices had theirs
    assert metric(restarted, "epd_encoder_parts_total") == 1
    assert all_free(requests.get(f"{restarted.url}/epd/health", timeout=10).json())
    folder = Path(SECOND_ARGS[SECOND_ARGS.index("--checkpoint-dir") + 1])
    assert not any(folder.iterdir())  # every checkpoint consumed


def test_a_bad_checkpoint_on_disk_is_refused_and_dropped_when_the_wake_up_asks(workers, tmp_path) -> None:
    """A server started on a folder whose checkpoint of SGLang's generations does not check (its
    checksum) boots asleep; ``/wake_up`` refuses it whole (422, saying how to drop it) and leaves
    it asleep; ``/wake_up?discard_checkpoint=true`` drops it and the server serves."""
    folder = tmp_path / "bad-checkpoint"
    folder.mkdir()
    for suffix, data in ((".json", b'{"version": 1}'), (".safetensors", b"not a tensor file"), (".sha256", b"0" * 64)):
        (folder / f"{GENERATIONS_ROLE}{suffix}").write_bytes(data)
    server = WorkerProcess(*LANGUAGE_ARGS, "--checkpoint-dir", str(folder), command=SGLANG_LAUNCH, ready=SGLANG_READY,
                           timeout=300)
    try:
        assert requests.get(f"{server.url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        refused = requests.post(f"{server.url}/wake_up", timeout=60)
        assert refused.status_code == 422 and "discard_checkpoint=true" in refused.json()["error"], refused.text
        assert requests.get(f"{server.url}/is_sleeping", timeout=10).json() == {"is_sleeping": True}
        woke = requests.post(f"{server.url}/wake_up", params={"discard_checkpoint": "true"}, timeout=60)
        assert woke.status_code == 200 and woke.json()["is_sleeping"] is False, woke.text
        assert not any(folder.iterdir())
        text = requests.post(f"{server.url}/generate", timeout=120, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert text.status_code == 200 and len(text.json()["output_ids"]) == 4, text.text
    finally:
        server.stop()


def test_an_image_the_encoder_refuses_is_the_clients_error(workers, images) -> None:
    """The encoder's 400 passes through; a prompt whose placeholders the images do not fill is 400
    too, not a server error."""
    _, language = workers
    mismatch = generate(language, [images["448x448"]], "mismatch", text="<|video_pad|> hi")
    assert mismatch.status_code == 400, mismatch.text
    assert "placeholders do not match its 1 image(s), 0 video(s), 0 audio(s)" in mismatch.json()["error"]["message"]
    answer = generate(language, ["/etc/shadow"], "refused")
    assert answer.status_code == 400, answer.text
    assert "only read inside --allowed-local-media-path" in answer.json()["error"]["message"]
    assert generate(language, [], "text-after", text="Hello").status_code == 200


def test_the_encoders_sleep_and_wake_need_its_admin_key(workers) -> None:
    """``--admin-api-key`` on our encode worker: /sleep and /wake_up without it (or with another
    key) are 401 and change nothing; with it they work. (The language servers' are SGLang's
    middleware's, in the restart test.)"""
    encode, _ = workers
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
        refused = requests.post(f"{encode.url}/sleep", params={"preserve_state": "true"}, headers=headers, timeout=60)
        assert refused.status_code == 401 and "admin API key" in refused.json()["error"], refused.text
        assert requests.post(f"{encode.url}/wake_up", headers=headers, timeout=60).status_code == 401
    assert encoder_health(encode)["state"] == "awake"
    slept = requests.post(f"{encode.url}/sleep", params={"preserve_state": "true"}, headers=ADMIN, timeout=60)
    assert slept.status_code == 200 and slept.json()["is_sleeping"], slept.text
    woke = requests.post(f"{encode.url}/wake_up", headers=ADMIN, timeout=60)
    assert woke.status_code == 200 and not woke.json()["is_sleeping"], woke.text


def test_an_encoders_death_is_a_clear_error_and_the_server_lives_on(workers, images, tmp_path) -> None:
    """Last in the module: the encoder is stopped. Its request is answered at once: 502 when it reaches
    the dead encoder before the background probe does (the encoder failed it), 503 when the probe took
    the encoder out of rotation first; the next ones 503 with Retry-After (no encoder answers /health:
    come back later); SGLang's server keeps serving text. (The chat's image is one never sent before: an
    image sent as a data: URI earlier would come from the embedding cache, no encoder needed.)"""
    encode, language = workers
    encode.stop()
    started = time.monotonic()
    answer = generate(language, [images["448x448"]], "no-encoder")
    assert time.monotonic() - started < 10, "a dead encoder's request waited"
    assert answer.status_code in (502, 503), answer.text
    assert "no encoder could encode" in answer.json()["error"]["message"]
    if answer.status_code == 503:
        assert "no encoder answers /health" in answer.json()["error"]["message"], answer.text
    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=f"{language.url}/v1", api_key="none", timeout=60, max_retries=0)
    make_image(448, 448, seed=99).save(tmp_path / "never-sent.png")
    data = base64.b64encode((tmp_path / "never-sent.png").read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]
    for stream in (False, True):  # the same status as /generate's on the OpenAI route, streamed or not
        with pytest.raises(APIStatusError, match="no encoder answers /health") as refused:
            client.chat.completions.create(model="m", max_tokens=2, stream=stream,
                                           messages=[{"role": "user", "content": content}])
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"]
    text = generate(language, [], "text-only", text="Hello")
    assert text.status_code == 200 and len(text.json()["output_ids"]) == NEW_TOKENS
