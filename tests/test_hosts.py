"""Workers on separate hosts: each in its own network namespace with its own address on a bridge
(``scripts/hosts.py``), this test process the client host. SGLang's encoder on the encoder host,
SGLang's server on the language host, both bound to every interface (``--host 0.0.0.0``) and
advertising their own address (``--advertise-host``), with a control secret and an admin key;
smg in plain routing on a gateway host; a stranger host on the same bridge. Both workers are
started by ``sglang serve``. Greedy ids are checked against transformers' monolithic
``generate``; every address a worker gave a peer is checked to be its own host's; every port a
worker's host listens on is one the README's deployment table lists.
"""

from __future__ import annotations

import base64
import re
import secrets
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest
import requests
from hosts import Network
from monolithic import greedy_mismatch
from sglang_stack import (
    LANGUAGE_FLAGS,
    NEW_TOKENS,
    connector_address,
    connector_idle,
    image_reference,
    prompt,
    smg_gateway,
    write_images,
)
from transformers import Qwen2_5_VLForConditionalGeneration
from workers import ROOT, SGLANG_READY, WorkerProcess, free_port, start_together

pytestmark = [pytest.mark.hosts, pytest.mark.sglang]

ANY = "0.0.0.0"
SECRET = "hosts-test-secret-0123456789"
ADMIN_KEY = "hosts-test-admin-key"
GUARDED = {"SGLANG_EMBEDDING_CONTROL_SECRET": SECRET}
# These workers are started by ``sglang serve`` (every other test uses ``python -m sglang.launch_server``)
SGLANG_SERVE = (str(Path(sys.executable).parent / "sglang"), "serve")


@pytest.fixture(scope="module")
def net():
    with Network(["encoder", "language", "gateway", "stranger"]) as network:
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
        lambda: WorkerProcess("encode", "--model-path", folder, "--admin-api-key", ADMIN_KEY, port=encode_port,
                              host=encoder.address, bind=ANY, netns=encoder.netns, command=SGLANG_SERVE, env=GUARDED,
                              timeout=300),
        lambda: WorkerProcess("language", "--model-path", folder, *LANGUAGE_FLAGS, "--admin-api-key", ADMIN_KEY,
                              "--encoder-urls",
                              f"http://{encoder.address}:{encode_port}", "--allowed-bootstrap-hosts", encoder.address,
                              host=language.address, bind=ANY, netns=language.netns, trusted_media=False,
                              command=SGLANG_SERVE, env=GUARDED, ready=SGLANG_READY, timeout=300))
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


STRANGER = """
import sys, time, zmq
from connector.messages import AbortMsg, InitMsg
context = zmq.Context()
for endpoint in sys.argv[1:]:
    push = context.socket(zmq.PUSH)
    push.connect(endpoint)
    push.send_multipart([b"garbage"])
    push.send_multipart(InitMsg(5, "10.0.0.1", 1, "10.0.0.1:1", (0,), 1, 128).encode())
    push.send_multipart(AbortMsg(5, "10.0.0.1", 1, 1).encode())
    push.close(linger=2000)
context.term()
"""


def listening(host) -> set[int]:
    """The TCP ports something listens on in ``host``'s namespace, loopback excluded."""
    out = subprocess.run([*host.exec_prefix(), "ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    ports = set()
    for line in out.splitlines():
        local = line.split()[3]
        address, port = local.rsplit(":", 1)
        if not address.startswith(("127.", "[::1]", "[::ffff:127.")):
            ports.add(int(port))
    return ports


def test_a_stranger_on_the_bridge_can_do_nothing_without_the_secret_or_the_key(net, workers) -> None:
    """From a host on the same bridge: unsigned ZMQ messages to either worker's connector are
    dropped and counted, the admin routes answer 401 without the key, ``PUT /route`` 401, and
    both still serve. The ports each worker's host listens on are those the README lists:
    HTTP, the encoder's bootstrap port, each connector's ZMQ port, Mooncake's handshake and data
    ports (15000-17000), and, on the language host, SGLang's own (none beyond these with one
    rank: its sockets are IPC files or loopback)."""
    encode, language = workers
    zmq_port = {"encode": int(re.search(r"zmq=tcp://[\d.]+:(\d+)", encode.ready_line).group(1)),
                "language": connector_address(language)[1]}
    stranger = net["stranger"]
    subprocess.run([*stranger.exec_prefix(), sys.executable, "-c", STRANGER,
                    f"tcp://{encode.host}:{zmq_port['encode']}", f"tcp://{language.host}:{zmq_port['language']}"],
                   cwd=ROOT, check=True, timeout=60)
    for worker, role in ((encode, "encode"), (language, "language")):
        line = f'epd_rejected_messages_total{{reason="unauthenticated",role="{role}"}} 3.0'
        deadline = time.monotonic() + 10
        while line not in (text := requests.get(f"{worker.url}/metrics", timeout=10).text):
            assert time.monotonic() < deadline, [row for row in text.splitlines() if "rejected" in row]
            time.sleep(0.1)
    asks = [("post", f"{w.url}/{route}") for w in workers for route in ("sleep", "wake_up")]
    asks.append(("put", f"http://{encode.host}:{encode.bootstrap_port}/route"))
    for method, url in asks:
        command = f"import requests; print(requests.{method}({url!r}, json={{}}, timeout=10).status_code)"
        status = subprocess.run([*stranger.exec_prefix(), sys.executable, "-c", command], capture_output=True,
                                text=True, check=True, timeout=60).stdout.strip()
        assert status == "401", (url, status)
    assert requests.get(f"{encode.url}/health", timeout=10).json()["state"] == "awake"
    mooncake_port = int(re.search(r"mooncake=[\d.]+:(\d+)", encode.ready_line).group(1))
    for worker, host, known in ((encode, net["encoder"], {encode.port, encode.bootstrap_port, zmq_port["encode"]}),
                                (language, net["language"], {language.port, zmq_port["language"]})):
        unlisted = {p for p in listening(host) - known if not 15000 <= p <= 17000}
        assert not unlisted, f"{worker.mode} host listens on ports the README does not list: {sorted(unlisted)}"
    assert mooncake_port in listening(net["encoder"])


def stop_alone(worker: WorkerProcess, host) -> float:
    """Ctrl-C (SIGINT) to the worker's launcher; once it exits (0, or ended by the signal as
    SGLang's server is), no process of it is left on its host (nothing else runs there). The
    seconds it took to exit."""
    stopped = time.monotonic()
    worker.proc.send_signal(signal.SIGINT)
    assert worker.proc.wait(30) in (0, -signal.SIGINT)
    took = time.monotonic() - stopped
    deadline = time.monotonic() + 5
    while (left := subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()):
        assert time.monotonic() < deadline, [psutil.Process(int(pid)).cmdline() for pid in left]
        time.sleep(0.1)
    return took


def test_ctrl_c_right_after_a_4k_image_ends_the_encode_worker_within_2_s(net, workers) -> None:
    """(Last but one in this module: it stops the encoder.) Every block of both pools is back
    after the 4K requests above, SIGINT ends the encode worker at once (issue 34: it took 5-15 s)
    and leaves no process of it on its host."""
    encode, language = workers
    health = requests.get(f"{encode.url}/health", timeout=10).json()
    assert health["free_blocks"] == health["num_blocks"], health
    idle = connector_idle(language)
    assert idle["free_blocks"] == idle["num_blocks"], idle
    took = stop_alone(encode, net["encoder"])
    assert took < 2.0, f"the encode worker took {took:.2f}s to exit"


def test_ctrl_c_ends_the_language_server_and_every_process_it_started(net, workers) -> None:
    """(After the encoder's stop.) SGLang's server leaves no process behind on its host."""
    stop_alone(workers[1], net["language"])
