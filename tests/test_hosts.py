"""Workers on separate hosts: each in its own network namespace with its own address on a bridge
(``scripts/hosts.py``), this test process the client host. SGLang's encoder on the encoder host,
SGLang's server on the language host, both bound to every interface (``--host 0.0.0.0``) and
advertising their own address (``--advertise-host``); smg in plain routing on a gateway host.
Both are started by ``sglang serve``. Greedy ids are checked against transformers' monolithic
``generate``; every address a worker gave a peer is checked to be its own host's.
"""

from __future__ import annotations

import base64
import re
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from hosts import Network
from monolithic import greedy_mismatch
from sglang_stack import LANGUAGE_FLAGS, NEW_TOKENS, connector_idle, image_reference, prompt, smg_gateway, write_images
from transformers import Qwen2_5_VLForConditionalGeneration
from workers import SGLANG_READY, WorkerProcess, free_port, start_together

pytestmark = [pytest.mark.hosts, pytest.mark.sglang]

ANY = "0.0.0.0"
# These workers are started by ``sglang serve`` (every other test uses ``python -m sglang.launch_server``)
SGLANG_SERVE = (str(Path(sys.executable).parent / "sglang"), "serve")


@pytest.fixture(scope="module")
def net():
    with Network(["encoder", "language", "gateway"]) as network:
        yield network


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("hosts-images"))


@pytest.fixture(scope="module")
def reference(folder):
    return image_reference(folder, Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval())


@pytest.fixture(scope="module")
def workers(net, folder):
    """SGLang's encoder on the encoder host and SGLang's server on the language host, each bound
    to every interface and advertising its host's address; the language server sends to the
    encoder by URL and takes two-request ``/generate``s naming it."""
    encoder, language = net["encoder"], net["language"]
    encode_port = free_port()
    started = start_together(
        lambda: WorkerProcess("encode", "--model-path", folder, port=encode_port, host=encoder.address, bind=ANY,
                              netns=encoder.netns, command=SGLANG_SERVE, timeout=300),
        lambda: WorkerProcess("language", "--model-path", folder, *LANGUAGE_FLAGS, "--encoder-urls",
                              f"http://{encoder.address}:{encode_port}", "--allowed-bootstrap-hosts", encoder.address,
                              host=language.address, bind=ANY, netns=language.netns, trusted_media=False,
                              command=SGLANG_SERVE, ready=SGLANG_READY, timeout=300))
    yield started
    for worker in reversed(started):
        worker.stop()


@pytest.fixture(scope="module")
def gateway(net, workers, tmp_path_factory):
    """smg in plain routing on the gateway host, in front of the language server; its URL."""
    host = net["gateway"]
    with smg_gateway([workers[1].url], tmp_path_factory.mktemp("smg") / "smg.log", host.address, ANY,
                     host.exec_prefix()) as url:
        yield url


def data_uri(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def test_every_address_a_worker_gives_a_peer_is_its_own_hosts(net, workers) -> None:
    """Bound to 0.0.0.0, each worker names itself by its advertised address: the encoder's
    bootstrap and ZMQ endpoint, the language server's connector and Mooncake session (the
    registers the encoder receives are checked once a request made one)."""
    encode, language = workers
    encoder_address, language_address = net["encoder"].address, net["language"].address
    ready = encode.ready_line
    assert f"http=http://{encoder_address}:" in ready and f"bootstrap=http://{encoder_address}:" in ready, ready
    assert f"zmq=tcp://{encoder_address}:" in ready and f"mooncake={encoder_address}:" in ready, ready
    started = [line for line in language.log if "epd-resume: SGLang's server is the language worker" in line]
    assert started and f"zmq=tcp://{language_address}:" in started[0] and f"mooncake={language_address}:" in started[0]


@pytest.mark.parametrize("size", ["448x448", "3840x2160"])
def test_generate_through_the_gateway_across_hosts_equals_monolithic(workers, gateway, images, reference,
                                                                      size) -> None:
    """``/generate`` with a data: URI through smg on the gateway host: the language host has the
    encoder host encode it and receives the embedding (the 4K image's 10,549 tokens in a resume
    round after the 8,192 first allocated); the ids are transformers' monolithic ones."""
    encode, language = workers
    body = {"rid": f"hosts-{size}", "text": prompt(1), "image_data": [data_uri(images[size])],
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    answer = requests.post(f"{gateway}/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert greedy_mismatch(answer.json()["output_ids"], reference([images[size]])) is None
    meta = answer.json()["meta_info"]
    assert meta["resume_rounds"] == (1 if size == "3840x2160" else 0), meta
    registered = [line for line in encode.log if "language peer registered" in line]
    assert registered and all(re.search(rf"zmq=tcp://{re.escape(workers[1].host)}:\d+ mooncake="
                                        rf"{re.escape(workers[1].host)}:\d+", line) for line in registered), registered


def test_openai_chat_through_the_gateway_answers_as_the_language_host_does(workers, gateway, images, folder) -> None:
    """The ``openai`` client on the client host, through smg: the same answer as the same chat
    sent to the language host directly."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(images["other"])}},
                                             {"type": "text", "text": "Describe it."}]}]
    answers = [openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300).chat.completions.create(
        model=folder, messages=messages, max_tokens=NEW_TOKENS, temperature=0) for url in (workers[1].url, gateway)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[1].usage.completion_tokens == NEW_TOKENS


def test_two_requests_across_hosts_equal_monolithic(net, workers, images, reference) -> None:
    """A router on the client host sends ``/encode`` to the encoder host and ``/generate``, naming
    the encoder host's address and a room, to the language host: the monolithic ids, after a
    resume round."""
    encode, language = workers
    room = secrets.randbits(62)
    body = {"rid": "hosts-two", "text": prompt(1), "bootstrap_host": net["encoder"].address,
            "bootstrap_port": encode.bootstrap_port, "bootstrap_room": room,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        generating = pool.submit(requests.post, f"{language.url}/generate", json=body, timeout=300)
        encoded = requests.post(f"{encode.url}/encode", timeout=300, json={
            "rid": "hosts-two", "bootstrap_room": room, "images": [data_uri(images["3840x2160"])]})
        generated = generating.result()
    assert encoded.status_code == 200 and generated.status_code == 200, (encoded.text, generated.text)
    assert greedy_mismatch(generated.json()["output_ids"], reference([images["3840x2160"]])) is None
    assert generated.json()["meta_info"]["resume_rounds"] == 1
    assert generated.json()["meta_info"]["sha256"] == encoded.json()["sha256"]


def test_ctrl_c_right_after_a_4k_image_ends_the_encode_worker_within_2_s(workers, images) -> None:
    """(Last in this module: it stops the encoder.) Every block of both pools is back after the
    4K requests above, and SIGINT ends the encode worker at once (issue 34: it took 5-15 s)."""
    encode, language = workers
    health = requests.get(f"{encode.url}/health", timeout=10).json()
    assert health["free_blocks"] == health["num_blocks"], health
    idle = connector_idle(language)
    assert idle["free_blocks"] == idle["num_blocks"], idle
    stopped = time.monotonic()
    assert encode.stop() == 0
    assert time.monotonic() - stopped < 2.0, f"the encode worker took {time.monotonic() - stopped:.2f}s to exit"
