"""The two-request flow on SGLang's own server: a router sends ``/encode`` (the images, a room)
to an encoder and ``/generate`` (the prompt's placeholders, the encoder's bootstrap address and
the room) to the language server, which was started without ``--encoder-urls`` and takes any
encoder ``--allowed-bootstrap-hosts`` allows. The generated ids are checked against
transformers' monolithic ``generate`` from the pixels; the reference fork's sender is checked
byte for byte; an abort of either half ends the other.
"""

from __future__ import annotations

import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
from fork_peers import ForkEncoder
from monolithic import greedy_mismatch
from sglang_stack import NEW_TOKENS, encoder_health, generate, image_reference, prompt, write_images
from transfer_large_image import make_image
from transformers import AutoTokenizer

from connector.buffers import Embedding
from connector.config import ConnectorConfig
from embedding_side.positions import image_positions
from harness.workers import WorkerProcess, start_together

pytestmark = pytest.mark.sglang

FIRST_ALLOCATION = 1024  # tokens: a 1920x1080 image (2,040 tokens) takes a resume round


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("two-request-images"))


@pytest.fixture(scope="module")
def workers(folder):
    """SGLang's encoder in our encode worker, and SGLang's language server with no
    ``--encoder-urls`` (its ``--allowed-bootstrap-hosts`` is loopback: ``WorkerProcess``'s),
    started side by side."""
    started = start_together(
        lambda: WorkerProcess("encode", "--model-path", folder, timeout=300),
        lambda: WorkerProcess("language", "--model-path", folder, "--max-total-tokens", "32768", "--skip-server-warmup",
                              "--embedding-default-allocate-buffer-size", str(FIRST_ALLOCATION), timeout=300))
    yield started
    for worker in reversed(started):
        worker.stop()


@pytest.fixture(scope="module")
def reference(folder):
    return image_reference(folder)


def named(encode: WorkerProcess, rid: str, room: int, images: int, new_tokens: int = NEW_TOKENS) -> dict:
    """A greedy two-request ``/generate`` body for ``images`` placeholders in ``room`` of ``encode``."""
    return {"rid": rid, "text": prompt(images), "bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port,
            "bootstrap_room": room,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}


def two_request(encode: WorkerProcess, language: WorkerProcess, paths: list[str], rid: str,
                **generate_fields) -> tuple[requests.Response, requests.Response]:
    """``/generate`` naming the encoder and a fresh room, then ``/encode`` of ``paths`` to that
    room, as a router sends them; both answers."""
    room = secrets.randbits(62)
    body = named(encode, rid, room, len(paths)) | generate_fields
    with ThreadPoolExecutor(2) as pool:
        generating = pool.submit(requests.post, f"{language.url}/generate", json=body, timeout=300)
        encoded = requests.post(f"{encode.url}/encode", json={"rid": rid, "bootstrap_room": room, "images": paths},
                                timeout=300)
        return generating.result(), encoded


@pytest.mark.parametrize("sizes", [["448x448"], ["1920x1080"], ["other", "448x448"]], ids="+".join)
def test_greedy_ids_equal_monolithic(workers, images, reference, sizes) -> None:
    """One image, one that takes a resume round, two in one room: the language server receives
    the room from the encoder the request names and generates what transformers does; the
    bytes it got are the encoder's (its sha256)."""
    encode, language = workers
    paths = [images[s] for s in sizes]
    generated, encoded = two_request(encode, language, paths, f"two-{'+'.join(sizes)}")
    assert generated.status_code == 200, generated.text
    assert encoded.status_code == 200, encoded.text
    body = generated.json()
    assert greedy_mismatch(body["output_ids"], reference(paths)) is None
    meta = body["meta_info"]
    assert meta["sha256"] == encoded.json()["sha256"]
    assert meta["resume_rounds"] == (1 if sizes == ["1920x1080"] else 0), meta


def test_every_choice_of_an_n_2_request_uses_the_room(workers, images, reference) -> None:
    """``n=2`` in a two-request ``/generate``: the room is received once, and both greedy choices
    equal the reference, each with the room's transfer (its sha256) in its ``meta_info``."""
    encode, language = workers
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "n": 2}
    generated, encoded = two_request(encode, language, [images["448x448"]], "two-choices", sampling_params=params)
    assert generated.status_code == 200, generated.text
    assert encoded.status_code == 200, encoded.text
    choices = generated.json()
    assert len(choices) == 2, choices
    for choice in choices:
        assert greedy_mismatch(choice["output_ids"], reference([images["448x448"]])) is None
        assert choice["meta_info"]["sha256"] == encoded.json()["sha256"], choice["meta_info"]


def test_a_request_with_images_needs_an_encoder_named_or_configured(workers, images) -> None:
    """Without ``--encoder-urls``, ``image_data`` has no encoder to go to (400, saying how to name
    one); half a bootstrap address, an encoder not allowed, or images sent both ways are 400/403
    before anyone is contacted; text alone is served."""
    encode, language = workers
    assert generate(language, [images["448x448"]], "no-encoders").status_code == 400
    assert "no --encoder-urls" in generate(language, [images["448x448"]], "no-encoders-2").json()["error"]["message"]
    refusals = {
        "half": ({"bootstrap_host": "127.0.0.1", "bootstrap_room": 5}, 400, "go together"),
        "not allowed": ({"bootstrap_host": "10.9.8.7", "bootstrap_port": 8998, "bootstrap_room": 5}, 403,
                        "not an encoder this worker may contact"),
        "both": ({"bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port, "bootstrap_room": 5,
                  "image_data": [images["448x448"]]}, 400, "not both"),
        "room": ({"bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port, "bootstrap_room": -1}, 400,
                 "bootstrap_room must be"),
    }
    for name, (fields, status, words) in refusals.items():
        answer = requests.post(f"{language.url}/generate", timeout=30, json={"text": prompt(1), **fields})
        assert answer.status_code == status and words in answer.text, (name, answer.text)
    text = requests.post(f"{language.url}/generate", timeout=120, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert text.status_code == 200 and len(text.json()["output_ids"]) == 4


def test_the_reference_forks_sender_lands_byte_for_byte(workers, folder) -> None:
    """The reference fork's encode side (its wire, its bootstrap server) as the sender: the rows
    the language server generates from are the fork's, byte for byte, through resume rounds."""
    _, language = workers
    grid = (1, 64, 96)  # 1,536 rows: one resume round after the first allocation
    fill_ids, mrope, _ = image_positions([grid])
    emb = Embedding.empty(len(fill_ids), 256, "bfloat16")
    values = np.random.default_rng(3).normal(0, 0.5, size=(len(fill_ids), 256)).astype(np.float32)
    emb.embeddings[:] = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(emb.embeddings.shape)
    emb.fill_ids[:], emb.mrope_positions[:] = fill_ids, mrope
    emb.aux[0] = len(fill_ids)
    fork = ForkEncoder(hidden_size=256, block_size=128)
    try:
        room = secrets.randbits(62)
        fork.stage_embedding(room, emb)
        answer = requests.post(f"{language.url}/generate", timeout=300, json={
            "rid": "fork-sender", "text": prompt(1), "bootstrap_host": "127.0.0.1",
            "bootstrap_port": fork.bootstrap.port, "bootstrap_room": room,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert answer.status_code == 200, answer.text
        meta = answer.json()["meta_info"]
        assert meta["sha256"] == emb.sha256() and meta["resume_rounds"] == 1, meta
        text_tokens = len(AutoTokenizer.from_pretrained(folder)(prompt(1))["input_ids"])
        assert meta["prompt_tokens"] == text_tokens - 1 + len(fill_ids)  # the placeholder's pad, once per row
    finally:
        fork.close()


def fresh_4k(tmp_path, seed: int) -> str:
    """A 3840x2160 image no test sent before (SGLang's encoder caches what it has encoded)."""
    path = tmp_path / f"4k-{seed}.png"
    make_image(3840, 2160, seed=seed).save(path)
    return str(path)


def test_an_abort_of_the_generate_half_ends_the_encode_half(workers, tmp_path) -> None:
    """The router aborts the language half (SGLang's ``/abort_request``) while the 4K image is
    being sent: the client is answered at once, and the encoder's ``/encode`` ends too (the
    room is aborted on both sides), its blocks and the language side's all back."""
    encode, language = workers
    room, rid = secrets.randbits(62), "abort-generate-half"
    with ThreadPoolExecutor(2) as pool:
        generating = pool.submit(requests.post, f"{language.url}/generate", timeout=120,
                                 json=named(encode, rid, room, 1, new_tokens=4))
        encoding = pool.submit(requests.post, f"{encode.url}/encode", timeout=120,
                               json={"rid": rid, "bootstrap_room": room, "images": [fresh_4k(tmp_path, 71)]})
        wait_until(lambda: encoder_health(encode)["pending"] > 0, "encoding")
        aborted_at = time.monotonic()
        assert requests.post(f"{language.url}/abort_request", json={"rid": rid}, timeout=30).status_code == 200
        generated, encoded = generating.result(timeout=60), encoding.result(timeout=60)
    assert generated.status_code == 499 and "aborted by /abort_request" in generated.text, generated.text
    assert encoded.status_code >= 400, encoded.text
    assert time.monotonic() - aborted_at < 15
    wait_until(lambda: pools_free(encode, language), "every block back")


@pytest.mark.unanswered_ok("the router gives up on its /encode on purpose")
def test_a_router_giving_up_on_the_encode_half_ends_the_generate_half(workers, tmp_path) -> None:
    """The router drops its ``/encode`` of two 4K images (its connection closed mid-encode): the
    encoder aborts the room, and the language server answers its ``/generate`` at once with the
    encoder's failure instead of waiting out the transfer timeout."""
    encode, language = workers
    room, rid = secrets.randbits(62), "abort-encode-half"
    with ThreadPoolExecutor(1) as pool:
        generating = pool.submit(requests.post, f"{language.url}/generate", timeout=120,
                                 json=named(encode, rid, room, 2, new_tokens=4))
        pictures = [fresh_4k(tmp_path, seed) for seed in (72, 73)]  # about 1.5 s to encode here, warm
        with pytest.raises(requests.exceptions.ReadTimeout):
            answer = requests.post(f"{encode.url}/encode", json={"rid": rid, "bootstrap_room": room,
                                                                 "images": pictures}, timeout=(10, 0.3))
            pytest.fail(f"/encode answered before the router gave up: {answer.status_code} {answer.text}")
        gave_up_at = time.monotonic()
        generated = generating.result(timeout=60)
    assert generated.status_code in (499, 502, 503), generated.text
    assert time.monotonic() - gave_up_at < 15
    wait_until(lambda: pools_free(encode, language), "every block back")


@pytest.mark.unanswered_ok  # the client gives up on purpose
def test_a_client_that_goes_away_ends_its_room_at_once(workers) -> None:
    """A two-request ``/generate`` naming a room no encode request will come for, its client gone
    after 2 s (as ``curl -m 2``): the room ends within a poll of the disconnect, its blocks back,
    not at the join wait (15 s) or the data wait (300 s)."""
    encode, language = workers
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(f"{language.url}/generate", json=named(encode, "gone-client", secrets.randbits(62), 1),
                      timeout=(10, 2.0))
    gone_at = time.monotonic()
    within = ConnectorConfig.join_timeout / 2  # halfway to the join wait, which began before the client left
    wait_until(lambda: pools_free(encode, language), "every block back", timeout=within)
    assert time.monotonic() - gone_at < within
    assert [line for line in language.log if "rid=gone-client" in line and "the client went away" in line]


def pools_free(encode: WorkerProcess, language: WorkerProcess) -> bool:
    enc = encoder_health(encode)
    lang = requests.get(f"{language.url}/epd/health", timeout=10).json()
    return enc["free_blocks"] == enc["num_blocks"] and lang["free_blocks"] == lang["num_blocks"] and \
        not lang["transferring"] and not lang["queued"]


def wait_until(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s"
        time.sleep(0.1)
