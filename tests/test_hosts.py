"""Workers on separate hosts: each in its own network namespace with its own address on a bridge
(``harness/hosts.py``), this test process the client host. SGLang's encoder on two encoder hosts,
SGLang's server on two language hosts (each sending to both encoders), all bound to every
interface (``--host 0.0.0.0``) and advertising their own address (``--advertise-host``), with a
control secret and an admin key; smg in plain routing over both language hosts on a gateway
host; a stranger host on the same bridge. The first encoder host and the first language host start
their workers by ``sglang serve`` as a user does (a fresh interpreter; SGLang spawns its scheduler and
detokenizer), the second ones by ``python -m sglang.launch_server`` as the other tests do (forked from
the tests' warm launcher, ``EPD_FORK_WORKERS``), all with 1 s heartbeats. Greedy ids are checked against transformers' monolithic ``generate``; every address
a worker gave a peer is checked to be its own host's; every port a worker's host listens on is
one docs/deployment.md's ports table lists. Then partitions, not process deaths: links between an
encoder host and a language host cut both ways and one way, a language host cut off from both
encoders, lost packets.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import psutil
import pytest
import requests
import zmq
from monolithic import greedy_mismatch
from sglang_stack import (
    LANGUAGE_FLAGS,
    NEW_TOKENS,
    connector_address,
    connector_health,
    connector_idle,
    encoder_health,
    image_reference,
    metric,
    prompt,
    smg_gateway,
    write_images,
)
from transfer_large_image import make_image

from connector.zmq_link import RTO_MAX_MS, PushSockets
from harness.hosts import Network
from harness.workers import ROOT, SGLANG_LAUNCH, SGLANG_READY, WorkerProcess, free_port, start_together
from language_side.dispatch import PROBE_TIMEOUT_S
from sglang_ext.language_flags import cpu_kv_tokens
from sglang_ext.launch_server import CLOSE_WAIT_S

pytestmark = [pytest.mark.hosts, pytest.mark.sglang]

ANY = "0.0.0.0"
SECRET = "hosts-test-secret-0123456789"
ADMIN_KEY = "hosts-test-admin-key"
GUARDED = {"SGLANG_EMBEDDING_CONTROL_SECRET": SECRET}
# The first hosts' workers are started by ``sglang serve`` (every other test uses ``python -m sglang.launch_server``)
SGLANG_SERVE = (str(Path(sys.executable).parent / "sglang"), "serve")
LAUNCHERS = {"encoder": SGLANG_SERVE, "language": SGLANG_SERVE, "encoder2": SGLANG_LAUNCH, "language2": SGLANG_LAUNCH}
# Short heartbeats (1 s, 2 misses: a peer is found silent within 4 s, docs/failure_bounds.md)
# keep the partition tests short.
HEARTBEATS = ("--heartbeat-interval", "1", "--heartbeat-max-failure", "2")
DETECTION_S = 1 * (2 + 2)  # D = interval x (misses + 2)
PARTITION_S = 12
MOONCAKE_STATUS_S = 5  # connector.mooncake_transport's MC_TCP_STATUS_TIMEOUT_SEC


@pytest.fixture(scope="module")
def net():
    # Each host as docs/deployment.md sets one up: TCP's retransmission back-off
    # capped at 1 s (Mooncake's connections made into a cut link then retry within a second of
    # its end; the connector caps its own ZMQ connections itself, which the client host, left
    # at the kernel's default, tests).
    with Network(["encoder", "encoder2", "language", "language2", "gateway", "stranger"],
                 rto_max_ms=1000) as network:
        yield network


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("hosts-images"))


@pytest.fixture(scope="module")
def reference(folder):
    return image_reference(folder)


@pytest.fixture(scope="module")
def cluster(net, folder) -> dict[str, WorkerProcess]:
    """SGLang's encoder on each encoder host and SGLang's server on each language host, each bound
    to every interface and advertising its host's address; each language server sends to both
    encoders by URL and takes two-request ``/generate``s naming either. Keyed by host name."""
    encoders, languages = [net["encoder"], net["encoder2"]], [net["language"], net["language2"]]
    ports = {host.name: free_port() for host in encoders}
    urls = [f"http://{host.address}:{ports[host.name]}" for host in encoders]

    def encoder(host):
        return lambda: WorkerProcess("encode", "--model-path", folder, "--admin-api-key", ADMIN_KEY, *HEARTBEATS,
                                     port=ports[host.name], host=host.address, bind=ANY, netns=host.netns,
                                     command=LAUNCHERS[host.name], env=GUARDED, timeout=300)

    def language(host):
        # The second language host starts as a user's would: SGLang's warm-up (a generation at
        # start, over its own address: it binds every interface) and this mode's KV pool size
        # (no --max-total-tokens).
        flags = LANGUAGE_FLAGS if host.name == "language" else ()
        return lambda: WorkerProcess("language", "--model-path", folder, *flags, "--admin-api-key", ADMIN_KEY,
                                     *HEARTBEATS, "--image-embedding-cache-bytes", "0", "--encoder-urls", *urls,
                                     "--allowed-bootstrap-hosts", *(e.address for e in encoders), host=host.address, bind=ANY, netns=host.netns,
                                     trusted_media=False, command=LAUNCHERS[host.name], env=GUARDED, ready=SGLANG_READY,
                                     timeout=300)

    hosts = [*encoders, *languages]
    started = start_together(*(encoder(h) for h in encoders), *(language(h) for h in languages))
    yield {host.name: worker for host, worker in zip(hosts, started, strict=True)}
    for worker in reversed(started):
        worker.stop()


@pytest.fixture(scope="module")
def workers(cluster) -> tuple[WorkerProcess, WorkerProcess]:
    """The first encoder and the first language server."""
    return cluster["encoder"], cluster["language"]


@pytest.fixture(scope="module")
def gateway(net, cluster, tmp_path_factory):
    """smg in plain routing on the gateway host, in front of both language servers; its URL."""
    host = net["gateway"]
    with smg_gateway([cluster["language"].url, cluster["language2"].url], tmp_path_factory.mktemp("smg") / "smg.log",
                     host.address, ANY, host.exec_prefix()) as url:
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


def test_the_language_server_started_with_sglangs_warm_up_served_it_before_saying_ready(cluster, folder) -> None:
    """The second language host runs SGLang's warm-up (the first skips it, as the other tests'
    servers do): bound to every interface, the server's text generation to itself was answered
    200 before it logged that it serves. Started without ``--max-total-tokens``, its KV pool is
    the one this mode picks on a CPU, and it says so."""
    log = cluster["language2"].log
    ready = next(i for i, line in enumerate(log) if SGLANG_READY in line)
    assert any('"POST /generate HTTP/1.1" 200' in line for line in log[:ready]), "".join(log[max(0, ready - 20):ready])
    budget = cpu_kv_tokens(folder)
    assert any("this mode's CPU default" in line and f"{budget.tokens} tokens" in line for line in log)


@pytest.mark.parametrize("size", ["448x448", "3840x2160"])
def test_generate_through_the_gateway_across_hosts_equals_monolithic(net, cluster, gateway, images, reference,
                                                                      size) -> None:
    """``/generate`` with a data: URI through smg on the gateway host: a language host has an
    encoder host encode it and receives the embedding (the 4K image's 10,549 tokens in a resume
    round after the 8,192 first allocated); the ids are transformers' monolithic ones. Every
    register an encoder got names a language host's own address."""
    body = {"rid": f"hosts-{size}", "text": prompt(1), "image_data": [data_uri(images[size])],
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    answer = requests.post(f"{gateway}/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert greedy_mismatch(answer.json()["output_ids"], reference([images[size]])) is None
    meta = answer.json()["meta_info"]
    assert meta["resume_rounds"] == (1 if size == "3840x2160" else 0), meta
    registered = [line for name in ("encoder", "encoder2") for line in cluster[name].log
                  if "language peer registered" in line]
    own = re.compile(r"zmq=tcp://([\d.]+):\d+ mooncake=([\d.]+):\d+")  # each language host names itself
    languages = {net["language"].address, net["language2"].address}
    assert registered and all((m := own.search(line)) and m[1] == m[2] and m[1] in languages
                              for line in registered), registered


def test_openai_chat_through_the_gateway_answers_as_the_language_host_does(workers, gateway, images, folder) -> None:
    """The ``openai`` client on the client host, through smg: the same answer as the same chat
    sent to the language host directly."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(images["other"])}},
                                             {"type": "text", "text": "Describe it."}]}]
    answers = [openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=300).chat.completions.create(
        model=folder, messages=messages, max_tokens=NEW_TOKENS, temperature=0) for url in (workers[1].url, gateway)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[1].usage.completion_tokens == NEW_TOKENS


def served(worker: WorkerProcess) -> float:
    """Requests the worker's connector finished well (its ``epd_requests_total``)."""
    text = requests.get(f"{worker.url}/metrics", timeout=10).text
    return sum(float(m[1]) for m in re.finditer(r'^epd_requests_total\{[^}]*outcome="success"[^}]*\} (\S+)$', text, re.M))


def test_sglangs_benchmark_client_through_the_gateway_uses_both_language_and_both_encoder_hosts(
        net, cluster, gateway, folder, tmp_path) -> None:
    """SGLang's own benchmark client on the client host, against smg on the gateway host: 8 image
    prompts all served, spread by smg over both language hosts, whose connectors spread the
    images over both encoder hosts."""
    before = {name: served(worker) for name, worker in cluster.items()}
    host, port = gateway.removeprefix("http://").rsplit(":", 1)
    run = subprocess.run(
        [sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang", "--host", host, "--port", port,
         "--model", folder, "--tokenizer", folder, "--dataset-name", "image", "--num-prompts", "8", "--image-count",
         "1", "--image-resolution", "448x448", "--random-input-len", "32", "--random-output-len", "8",
         "--random-range-ratio", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"})
    out = run.stdout + run.stderr
    assert run.returncode == 0 and re.search(r"^Successful requests:\s+8\s*$", out, re.M), out[-3000:]
    assert re.search(r"^Total generated tokens:\s+64\s*$", out, re.M), out[-3000:]
    more = {name: served(worker) - before[name] for name, worker in cluster.items()}
    assert all(more[name] > 0 for name in cluster), more


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
    both still serve. The ports each worker's host listens on are those docs/deployment.md lists:
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
    assert encoder_health(encode)["state"] == "awake"
    mooncake_port = int(re.search(r"mooncake=[\d.]+:(\d+)", encode.ready_line).group(1))
    for worker, host, known in ((encode, net["encoder"], {encode.port, encode.bootstrap_port, zmq_port["encode"]}),
                                (language, net["language"], {language.port, zmq_port["language"]})):
        unlisted = {p for p in listening(host) - known if not 15000 <= p <= 17000}
        assert not unlisted, f"{worker.mode} host listens on ports docs/deployment.md does not list: {sorted(unlisted)}"
    assert mooncake_port in listening(net["encoder"])


# ---- partitions: links cut (both ways, one way), lost packets; not process deaths ------------------------
# Encoders on hosts encoder and encoder2 (a and b below), the language server on host language;
# links are cut with iptables on one host, so every other link stays up.


CUT_S = 16
# TCP's retransmissions without a cap (from a 200 ms RTO, doubling): 0.2, 0.6, 1.4, 3.0, 6.2, 12.6, 25.4 s
UNCAPPED_RETRANSMISSION_S = 25.4  # the first after a cut of CUT_S


# A PULL socket on a host: each message's text and the time it arrived, a line each.
PULL_PRINTER = """
import sys, time, zmq
pull = zmq.Context().socket(zmq.PULL)
pull.bind(sys.argv[1])
print("bound", flush=True)
while True:
    print(pull.recv().decode(), time.time(), flush=True)
"""


def test_control_messages_sent_into_a_cut_arrive_within_a_second_or_two_of_its_end(net) -> None:
    """The connector's PUSH sockets (here, on the client host) to a PULL on another host while
    the link is cut both ways for 16 s, a message every 0.5 s: once it heals every message
    arrives, in order, on the same connection, and the first sent after the heal within about 5 s
    (within the 1 s cap, on an unloaded machine). Without the retransmission cap
    (``connector/zmq_link.py``) it waits for TCP's back-off: the retransmission due about 13 s
    into the cut is lost, the next is due at about 25 s, 9 s after the heal."""
    host = net["stranger"]
    printer = subprocess.Popen([*host.exec_prefix(), sys.executable, "-c", PULL_PRINTER, f"tcp://{host.address}:5599"],
                               stdout=subprocess.PIPE, text=True)
    context = zmq.Context()
    push = PushSockets(context)
    try:
        assert printer.stdout.readline().strip() == "bound"
        push.send(host.address, 5599, [b"before"])
        assert printer.stdout.readline().split()[0] == "before"  # connected (its descriptor is read at the next send)
        net.cut(host, None)  # from the client host, where the PUSH sockets are
        try:
            cut_at = time.monotonic()
            sent = 0
            while time.monotonic() - cut_at < CUT_S:
                push.send(host.address, 5599, [f"cut-{sent}".encode()])
                sent += 1
                time.sleep(0.5)
        finally:
            net.heal(host)
        healed_at = time.time()
        push.send(host.address, 5599, [b"after"])
        arrived = [printer.stdout.readline().split() for _ in range(sent + 1)]
    finally:
        push.close()
        context.term()
        printer.kill()
    assert [text for text, _ in arrived] == [*(f"cut-{i}" for i in range(sent)), "after"]
    # halfway between the capped back-off (the next retransmission within RTO_MAX_MS of the heal)
    # and the uncapped one's (about 25 s into the cut)
    bound = (RTO_MAX_MS / 1000 + (UNCAPPED_RETRANSMISSION_S - CUT_S)) / 2
    took = float(arrived[-1][1]) - healed_at
    assert took < bound, f"the first message after the heal took {took:.1f} s (bound {bound:g} s)"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """``fresh(width, height)``: the path of an image never sent before (no cache answers it)."""
    root, made = tmp_path_factory.mktemp("partition-fresh"), []

    def make(width: int = 448, height: int = 448) -> str:
        made.append(str(root / f"{len(made)}.png"))
        make_image(width, height, seed=2000 + len(made)).save(made[-1])
        return made[-1]

    return make


@pytest.fixture(scope="module")
def before(cluster, fresh) -> Callable[[], float]:
    """``before()``: the seconds a 1920x1080 two-request to encoder a takes with every link up (the
    best of 3, after a warm-up), measured at the first call. The serial tests call it before their
    cut, so that it is measured as what it is compared with runs: alone (under xdist only a test's
    call does, ``conftest.py``; a fixture's set-up shares the cores with the other worker's tests)."""

    @functools.cache
    def measure() -> float:
        a, language = cluster["encoder"], cluster["language"]
        two_request(a, language, fresh(), "before-warm")
        return min(two_request(a, language, fresh(1920, 1080), f"before-{i}") for i in range(3))

    return measure


def two_request(encode: WorkerProcess, language: WorkerProcess, path: str, rid: str) -> float:
    """A router's ``/generate`` naming ``encode`` and a fresh room, then ``/encode`` there: the
    seconds both took (both answer 200, or what they said is in the assertion)."""
    room = secrets.randbits(62)
    body = {"rid": rid, "text": prompt(1), "bootstrap_host": encode.host, "bootstrap_port": encode.bootstrap_port,
            "bootstrap_room": room, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        generating = pool.submit(requests.post, f"{language.url}/generate", json=body, timeout=300)
        encoded = requests.post(f"{encode.url}/encode", json={"rid": rid, "bootstrap_room": room, "images": [path]},
                                timeout=300)
        generated = generating.result()
    took = time.monotonic() - started
    assert generated.status_code == encoded.status_code == 200, (rid, generated.text, encoded.text)
    return took


def chat(language: WorkerProcess, path: str, rid: str, ignore_eos: bool = True) -> requests.Response:
    return requests.post(f"{language.url}/generate", timeout=300, json={
        "rid": rid, "text": prompt(1), "image_data": [path],
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": ignore_eos}})


@pytest.mark.serial  # its first request after the heal is timed against one before the cut
def test_a_link_cut_mid_transfer_under_16_clients_then_healed(net, cluster, fresh, before) -> None:
    """The link between encoder host a and the language host goes down while 16 clients'
    images (two of them 4K) are being encoded and sent: every client is answered, by encoder b, within the
    documented bound; once the link is back every block on both sides is free, a serves again,
    and its first request takes at most twice what one took before the cut (no message queued
    for the cut-off peer holds it up)."""
    a, b, language = cluster["encoder"], cluster["encoder2"], cluster["language"]
    usual = before()
    sizes = {1: (3840, 2160), 9: (3840, 2160)}  # two 4K images (a resume round each), six 1080p, eight small
    clients = [fresh(*sizes.get(i, (1920, 1080) if i % 2 else (448, 448))) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        started = time.monotonic()
        answers = [pool.submit(chat, language, image, f"cut-{i}") for i, image in enumerate(clients)]
        while not encoder_health(a)["active_rooms"]:  # a transfer under way at a
            assert time.monotonic() - started < 60, "encoder a never had a room"
            time.sleep(0.05)
        net.cut(net["encoder"], net["language"])
        cut_at = time.monotonic()
        try:
            cut_with = encoder_health(a)["active_rooms"]
            replies = [future.result() for future in answers]
            statuses = [reply.status_code for reply in replies]
            elapsed = time.monotonic() - started
            # Down long enough for TCP's retransmission back-off to grow past what a request takes.
            time.sleep(max(0.0, cut_at + PARTITION_S - time.monotonic()))
        finally:
            net.heal(net["encoder"])  # a failed test leaves no cut for the next
    assert statuses == [200] * 16, [reply.text[:300] for reply in replies if reply.status_code != 200]
    assert elapsed < 240 + 3 * DETECTION_S, elapsed
    assert cut_with, "the cut came after encoder a's rooms ended"
    assert_served_after_heal(a, language, fresh, usual, time.monotonic() - cut_at, "after-heal")
    all_blocks_back(a, b, language)


def assert_served_after_heal(a: WorkerProcess, language: WorkerProcess, fresh, before: float, cut_s: float,
                             rid: str) -> None:
    """Once the language server has a back in rotation, a two-request to a is served within its
    bound after a cut of ``cut_s`` seconds (docs/failure_bounds.md, "Partitions"): twice its time
    before, plus 1 s for TCP's next retransmission of the control bytes sent into the cut (the
    connector caps their back-off at 1 s; what is sent next queues behind them), plus Mooncake's
    wait on a pooled connection the peer closed meanwhile (MC_TCP_STATUS_TIMEOUT_SEC)."""
    wait_in_rotation(language)
    after = two_request(a, language, fresh(1920, 1080), rid)
    bound = 2 * before + 1 + MOONCAKE_STATUS_S
    print(f"\n{rid}: {after:.2f} s after a {cut_s:.1f} s cut (before: {before:.2f} s, bound {bound:.1f} s)")
    assert after <= bound, f"after a {cut_s:.1f} s cut: {after:.1f} s (before: {before:.1f} s, bound {bound:.1f} s)"


def dispatch_in_rotation(language: WorkerProcess, fresh, timeout: float = 30.0) -> None:
    """Until the language server's dispatch sends parts to both encoders: one it took out of
    rotation comes back only when a request's choice of encoder finds its ``/health`` answering
    (language_side.dispatch), so small chats go through it until both are in."""
    deadline = time.monotonic() + timeout
    while metric(language, "epd_encoders_healthy") < 2:
        assert time.monotonic() < deadline, f"an encoder is still out of the dispatch's rotation after {timeout:g} s"
        assert chat(language, fresh(448, 448), f"rotation-{time.monotonic_ns()}").status_code == 200


def all_blocks_back(*workers: WorkerProcess, timeout: float = 30.0) -> None:
    """Every block of each encoder's pool and of the language server's free (within ``timeout``)."""
    for worker in workers:
        deadline = time.monotonic() + timeout
        while True:
            health = (connector_idle(worker, timeout) if worker.mode == "language"
                      else encoder_health(worker))
            if health["free_blocks"] == health["num_blocks"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert health["free_blocks"] == health["num_blocks"], (worker.mode, health)


def wait_in_rotation(language: WorkerProcess, timeout: float = 30.0) -> None:
    """Until the language server reports no failing encoder (every one answered again)."""
    deadline = time.monotonic() + timeout
    while connector_health(language)["failing_encoders"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not connector_health(language)["failing_encoders"], connector_health(language)


@pytest.mark.serial  # the detection window is seconds: nothing else loads the machine meanwhile
@pytest.mark.parametrize("direction", ["a to language", "language to a"])
def test_a_one_way_cut_is_caught_by_the_heartbeats(net, cluster, fresh, before, direction: str) -> None:
    """Packets dropped in one direction only, then 6 clients: their parts sent to a meet the cut,
    heartbeats go unanswered (their answers lost, or never arriving), so within the detection bound
    one side declares the other dead: the language side a (its probes of a), or a the language side
    (its pings); with only language-to-a cut, a's reports of the rooms it failed still arrive and
    may end the language side's rooms before its own probes missed twice. Every client is answered
    by b; once the link is back a serves again, its first request within twice its time before,
    and every block is free.

    The cut comes before the clients, with both encoders in the dispatch's rotation: heartbeats
    watch only peers with rooms, and a cut made once a showed a room could come after a's last room
    had ended (it batches them: they end together), with nothing left to find. Cutting while a is
    sending is test_a_link_cut_mid_transfer's."""
    a, b, language = cluster["encoder"], cluster["encoder2"], cluster["language"]
    sender, receiver = (net["language"], net["encoder"]) if direction == "language to a" else (net["encoder"], net["language"])
    tag = direction.split()[0]
    declared = {language: re.compile(rf"encode peer \S*{re.escape(a.host)}:{a.bootstrap_port} declared dead"),
                a: re.compile(rf"language peer {re.escape(language.host)}:\d+ \(session \S+\) declared dead")}

    def deaths() -> int:
        return sum(bool(pattern.search(line)) for worker, pattern in declared.items() for line in worker.log)

    images = [fresh(1920, 1080) for _ in range(6)]
    usual = before()
    dispatch_in_rotation(language, fresh)  # a gets parts: its /health was answered before the cut
    before_cut = deaths()
    try:
        net.cut(sender, receiver, one_way=True)
        cut_at = time.monotonic()
        with ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(chat, language, image, f"one-way-{tag}-{i}") for i, image in enumerate(images)]
            while deaths() == before_cut:
                found_s = time.monotonic() - cut_at
                # the watch starts with a's first room: the clients' first parts reach a a second or
                # two after the cut on a loaded machine
                assert found_s < DETECTION_S + 4, (
                    f"the one-way cut was not found in {found_s:.1f} s: encoder a {encoder_health(a)}, "
                    f"the language server's connector {connector_health(language)}")
                time.sleep(0.2)
            print(f"\n{direction}: the cut was found {time.monotonic() - cut_at:.1f} s after it began")
            statuses = [future.result().status_code for future in answers]
            elapsed = time.monotonic() - cut_at
    finally:
        net.heal(sender)  # a failed test leaves no cut for the next
    assert statuses == [200] * 6, statuses
    assert elapsed < 240 + 3 * DETECTION_S, elapsed
    assert_served_after_heal(a, language, fresh, usual, time.monotonic() - cut_at, f"one-way-{tag}-after")
    all_blocks_back(a, b, language)


@pytest.mark.serial  # timed: within the two probes' bound
def test_a_language_host_cut_off_from_every_encoder_answers_503_then_recovers(net, cluster, fresh) -> None:
    """With both encoder hosts unreachable, an image request is a 503 with Retry-After (no encoder
    answers /health) within the probe's bound, text is still served, and once the links are back
    images are served again."""
    a, b, language = cluster["encoder"], cluster["encoder2"], cluster["language"]
    for host in (net["encoder"], net["encoder2"]):
        net.cut(net["language"], host)
    try:
        first = chat(language, fresh(), "cut-off-0")  # may be tried on an encoder not yet found silent
        assert first.status_code in (502, 503), first.text
        started = time.monotonic()
        refused = chat(language, fresh(), "cut-off-1")
        assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
        assert "no encoder answers /health" in refused.json()["error"]["message"], refused.text
        # each encoder probed once, one after the other, each probe bounded; 3 s for the request itself
        assert time.monotonic() - started < 2 * PROBE_TIMEOUT_S + 3
        text = requests.post(f"{language.url}/generate", timeout=120, json={
            "text": "Hello", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
        assert text.status_code == 200 and len(text.json()["output_ids"]) == 4
    finally:
        net.heal(net["language"])
    deadline = time.monotonic() + 30
    while (answer := chat(language, fresh(), "cut-off-after")).status_code != 200:
        assert time.monotonic() < deadline, answer.text
        time.sleep(1)
    all_blocks_back(a, b, language)


def test_20_percent_packet_loss_is_slower_never_wrong_never_hung(net, cluster, fresh, reference) -> None:
    """A fifth of the packets lost each way on the link between the language host and encoder
    host a (b's link clean): 6 clients, every answer 200 with transformers' monolithic ids, each
    within the bound. A probe of a's health can miss (a lost SYN is sent again after TCP's 1 s,
    the probe's whole time with 1 s heartbeats), and two in a row cost a failover to b; with
    every encoder's link lossy, b could be declared dead too, and the request would get a 502."""
    a, b, language = cluster["encoder"], cluster["encoder2"], cluster["language"]
    paths = [fresh(448 + 28 * i, 448) for i in range(6)]
    expected = [reference([path]) for path in paths]
    net.lose(net["language"], net["encoder"], 0.2)
    try:
        with ThreadPoolExecutor(6) as pool:
            started = time.monotonic()
            # Ending at the end-of-sequence token as the reference's generate does.
            answers = list(pool.map(lambda i: chat(language, paths[i], f"lossy-{i}", ignore_eos=False), range(6)))
            elapsed = time.monotonic() - started
    finally:
        net.heal(net["language"])
    assert [answer.status_code for answer in answers] == [200] * 6, [answer.text[:3000] for answer in answers]
    for answer, ids in zip(answers, expected, strict=True):
        assert greedy_mismatch(answer.json()["output_ids"], ids) is None
    assert elapsed < 240, elapsed
    all_blocks_back(a, b, language)


def test_an_encoder_host_killed_under_48_clients_costs_no_client_its_answer(net, cluster, fresh) -> None:
    """Every process on encoder host b killed (SIGKILL) while 48 clients' images go through both
    language hosts: each client is answered 200 (its parts on b sent again to a; b's probes are
    refused, so its rooms' blocks come back at once), and every block of a and both language
    hosts is free after. (b stays dead: the modules' last tests use a.)"""
    a, b = cluster["encoder"], cluster["encoder2"]
    languages = [cluster["language"], cluster["language2"]]
    clients = [fresh(*((1280, 720) if i % 4 == 0 else (448, 448))) for i in range(48)]
    with ThreadPoolExecutor(48) as pool:
        started = time.monotonic()
        answers = [pool.submit(chat, languages[i % 2], image, f"kill-{i}", False) for i, image in enumerate(clients)]
        while not encoder_health(b)["active_rooms"]:
            assert time.monotonic() - started < 120, "encoder b never had a room"
            time.sleep(0.05)
        pids = subprocess.run(["ip", "netns", "pids", net["encoder2"].netns], capture_output=True, text=True,
                              check=True).stdout.split()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        killed_at = time.monotonic()
        replies = [future.result() for future in answers]
        elapsed = time.monotonic() - started
    assert [reply.status_code for reply in replies] == [200] * 48, [r.text[:500] for r in replies if r.status_code != 200]
    print(f"\n48 clients: killed b {killed_at - started:.1f} s in, all answered after {elapsed:.1f} s")
    b.proc.wait(10)  # its launcher is gone too
    all_blocks_back(a, *languages)


def stop_alone(worker: WorkerProcess, host) -> float:
    """Ctrl-C (SIGINT) to the worker's launcher; once it exits (0, or ended by the signal as
    SGLang's server is), no process of it is left on its host (nothing else runs there). The
    seconds it took to exit."""
    stopped = time.monotonic()
    worker.proc.send_signal(signal.SIGINT)
    assert worker.proc.wait(30) in (0, -signal.SIGINT)
    took = time.monotonic() - stopped
    deadline = time.monotonic() + 30  # what this catches is a process left for good
    while (left := subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()):
        assert time.monotonic() < deadline, [psutil.Process(int(pid)).cmdline() for pid in left]
        time.sleep(0.1)
    return took


@pytest.mark.serial  # timed: the exit within 2 s
def test_ctrl_c_right_after_a_4k_image_ends_the_encode_worker_within_2_s(net, workers) -> None:
    """(Last but one in this module: it stops the encoder.) Every block of both pools is back
    after the 4K requests above, SIGINT ends the encode worker at once (within 2 s)
    and leaves no process of it on its host."""
    encode, language = workers
    health = encoder_health(encode)
    assert health["free_blocks"] == health["num_blocks"], health
    idle = connector_idle(language)
    assert idle["free_blocks"] == idle["num_blocks"], idle
    took = stop_alone(encode, net["encoder"])
    # the 2 s docs/flow_control.md promises: the close's own wait, then half a second for the signal,
    # uvicorn's stop and the exit
    assert took < CLOSE_WAIT_S + 0.5, f"the encode worker took {took:.2f}s to exit"


def test_ctrl_c_ends_the_language_server_and_every_process_it_started(net, workers) -> None:
    """(After the encoder's stop.) SGLang's server leaves no process behind on its host."""
    stop_alone(workers[1], net["language"])
