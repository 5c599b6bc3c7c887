"""Encode and language workers as real processes over HTTP on loopback, real Mooncake, SGLang's encoder
(the numpy test double beside it where a test only needs rows, in-process)."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
from conftest import ManualClock
from fake_encoder import FakeEncoder
from image_cache import saved_image
from PIL import Image
from sglang_stack import encoded_rows
from test_faults import wait_for
from transfer_large_image import make_image, run_request

from connector.config import ConnectorConfig
from connector.poll import KVPoll
from connector.receiver import EmbeddingReceiver
from harness.workers import InProcessWorker, WorkerProcess, embedding_width, start_together
from sglang_ext.launch_server import CLOSE_WAIT_S

EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"
JOIN_S = 1.0  # the made-up rooms' join wait (the test moves the clock past it)


class Pair:
    """An encode worker and a transfer-only language worker: SGLang's encoder on ``model_path``, or
    the numpy test double without it. ``args`` go to both."""

    def __init__(self, *args: str, model_path: str | None = None, encode_args: tuple[str, ...] = (),
                 language_args: tuple[str, ...] = ()) -> None:
        model = ("--model-path", model_path) if model_path else ()
        width = ("--hidden-size", str(embedding_width(model_path))) if model_path else ()
        self.encode, self.language = start_together(
            lambda: WorkerProcess("encode", *args, *model, *encode_args, fake_encoder=not model_path),
            lambda: WorkerProcess("language", *args, *width, *language_args))
        self.rooms = iter(range(1000, 10**6))

    @classmethod
    def of(cls, encode: WorkerProcess, language: WorkerProcess) -> Pair:
        """A pair around workers started some other way (e.g. by SGLang's launcher)."""
        pair = cls.__new__(cls)
        pair.encode, pair.language, pair.rooms = encode, language, iter(range(1000, 10**6))
        return pair

    def request(self, images: list[str], rid: str | None = None, timeout: float = 120) -> dict:
        room = next(self.rooms)
        return run_request(self.encode.url, self.language.url, self.encode.bootstrap_port, rid or f"rid-{room}",
                           room, images, timeout)

    def pools_free(self) -> dict[str, bool]:
        out = {}
        for worker in (self.encode, self.language):
            text = requests.get(f"{worker.url}/metrics", timeout=10).text
            free = float(re.search(r'epd_pool_blocks_free\{role="\w+"\} (\S+)', text).group(1))
            used = float(re.search(r'epd_pool_blocks_used\{role="\w+"\} (\S+)', text).group(1))
            out[worker.mode] = used == 0 and free > 0
        return out

    def stop(self) -> None:
        for worker in (self.language, self.encode):
            assert worker.stop() == 0, f"{worker.mode} worker did not shut down cleanly"

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def language_health(worker: WorkerProcess) -> dict:
    return requests.get(f"{worker.url}/health", timeout=10).json()


def requests_in(worker: WorkerProcess) -> int:
    """The requests a language worker has taken, in any phase short of their answer."""
    health = language_health(worker)
    return health["resolving"] + health["queued"] + health["transferring"]


def metrics(worker: WorkerProcess) -> str:
    return requests.get(f"{worker.url}/metrics", timeout=10).text


def assert_pools_free(pair: Pair, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while (state := pair.pools_free()) != {"encode": True, "language": True}:
        assert time.monotonic() < deadline, f"pools not free after the test: {state}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def pair(seeded_checkpoint):
    p = Pair(model_path=seeded_checkpoint(3584))
    yield p
    p.stop()


@pytest.fixture(scope="module")
def in_process_encode():
    """An encode worker with the pair's flags, its app served in this process (the fast tier's path),
    on the test double (what it is asked here is refused before any encoder runs)."""
    worker = InProcessWorker("encode", encoder=FakeEncoder())
    yield worker
    worker.stop()


@pytest.fixture(autouse=True)
def pools_free_after(request):
    yield
    if "pair" in request.fixturenames and request.getfixturevalue("pair").encode.proc.poll() is None:
        assert_pools_free(request.getfixturevalue("pair"))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("images")
    sizes = {"4k": (3840, 2160), "2k": (2048, 2048), "1k": (1024, 1024), "small": (448, 448), "odd": (1000, 300)}
    out = {name: saved_image(root / f"{name}.png", w, h, seed=seed) for seed, (name, (w, h)) in enumerate(sizes.items(), 1)}
    for i in range(4):
        out[f"hd{i}"] = saved_image(root / f"hd{i}.jpg", 1920, 1080, seed=100 + i, quality=90)
    return out


@pytest.fixture(scope="module")
def reference_rows(seeded_checkpoint, images, tmp_path_factory) -> dict[str, bytes]:
    """The rows of the 4K and the four HD images through SGLang's encoder in a process of its own,
    one image a forward pass."""
    paths = [images["4k"], *(images[f"hd{i}"] for i in range(4))]
    rows = encoded_rows(seeded_checkpoint(3584), paths, tmp_path_factory.mktemp("rows") / "rows.safetensors")
    return {path: rows[path].numpy().tobytes() for path in paths}


def reference_sha(rows: dict[str, bytes], paths: list[str]) -> str:
    """The digest of one request's embedding: its images' rows in order."""
    return hashlib.sha256(b"".join(rows[p] for p in paths)).hexdigest()


@pytest.mark.fast
def test_a_cancel_between_success_and_assembly_fails_that_request_and_nothing_else(images, monkeypatch,
                                                                                  caplog) -> None:
    """A cancel that comes after the scheduler read ``Success`` and before it assembled the
    embedding fails that request alone (not "cannot assemble in phase CLOSED" raised in the step,
    the rest of that step dropped). Forced here by cancelling as the scheduler calls assemble()."""
    encode, lang = InProcessWorker("encode", encoder=FakeEncoder()), InProcessWorker("language")
    worker, cancelled = lang.built.worker, []
    real_assemble = EmbeddingReceiver.assemble

    def assemble(receiver: EmbeddingReceiver):  # noqa: ANN202
        if receiver.room == 1 and not cancelled:
            assert receiver.poll() == KVPoll.Success
            cancelled.append(worker.cancel("victim", "aborted between its Success and its assembly"))
        return real_assemble(receiver)

    monkeypatch.setattr(EmbeddingReceiver, "assemble", assemble)
    try:
        with ThreadPoolExecutor(2) as pool:
            victim, other = (pool.submit(run_request, encode.url, lang.url, encode.bootstrap_port, rid, room,
                                         [images["small"]], 60) for rid, room in (("victim", 1), ("other", 2)))
            victim, other = victim.result(), other.result()
        assert cancelled == [True], (victim, other)
        assert victim["language_status"] == 499 and "between its Success" in victim["language_error"], victim
        assert other["match"], other
        assert not [r for r in caplog.records if "scheduler step failed" in r.getMessage()]
        assert worker.allocator.all_free()
    finally:
        lang.stop()
        encode.stop()


@pytest.mark.fast
@pytest.mark.parametrize("language_secret, told", [
    ("another-secret-of-enough-length", "refused this worker's control secret (401): set the same --control-secret"),
    (None, "needs a control secret (401) and this worker has none: set --control-secret")])
def test_a_control_secret_mismatch_is_named_to_the_client(images, language_secret, told) -> None:
    """An encoder with a control secret and a language worker with another (or none): the client's
    request gets the mismatch and the flag to set, not "unreachable"; nothing is held on either side."""
    encode = InProcessWorker("encode", "--control-secret", "the-encoders-secret-of-enough-length",
                             "--bootstrap-timeout", "1", encoder=FakeEncoder())  # its init never comes
    lang = InProcessWorker("language", *(("--control-secret", language_secret) if language_secret else ()))
    try:
        r = run_request(encode.url, lang.url, encode.bootstrap_port, "mismatched", 1, [images["small"]], 60)
        assert r["language_status"] == 502 and told in r["language_error"], r
        assert f"encode bootstrap 127.0.0.1:{encode.bootstrap_port} " in r["language_error"], r
        assert r["encode_status"] == 504, r
        assert lang.built.worker.allocator.all_free()
    finally:
        lang.stop()
        encode.stop()


@pytest.mark.fast
def test_rooms_clients_make_up_hold_half_the_pool_at_most_and_end_at_the_join_wait(images) -> None:
    """Clients of the two-request flow name rooms their (real, allowed) encoder has no encode
    request for. Between them such rooms hold at most half the pool: with 4 blocks each in a
    pool of 16, two hold 8 and a third waits in the queue while a room of the server's own (the
    one-request kind) is served from the other half; the made-up rooms end at the join wait
    (1 s here, on a clock the test moves), the third after its own, blocks back, the encoder not
    counted as failing, and a real two-request request is served then."""
    encode = InProcessWorker("encode", encoder=FakeEncoder())
    lang = InProcessWorker("language", "--embedding-cache-buffer-size", "16", "--multimodal-block-size", "128",
                           "--embedding-default-allocate-buffer-size", "512", "--join-timeout", str(JOIN_S))
    worker = lang.built.worker
    # The rooms' clock stands still until moved: the made-up rooms hold their share until the
    # test passes their join wait, however slow this run is to look.
    worker.receivers.clock = clock = ManualClock()
    made_up = {"bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port}
    try:
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(requests.post, f"{lang.url}/generate", timeout=30,
                                json={**made_up, "rid": f"made-up-{i}", "bootstrap_room": 9000 + i}) for i in range(3)]
            wait_for(lambda: worker.allocator.free_blocks == 8 and worker.health()["queued"] == 1, EVENTUALLY_S,
                     "two made-up rooms holding their share, the third queued")
            own = worker.submit("own", f"127.0.0.1:{encode.bootstrap_port}", 4242)  # as the dispatch submits
            encoded = requests.post(f"{encode.url}/encode", timeout=30,
                                    json={"rid": "own", "bootstrap_room": 4242, "images": [images["small"]]})
            assert encoded.status_code == 200, encoded.text
            assert own.result(timeout=30)["sha256"] == encoded.json()["sha256"]
            # both moves together stay under an abort's ack wait: the made-up rooms' acks free their blocks
            assert 2 * (JOIN_S + 1) < worker.receivers.config.abort_ack_timeout
            clock.advance(JOIN_S + 1)
            wait_for(lambda: sum(f.done() for f in held) == 2, EVENTUALLY_S, "two made-up rooms to end")
            third = 9000 + next(i for i, f in enumerate(held) if not f.done())
            # its init reached the encoder: its join wait started on the clock as it stands now
            wait_for(lambda: encode.built.worker.sender.asked_for(third), EVENTUALLY_S, "the third room's init")
            clock.advance(JOIN_S + 1)
            answers = [f.result() for f in held]
        assert all(a.status_code == 504 and "has no encode request for room" in a.text for a in answers), \
            [a.text for a in answers]
        wait_for(worker.allocator.all_free, EVENTUALLY_S, "the made-up rooms' blocks")
        assert worker.health()["failing_encoders"] == []
        real = run_request(encode.url, lang.url, encode.bootstrap_port, "real", 42, [images["small"]], 30)
        assert real["match"], real
    finally:
        lang.stop()
        encode.stop()


@pytest.mark.parametrize("mode", ["encode", "language"])
def test_a_worker_whose_picked_port_another_process_took_starts_on_another(monkeypatch, mode) -> None:
    """The harness (the main job, the scripts and the tests start workers through it) picks free
    ports, and another process may bind one before the worker does: the start sees the bind fail
    and picks again, instead of failing the run."""
    from harness import workers
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    monkeypatch.setattr(workers, "free_port", lambda: next(picks, None) or socket_free_port())
    worker = WorkerProcess(mode, fake_encoder=mode == "encode")
    try:
        assert worker.port != taken.getsockname()[1]
        assert requests.get(f"{worker.url}/health", timeout=10).status_code == 200
    finally:
        worker.stop()
        taken.close()


def test_an_encode_worker_without_a_model_is_a_clear_error() -> None:
    """No built-in encoder: SGLang's launcher refuses the encode mode without --model-path, saying why."""
    with pytest.raises(RuntimeError, match="error: an encode worker needs --model-path: the checkpoint whose encoder"):
        WorkerProcess("encode", timeout=60)


@pytest.mark.fast
def test_an_in_process_encode_worker_without_a_model_is_refused_the_same_way() -> None:
    with pytest.raises(SystemExit, match="an encode worker needs --model-path"):
        InProcessWorker("encode")


def socket_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_4k_image_takes_a_resume_round_and_arrives_as_sglangs_encoder_made_it(pair, images, reference_rows) -> None:
    res = pair.request([images["4k"]])
    assert res["match"], res
    assert res["tokens"] == 10_549 and res["resume_rounds"] >= 1
    assert res["sha256"] == reference_sha(reference_rows, [images["4k"]])


def test_multi_image_request_gives_one_embedding_in_image_order(pair, images, reference_rows) -> None:
    """Four images in one forward pass arrive as the rows each gives alone, in the request's order."""
    paths = [images[f"hd{i}"] for i in range(4)]
    res = pair.request(paths)
    assert res["match"] and res["tokens"] == 4 * 2691 and res["resume_rounds"] == 1
    assert res["sha256"] == reference_sha(reference_rows, paths)
    assert res["sha256"] != reference_sha(reference_rows, paths[::-1])


def test_eight_concurrent_requests_of_mixed_sizes(pair, images) -> None:
    mix = [[images["4k"]], [images["small"]], [images["2k"]], [images["1k"]], [images["odd"]],
           [images["hd0"], images["hd1"]], [images["4k"]], [images["small"], images["1k"]]]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(pair.request, mix))
    assert all(r["match"] for r in results), results
    assert sum(r["resume_rounds"] for r in results) >= 2


def data_uri(payload: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(payload).decode()


@pytest.mark.parametrize("body, status, words", [
    ({"rid": "b1", "bootstrap_room": 1, "images": [data_uri(b"\x89PNG garbage" * 50)]}, 400, "not a decodable"),
    ({"rid": "b2", "bootstrap_room": 2, "images": ["gopher://x/y.png"]}, 400, "unsupported scheme"),
    ({"rid": "b3", "bootstrap_room": 3, "images": ["http://127.0.0.1:1/a.png"]}, 400, "unreachable"),
    ({"rid": "b4", "bootstrap_room": 4}, 400, "images must be a list of 1 to 16 references"),
    ({"rid": "b5", "bootstrap_room": -5, "images": ["x.png"]}, 400, "bootstrap_room must be"),
    ({"rid": "b6", "bootstrap_room": "seven", "images": ["x.png"]}, 400, "wrong type"),
    ({"rid": "b7", "bootstrap_room": 8, "images": []}, 400, "list of 1 to"),
])
@pytest.mark.parametrize("where", ["process", pytest.param("in_process", marks=pytest.mark.fast)])
def test_bad_encode_requests_get_4xx_with_a_clear_message(request, where, body, status, words) -> None:
    encode = request.getfixturevalue("in_process_encode") if where == "in_process" else request.getfixturevalue(
        "pair").encode
    resp = requests.post(f"{encode.url}/encode", json=body, timeout=30)
    assert resp.status_code == status
    message = resp.json()["error"]
    assert words in message and len(message) < 300 and "Traceback" not in message


def test_bad_generate_requests_get_4xx_or_name_the_unreachable_peer(pair) -> None:
    url = f"{pair.language.url}/generate"
    resp = requests.post(url, data=b"{not json", timeout=10)
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]
    resp = requests.post(url, json={"rid": "g1", "bootstrap_host": "127.0.0.1", "bootstrap_room": 1}, timeout=10)
    assert resp.status_code == 400 and "missing field 'bootstrap_port'" in resp.json()["error"]
    for host in ("127.0.0.1:31001/x?", "evil.example/route#", "a b", "", "x" * 300, "-bad-.example"):
        resp = requests.post(url, json={"rid": "g0", "bootstrap_host": host, "bootstrap_port": 8998,
                                        "bootstrap_room": 1}, timeout=10)
        assert resp.status_code == 400 and "bootstrap_host must be a host name or an IP address" in resp.text
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    resp = requests.post(url, json={"rid": "g2", "bootstrap_host": "127.0.0.1", "bootstrap_port": dead_port,
                                    "bootstrap_room": 2}, timeout=30)
    assert resp.status_code == 502 and f"127.0.0.1:{dead_port} unreachable" in resp.json()["error"]


class _Banner(BaseHTTPRequestHandler):
    """A web server that is not an encoder: it says who it is in every answer."""

    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        self.hits.append(self.path)
        self.send_response(404)
        self.send_header("Server", "internal-admin/1.0")
        self.end_headers()
        self.wfile.write(b"internal admin console")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.serial  # timed: refused at once, not after a route lookup's connect timeout
def test_the_language_worker_contacts_no_host_a_client_names_and_reflects_nothing(pair) -> None:
    """A /generate with bootstrap_host/bootstrap_port must not make the worker GET
    http://HOST:PORT/route for any host and put the remote status (or the connection error) in
    its 502 (an SSRF and port-scan oracle): only allowed encoders are contacted (loopback here,
    ``--allowed-bootstrap-hosts 127.0.0.1``), and a failed lookup reads the same whatever answered."""
    url = f"{pair.language.url}/generate"

    def generate(rid: str, host: str, port: int) -> requests.Response:
        return requests.post(url, json={"rid": rid, "bootstrap_host": host, "bootstrap_port": port,
                                        "bootstrap_room": 5}, timeout=30)

    servers = {host: ThreadingHTTPServer((host, 0), _Banner) for host in ("127.0.0.1", "127.0.0.2")}
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        elsewhere = servers["127.0.0.2"].server_address[1]
        for host, port in (("127.0.0.2", elsewhere), ("10.255.255.1", 80), ("localhost", pair.encode.bootstrap_port)):
            start = time.monotonic()
            resp = generate("s1", host, port)
            assert resp.status_code == 403 and "not an encoder this worker may contact" in resp.json()["error"]
            # halfway to a route lookup's bound (the heartbeat interval): the named host was never looked up
            assert time.monotonic() - start < ConnectorConfig().heartbeat_interval / 2
        time.sleep(0.5)
        assert _Banner.hits == []  # nothing was fetched from the host a client named
        banner_port = servers["127.0.0.1"].server_address[1]
        resp = generate("s2", "127.0.0.1", banner_port)
        assert resp.status_code == 502 and len(_Banner.hits) >= 1  # allowed: looked up, and it is no encoder
        error = resp.json()["error"]
        unported = error.replace(f":{banner_port} ", " ")  # the port's digits may read 404
        assert "404" not in unported and "admin" not in error and "Not Found" not in error, error
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed_port = s.getsockname()[1]
        closed = generate("s3", "127.0.0.1", closed_port).json()["error"]
        # an open port that is not an encoder and a closed one read the same
        assert error.replace("s2", "RID").replace(str(banner_port), "PORT") == \
            closed.replace("s3", "RID").replace(str(closed_port), "PORT")
    finally:
        for server in servers.values():
            server.shutdown()


def test_duplicate_rid_is_refused_while_the_first_is_in_flight(pair, images) -> None:
    body = {"rid": "dup", "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.encode.bootstrap_port,
            "bootstrap_room": 4242}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(requests.post, f"{pair.language.url}/generate", json=body, timeout=60)
        wait_for(lambda: requests_in(pair.language) >= 1, EVENTUALLY_S, "the first request to reach the language worker")
        second = requests.post(f"{pair.language.url}/generate", json={**body, "bootstrap_room": 4243}, timeout=10)
        assert second.status_code == 409 and "already in progress" in second.json()["error"]
        enc = requests.post(f"{pair.encode.url}/encode", json={"rid": "dup", "bootstrap_room": 4242,
                                                              "images": [images["small"]]}, timeout=60)
        assert enc.status_code == 200 and first.result().status_code == 200


def test_a_pool_that_forces_several_rounds(images, seeded_checkpoint) -> None:
    pair = Pair(model_path=seeded_checkpoint(3584), language_args=("--embedding-cache-buffer-size", "40", "--embedding-default-allocate-buffer-size", "2048"))
    try:
        res = pair.request([images["2k"]])  # 42 blocks through a 40-block pool, 16 at first
        assert res["match"] and res["resume_rounds"] >= 2, res
        res = pair.request([images["4k"]])  # 83 blocks
        assert res["match"] and res["resume_rounds"] >= 3, res
        assert_pools_free(pair)
    finally:
        pair.stop()
    for port in (pair.encode.port, pair.encode.bootstrap_port, pair.language.port):  # Ctrl-C freed them
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_the_transfer_script_pushes_a_4k_image_through_a_resume_round(tmp_path: Path, seeded_checkpoint) -> None:
    root = Path(__file__).resolve().parent.parent
    make_image(3840, 2160, seed=5).save(tmp_path / "4k.png")
    out = subprocess.run([sys.executable, str(root / "scripts" / "transfer_large_image.py"), str(tmp_path / "4k.png"),
                          "--model-path", seeded_checkpoint(3584), "--json", str(tmp_path / "out.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].split()[:2] == ["request", "images"]
    assert lines[-1] == "1/1 requests matched, 1 resume rounds in all"
    (result,) = json.loads((tmp_path / "out.json").read_text())
    assert (result["tokens"], result["resume_rounds"], result["match"]) == (10549, 1, True)


# The serial tests sit together (under xdist they wait once for the other worker), ctrl-c last: it
# ends the module's encode worker.
@pytest.mark.serial
def test_hostile_media_and_json_get_400_at_once_and_the_worker_serves_on(tmp_path: Path, seeded_checkpoint) -> None:
    media = tmp_path / "media"
    media.mkdir()
    make_image(448, 448, seed=5).save(media / "ok.png")
    Image.new("1", (10_000, 10_000)).save(media / "bomb.png")  # 100 Mpx in a few kB
    os.mkfifo(media / "fifo.png")
    (media / "out.png").symlink_to("/etc/passwd")
    encode = WorkerProcess("encode", "--model-path", seeded_checkpoint(3584), "--allowed-local-media-path", str(media),
                           trusted_media=False)
    pair = Pair.of(encode, WorkerProcess("language"))
    try:
        cases = {"/dev/zero": "only read inside --allowed-local-media-path",
                 "/etc/shadow": "only read inside --allowed-local-media-path",
                 "file:///proc/self/environ": "only read inside --allowed-local-media-path",
                 str(media / "out.png"): "only read inside --allowed-local-media-path",
                 str(media / "fifo.png"): "not a regular file",
                 str(media / "bomb.png"): "over the 40000000-pixel limit",
                 f"{encode.url}/health": "resolves to a non-public address"}
        for room, (ref, words) in enumerate(cases.items()):
            start = time.monotonic()
            resp = requests.post(f"{encode.url}/encode", json={"rid": f"h{room}", "bootstrap_room": room,
                                                               "images": [ref]}, timeout=30)
            assert resp.status_code == 400 and words in resp.json()["error"], (ref, resp.text)
            assert time.monotonic() - start < 5
        nested = "[" * 100_000 + "]" * 100_000
        for url in (f"{encode.url}/encode", f"{pair.language.url}/generate"):
            resp = requests.post(url, data=nested, headers={"Content-Type": "application/json"}, timeout=30)
            assert resp.status_code == 400 and resp.json()["error"] == "body must be a JSON object"
        assert pair.request([str(media / "ok.png")])["match"]
        assert_pools_free(pair)
    finally:
        pair.stop()


@pytest.mark.serial
def test_a_dripping_image_server_is_cut_off_at_the_fetch_deadline_and_holds_up_no_local_image(
        tmp_path: Path, seeded_checkpoint) -> None:
    """Eight image URLs whose server sends four bytes a second (the fetch threads take four at a
    time): each ``/encode`` ends 400 once its whole fetch passed ``--image-fetch-timeout`` (2 s),
    not when the drip ends, and a local image sent meanwhile is encoded at once: as fast as one
    sent before the drip, not behind a fetch deadline."""
    fetch_s = 2.0
    body = io.BytesIO()
    make_image(64, 64, seed=9).save(body, format="PNG")
    png = body.getvalue()
    dripping = []

    class Drip(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            dripping.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            try:
                for byte in png:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    time.sleep(0.25)
            except OSError:  # the encoder hung up
                pass

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    local, before = str(tmp_path / "local.png"), str(tmp_path / "before.png")
    make_image(64, 64, seed=10).save(local)
    make_image(64, 64, seed=11).save(before)
    encode = WorkerProcess("encode", "--model-path", seeded_checkpoint(3584), "--image-fetch-timeout", str(fetch_s))

    def post(rid: str, room: int, ref: str) -> tuple[requests.Response, float]:
        start = time.monotonic()
        answer = requests.post(f"{encode.url}/encode", timeout=60, json={
            "rid": rid, "bootstrap_room": room, "images": [ref], "wait_for_delivery": False})
        return answer, time.monotonic() - start

    try:
        # the worker made its first forward pass (a compile included) before it said READY
        assert any("encoder warmed up: its first forward pass took" in line for line in encode.log)
        answer, alone = post("before", 7099, before)  # a local image with every fetch thread free
        assert answer.status_code == 200, answer.text
        url = f"http://127.0.0.1:{server.server_address[1]}/slow.png"
        with ThreadPoolExecutor(9) as pool:
            slow = [pool.submit(post, f"slow{i}", 7000 + i, url) for i in range(8)]
            wait_for(lambda: len(dripping) >= 4, EVENTUALLY_S, "every fetch thread on a dripping image")
            answer, took = post("local", 7100, local)
            # behind the drip it would wait out a fetch deadline: halfway there from an encode alone
            assert answer.status_code == 200 and took < alone + fetch_s / 2, (answer.text, took, alone)
            for future in slow:
                answer, took = future.result()
                assert answer.status_code == 400 and f"not fetched within {fetch_s:g}s" in answer.json()["error"], \
                    answer.text
                # two rounds of four fetches, each at its deadline, and a deadline's margin (the drip takes minutes)
                assert took < 3 * fetch_s, took
    finally:
        encode.stop()
        server.shutdown()


@pytest.mark.serial
def test_encoder_dying_mid_request_gives_a_5xx_naming_the_peer(images, seeded_checkpoint) -> None:
    pair = Pair("--heartbeat-interval", "0.5", "--heartbeat-max-failure", "2", model_path=seeded_checkpoint(3584))
    try:
        body = {"rid": "die", "bootstrap_host": "127.0.0.1", "bootstrap_port": pair.encode.bootstrap_port,
                "bootstrap_room": 77}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(requests.post, f"{pair.language.url}/generate", json=body, timeout=60)
            # the language side has its route and blocks: it sent its init and waits
            wait_for(lambda: language_health(pair.language)["transferring"] == 1, EVENTUALLY_S, "the init")
            os.kill(pair.encode.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            resp = pending.result()
        assert time.monotonic() - killed < 0.5 * 2 + 2.5
        assert resp.status_code == 502
        assert f"encode peer 127.0.0.1:{pair.encode.bootstrap_port}" in resp.json()["error"]
        assert "dead" in resp.json()["error"]
        wait_for(lambda: 'epd_pool_blocks_used{role="language"} 0.0' in metrics(pair.language), EVENTUALLY_S,
                 "the language pool to be free")
        assert 'epd_failures_total{reason="peer_dead",role="language"} 1.0' in metrics(pair.language)
    finally:
        pair.encode.proc.wait()
        assert pair.language.stop() == 0


@pytest.mark.serial  # it times the exit
def test_ctrl_c_ends_the_encode_worker_within_2s_even_during_a_4k_forward_pass(pair, images) -> None:
    """The encode worker exits within 2 s of SIGINT. Unbounded, its close would wait for the
    forward pass under way (seconds for a 4K image), then for Mooncake to release its engine
    (0.5-1 s), then the interpreter would tear down torch's and transformers' modules (1-3 s). Last in this module: it ends the pair's
    encode worker (after a 4K image through it, with another one being encoded)."""
    assert pair.request([images["4k"]])["match"]
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(pair.request, [images["4k"]])
        deadline = time.monotonic() + 30
        while requests.get(f"{pair.encode.url}/health", timeout=10).json()["pending"] == 0:
            assert time.monotonic() < deadline, "the second 4K image never reached the encoder"
            time.sleep(0.02)
        time.sleep(0.3)  # decoded: in its forward pass
        started = time.monotonic()
        code = pair.encode.stop()
        took = time.monotonic() - started
        failed = pending.result()
    # the README's 2 s: the close's own wait, then half a second for the signal, uvicorn's stop and the exit
    assert code == 0 and took < CLOSE_WAIT_S + 0.5, f"the encode worker exited with {code} after {took:.2f}s"
    assert failed["encode_status"] == 503 and "shutting down" in failed["encode_error"], failed
