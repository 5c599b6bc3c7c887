"""The cluster's embedding cache on a real Mooncake Store (``mooncake_master``) between two encode
workers (SGLang's encoder) and two SGLang language servers: an image one server had encoded is
taken from the store by the other, with no forward pass; an image sent by path is encoded once
for both servers; a forged or changed entry, or one of another fingerprint, never reaches a
prefill; an encoder killed under load, with entries in the memory it lent the store, and the master
killed mid-trace cost no request its answer; each worker's store client moves entries with the
worker's own transfer engine. The language servers keep no
cache of their own here, so every image is looked up in the cluster's. Every answer is checked against
transformers' monolithic model on the seeded checkpoint."""

from __future__ import annotations

import base64
import hashlib
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
from monolithic import greedy_mismatch
from sglang_stack import (
    connector_idle,
    encode_worker,
    encoder_health,
    generate,
    image_reference,
    language_server,
    metric,
    write_images,
)

from harness.workers import MooncakeMaster, WorkerProcess, start_together
from worker_infra.embedding_store import MAX_CACHE_SALT_CHARS, media_key, pack, unpack

pytestmark = pytest.mark.sglang

SECRET = "the-cluster-secret-of-the-cache-tests"
ENCODED = 'epd_encoder_items_total{source="encoded"}'
REUSED = 'epd_encoder_items_total{source="reused"}'
PUT = 'epd_global_cache_puts_total{outcome="ok"}'
# a language server's stop with the master gone: halfway between SGLang's own shutdown (a few
# seconds here) and the store client's destructor's wait for the master (16 s measured)
STOP_BOUND_S = 10.0


@dataclass
class Cluster:
    encoders: list[WorkerProcess]
    languages: list[WorkerProcess]

    def total(self, name: str) -> float:
        return sum(metric(encoder, name) for encoder in self.encoders)


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("cache-images"))


@pytest.fixture(scope="module")
def reference(folder):
    return image_reference(folder)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    master = MooncakeMaster(tmp_path_factory.mktemp("master") / "master.log")
    yield master
    master.kill()


@pytest.fixture(scope="module")
def cluster(folder, master):
    flags = ("--mm-global-cache-master", master.address, "--control-secret", SECRET)
    encoders = start_together(*[lambda: encode_worker(folder, *flags, "--mm-global-cache-segment-bytes",
                                                      str(256 << 20))] * 2)
    try:
        # their own caches off: every image is looked up in the cluster's
        languages = start_together(*[lambda: language_server(folder, [e.url for e in encoders], *flags,
                                                             "--image-embedding-cache-bytes", "0")] * 2)
    except BaseException:
        for encoder in encoders:
            encoder.stop()
        raise
    yield Cluster(encoders, languages)
    for worker in (*languages, *encoders):
        worker.stop()


@pytest.fixture
def store(master):
    """A store client of the test's own (a worker of the cluster, as far as the master knows)."""
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address) == 0
    yield client
    client.close()


def data_uri(path: str) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def key_of(cluster: Cluster, path: str, fingerprint: str | None = None) -> str:
    fingerprint = fingerprint or encoder_health(cluster.encoders[0])["preprocessing"]
    return media_key("image", hashlib.sha256(Path(path).read_bytes()).hexdigest(), fingerprint)


def answer(language: WorkerProcess, path: str, rid: str, reference, by_path: bool = False, **extra) -> dict:
    """A greedy ``/generate`` for the image at ``path`` (a data: URI of it, or its path; ``extra``:
    more body fields), checked against the monolithic reference; its ``meta_info``."""
    got = generate(language, [path if by_path else data_uri(path)], rid, **extra)
    assert got.status_code == 200, got.text
    body = got.json()
    assert greedy_mismatch(body["output_ids"], reference([path])) is None
    return body["meta_info"]


def wait_for_puts(cluster: Cluster, count: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.total(PUT) < count:
        assert time.monotonic() < deadline, f"{cluster.total(PUT)} entries written, {count} expected"
        time.sleep(0.1)


def engine_ports(worker: WorkerProcess) -> set[int]:
    """The ports ``worker``'s process listens on in Mooncake's range (an engine's handshake and data ports)."""
    return {c.laddr.port for c in psutil.Process(worker.proc.pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and 15000 <= c.laddr.port <= 17000}


def test_each_worker_has_one_transfer_engine_which_its_store_client_shares(cluster) -> None:
    """A store client of its own engine would listen on two more ports (and start its own threads)."""
    for worker in (*cluster.encoders, *cluster.languages):
        assert len(engine_ports(worker)) == 2, (worker.mode, sorted(engine_ports(worker)))
    for encoder in cluster.encoders:  # and that engine is the connector's (the one its peers are told of)
        assert int(re.search(r"mooncake=[\d.]+:(\d+)", encoder.ready_line).group(1)) in engine_ports(encoder)


def test_an_image_one_server_had_encoded_is_taken_from_the_store_by_the_other(cluster, images, reference) -> None:
    encoded, written = cluster.total(ENCODED), cluster.total(PUT)
    first = answer(cluster.languages[0], images["1920x1080"], "cache-first", reference)
    assert first["stored_images"] == 0
    wait_for_puts(cluster, written + 1)
    for i, language in enumerate(cluster.languages):
        again = answer(language, images["1920x1080"], f"cache-again-{i}", reference)
        assert again["stored_images"] == 1 and again["encode_ms"] == 0  # no encoder asked
    assert cluster.total(ENCODED) == encoded + 1


def test_an_image_sent_by_path_is_encoded_once_for_both_servers(cluster, images, reference) -> None:
    encoded, reused, written = cluster.total(ENCODED), cluster.total(REUSED), cluster.total(PUT)
    answer(cluster.languages[0], images["448x448"], "path-first", reference, by_path=True)
    wait_for_puts(cluster, written + 1)
    answer(cluster.languages[1], images["448x448"], "path-other", reference, by_path=True)
    assert (cluster.total(ENCODED), cluster.total(REUSED)) == (encoded + 1, reused + 1)


def test_a_cache_salt_reads_and_counts_only_its_own_entries(cluster, images, reference) -> None:
    """SGLang's ``cache_salt`` keeps tenants apart in the cluster's cache, through the native API and
    the OpenAI API alike: an image in the store without a salt (the tests above wrote it) is a miss
    for tenant a, whose request encodes it and writes tenant a's own entry; tenant a's next request,
    on the other server, takes that one; tenant b's first request misses again."""
    path = images["1920x1080"]
    encoded, written = cluster.total(ENCODED), cluster.total(PUT)
    first = answer(cluster.languages[0], path, "salt-a-first", reference, cache_salt="tenant-a")
    assert first["stored_images"] == 0 and cluster.total(ENCODED) == encoded + 1
    wait_for_puts(cluster, written + 1)
    again = answer(cluster.languages[1], path, "salt-a-again", reference, cache_salt="tenant-a")
    assert again["stored_images"] == 1 and again["encode_ms"] == 0 and cluster.total(ENCODED) == encoded + 1
    chat = {"model": "qwen", "max_tokens": 4, "temperature": 0, "cache_salt": "tenant-b", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(path)}},
                                     {"type": "text", "text": "Describe it."}]}]}
    reply = requests.post(f"{cluster.languages[1].url}/v1/chat/completions", json=chat, timeout=300)
    assert reply.status_code == 200, reply.text
    assert cluster.total(ENCODED) == encoded + 2  # tenant b found none of the others' entries
    overlong = requests.post(f"{cluster.languages[1].url}/v1/chat/completions", timeout=60,
                             json={**chat, "cache_salt": "s" * (MAX_CACHE_SALT_CHARS + 1)})
    assert overlong.status_code == 400 and "cache_salt of 1025 characters" in overlong.text, overlong.text
    assert cluster.total(ENCODED) == encoded + 2  # refused before any encoder was asked


def read_entry(store, key: str) -> np.ndarray:
    blob = np.empty(store.get_size(key), np.uint8)
    assert store.get_into(key, blob.ctypes.data, blob.nbytes) == blob.nbytes
    return blob


def test_a_forged_or_changed_entry_or_one_of_another_fingerprint_never_reaches_a_prefill(
        cluster, images, reference, store) -> None:
    decoy, changed, forged, unread = images["448x448"], images["1920x1080"], images["other"], images["3840x2160"]
    for i, path in enumerate((decoy, changed)):  # their entries in the store (the tests before wrote them)
        answer(cluster.languages[0], path, f"in-store-{i}", reference)
        deadline = time.monotonic() + 30
        while store.get_size(key_of(cluster, path)) <= 0:
            assert time.monotonic() < deadline, f"{path} is not in the store"
            time.sleep(0.1)
    decoy_item = unpack(key_of(cluster, decoy), read_entry(store, key_of(cluster, decoy)), SECRET.encode())
    # what the comparison would catch: the decoy's rows in another image's place
    assert reference([forged]).ids != reference([decoy]).ids
    entries = {
        # written by someone without the cluster's secret
        key_of(cluster, forged): pack(key_of(cluster, forged), decoy_item, b"a guess at the secret"),
        # well tagged, under another preprocessing's key: never read for this one
        key_of(cluster, unread, "0" * 32): pack(key_of(cluster, unread, "0" * 32), decoy_item, SECRET.encode()),
    }
    real = read_entry(store, key_of(cluster, changed))
    real[len(real) // 2] ^= 0xFF  # a byte of its rows changed after it was written
    entries[key_of(cluster, changed)] = real
    for key, blob in entries.items():
        assert store.upsert_from(key, blob.ctypes.data, blob.nbytes) == 0
    rejected = sum(metric(lang, 'epd_global_cache_lookups_total{outcome="rejected"}') for lang in cluster.languages)
    encoded = cluster.total(ENCODED)
    for i, path in enumerate((forged, changed, unread)):
        meta = answer(cluster.languages[1], path, f"forged-{i}", reference)
        assert meta["stored_images"] == 0
    assert cluster.total(ENCODED) == encoded + 3
    assert sum(metric(lang, 'epd_global_cache_lookups_total{outcome="rejected"}')
               for lang in cluster.languages) == rejected + 2
    log = "".join(cluster.languages[1].log)
    assert "held a bad entry under" in log and "its bytes do not match its tag" in log


def test_an_encoder_killed_with_entries_in_its_lent_memory_costs_no_request_its_answer(cluster, images,
                                                                                       reference) -> None:
    """The store keeps entries in the memory the encoders lend it: one encoder killed (kill -9)
    under 8 clients takes its share of them along. Every request still gets the reference's
    tokens: a lookup of a lost entry is a miss (or gives up within its bound), the image goes to
    the encoder alive (the requests the dead one held fail over to it), and no block stays taken."""
    paths = [images[name] for name in ("448x448", "1920x1080", "other", "3840x2160")]
    encoded, written = cluster.total(ENCODED), cluster.total(PUT)
    for i, path in enumerate(paths):  # every entry in the store, in either encoder's memory
        answer(cluster.languages[i % 2], path, f"before-encoder-kill-{i}", reference)
    wait_for_puts(cluster, written + cluster.total(ENCODED) - encoded)
    victim, survivor = cluster.encoders
    trace = [(cluster.languages[i % 2], [paths[i % len(paths)]], f"encoder-kill-{i}") for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(generate, *request) for request in trace]
        # killed once it holds a request or has answered one (entries taken from the store are
        # answered in milliseconds: a poll may miss them all), or after 5 s
        served, deadline = metric(victim, "epd_encoder_items_total"), time.monotonic() + 5
        while (encoder_health(victim)["pending"] == 0 and metric(victim, "epd_encoder_items_total") == served
               and time.monotonic() < deadline):
            time.sleep(0.01)
        victim.proc.kill()
        victim.proc.wait(10)
        for (_, image, rid), got in zip(trace, answers, strict=True):
            response = got.result(timeout=300)
            assert response.status_code == 200, (rid, response.text)
            assert greedy_mismatch(response.json()["output_ids"], reference(image)) is None, rid
    for i, path in enumerate(paths):  # and after it: each from the store or encoded by the survivor
        answer(cluster.languages[i % 2], path, f"after-encoder-kill-{i}", reference)
    assert metric(survivor, "epd_encoder_items_total") > 0
    for language in cluster.languages:
        idle = connector_idle(language)
        assert idle["free_blocks"] == idle["num_blocks"], idle
    cluster.encoders = [survivor]  # what the tests after this one have


def test_the_master_killed_mid_trace_costs_no_request_its_answer(cluster, master, images, reference) -> None:
    trace = [images[name] for name in ("448x448", "other", "1920x1080")]
    answer(cluster.languages[0], trace[0], "before-kill", reference)  # from the store
    master.kill()
    encoded = cluster.total(ENCODED)
    encoded_by = [metric(encoder, ENCODED) for encoder in cluster.encoders]
    for i, path in enumerate(trace):  # their lookups fail now: each encoded again
        started = time.monotonic()
        meta = answer(cluster.languages[i % 2], path, f"after-kill-{i}", reference)
        assert meta["stored_images"] == 0
        # at most one bounded wait for the store (2 s) on each side, beside the encode and prefill
        assert time.monotonic() - started < 60
    assert cluster.total(ENCODED) == encoded + len(trace)
    # the hash routing may send all three to one encoder: the other never asked the store
    asked = [encoder for encoder, before in zip(cluster.encoders, encoded_by, strict=True)
             if metric(encoder, ENCODED) > before]
    assert asked
    for worker in (*cluster.languages, *asked):
        assert metric(worker, "epd_global_cache_available") == 0
        assert any("is unavailable" in line for line in worker.log)
    for language in cluster.languages:  # every block of both pools back
        idle = connector_idle(language)
        assert idle["free_blocks"] == idle["num_blocks"], idle
    # and a server stops promptly with the master gone: its store client, whose destructor waits on
    # the master with the GIL held (16-30 s), is never destroyed
    started = time.monotonic()
    cluster.languages[1].stop()
    stopped_in = time.monotonic() - started
    print(f"\nSGLang's language server stopped {stopped_in:.1f} s after SIGINT, the master gone")
    assert stopped_in < STOP_BOUND_S
