"""Backpressure and cancellation between real worker processes (SGLang's encoder).

Over a bound (queue length, staging memory, queue wait) a request gets 503 with
``Retry-After`` at once, and the other side drops the room too; a client that goes away
cancels its request, and the other side's half ends promptly with no work done for it; a peer
that does not answer its route lookup holds up nobody else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import requests
from test_faults import wait_for
from test_workers import Pair, assert_pools_free
from transfer_large_image import make_image

from connector import ConnectorConfig

pytestmark = [pytest.mark.load, pytest.mark.serial]  # refusals are timed

ONE_ALLOCATION = ("--embedding-cache-buffer-size", "64")  # one default allocation (8192 tokens) at a time
# "At once": an answer that waits for nothing. Half the shortest wait it could be held in instead
# (a room's join timeout, 15 s; --queue-timeout is 60 s by default), so a loaded machine's seconds
# do not decide it; which bound ended a request its message tells.
AT_ONCE_S = ConnectorConfig.join_timeout / 2


@pytest.fixture(scope="module")
def model(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bp") / "1024x768.png")
    make_image(1024, 768, seed=7).save(path)
    return path


@pytest.fixture(scope="module")
def small_image(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("bp") / "448x448.png")
    make_image(448, 448, seed=8).save(path)
    return path


@pytest.fixture
def calls() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(16) as pool:
        yield pool


def health(url: str) -> dict:
    return requests.get(f"{url}/health", timeout=10).json()


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the series of ``name`` that carry ``labels``."""
    total = 0.0
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key.partition("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += float(value)
    return total


def generate(pair: Pair, rid: str, room: int, timeout: float = 60, port: int | None = None) -> requests.Response:
    return requests.post(f"{pair.language.url}/generate", timeout=timeout, json={
        "rid": rid, "bootstrap_host": "127.0.0.1", "bootstrap_port": port or pair.encode.bootstrap_port,
        "bootstrap_room": room})


def encode(pair: Pair, rid: str, room: int, images: list[str], timeout: float = 60) -> requests.Response:
    return requests.post(f"{pair.encode.url}/encode", timeout=timeout,
                         json={"rid": rid, "bootstrap_room": room, "images": images})


def timed(call: Callable[[], requests.Response]) -> tuple[requests.Response, float]:
    start = time.monotonic()
    resp = call()
    return resp, time.monotonic() - start


def assert_overloaded(resp: requests.Response, words: str) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.headers["Retry-After"] == "2"
    assert resp.json()["kind"] == "overloaded" and words in resp.json()["error"], resp.json()


def abandoned(future: Future) -> None:
    """Wait for a call whose client timed out on purpose."""
    with pytest.raises(requests.exceptions.ReadTimeout):
        future.result()


def test_an_encoder_over_its_queue_bound_refuses_at_once_and_the_language_side_learns_why(image, calls, model) -> None:
    with Pair(model_path=model, encode_args=("--max-queued-requests", "2")) as pair:
        waiting = [calls.submit(encode, pair, f"q{room}", room, [image]) for room in (1, 2)]  # no /generate yet
        wait_for(lambda: health(pair.encode.url)["pending"] == 2, 15, "two encodes waiting for their language peer")
        refused, seconds = timed(lambda: encode(pair, "q3", 3, [image]))
        assert_overloaded(refused, "2 encode requests are queued (limit 2)")
        assert seconds < AT_ONCE_S
        # The refused room is failed for its language peer too: its /generate ends at once, same kind.
        late, seconds = timed(lambda: generate(pair, "q3", 3))
        assert_overloaded(late, "2 encode requests are queued (limit 2)")
        assert seconds < AT_ONCE_S
        # A room a language worker already asked for is never refused for being one too many.
        rooms = health(pair.encode.url)["active_rooms"]
        asked = calls.submit(generate, pair, "q4", 4)
        # the init has reached the encoder (the language side counts it sent as soon as it is)
        wait_for(lambda: health(pair.encode.url)["active_rooms"] > rooms, 15, "room 4's init at the encoder")
        assert encode(pair, "q4", 4, [image]).status_code == 200 and asked.result().status_code == 200
        for room, call in zip((1, 2), waiting, strict=True):
            assert generate(pair, f"q{room}", room).status_code == 200 and call.result().status_code == 200
        assert_pools_free(pair)


def test_staging_memory_bounds_embeddings_nobody_asked_for_but_never_one_that_was(image, calls, model) -> None:
    # The encode pool holds one 1024x768 embedding (999 tokens, 8 blocks); 1 MiB of staging
    # holds less than one (7 MB). Room 1 borrows the pool, room 2 goes alone into the empty
    # budget, room 3 waits for it, for 1.5 s at most.
    with Pair(model_path=model, encode_args=("--embedding-cache-buffer-size", "8", "--staging-bytes", str(1 << 20),
                                  "--queue-timeout", "1.5")) as pair:
        staged = [calls.submit(encode, pair, "s1", 1, [image])]
        wait_for(lambda: health(pair.encode.url)["free_blocks"] == 0, 15, "room 1 in the pool")
        staged.append(calls.submit(encode, pair, "s2", 2, [image]))
        wait_for(lambda: health(pair.encode.url)["staged_bytes"] > 0, 15, "room 2 staged")
        refused, seconds = timed(lambda: encode(pair, "s3", 3, [image]))
        assert_overloaded(refused, "no host memory for the embedding within 1.5s")
        assert 1.5 - 0.1 < seconds < 1.5 + AT_ONCE_S  # refused at its --queue-timeout
        assert_overloaded(generate(pair, "s3", 3), "no host memory")
        # Room 4 is asked for first: it needs no staging, and room 1 gives its blocks back for it.
        asked = calls.submit(generate, pair, "s4", 4)
        wait_for(lambda: health(pair.language.url)["transferring"] == 1, 15, "room 4's init")
        assert encode(pair, "s4", 4, [image], timeout=10).status_code == 200
        assert asked.result().status_code == 200
        for room, call in zip((1, 2), staged, strict=True):  # both still wait for their peer, then go
            assert generate(pair, f"s{room}", room).status_code == 200 and call.result().status_code == 200
        wait_for(lambda: health(pair.encode.url)["staged_bytes"] == 0, 30, "the staging memory back")
        assert_pools_free(pair)


def test_the_language_queue_is_bounded_in_length_and_in_time(image, calls, model) -> None:
    with Pair(model_path=model, language_args=(*ONE_ALLOCATION, "--max-queued-requests", "2", "--queue-timeout", "2")) as pair:
        holder = calls.submit(generate, pair, "l1", 1)  # holds the whole pool, waiting for its encode
        wait_for(lambda: health(pair.language.url)["transferring"] == 1, 15, "room 1's init")
        queued = [calls.submit(timed, lambda room=room: generate(pair, f"l{room}", room)) for room in (2, 3)]
        wait_for(lambda: health(pair.language.url)["queued"] == 2, 15, "two queued requests")
        refused, seconds = timed(lambda: generate(pair, "l4", 4))
        assert_overloaded(refused, "2 requests are queued (limit 2)")
        assert seconds < AT_ONCE_S
        # The encoder hears of the refusal (it fails the room it has not seen yet): the room's
        # encode then ends before any work.
        wait_for(lambda: any("room 4 failed: aborted by language peer" in line for line in pair.encode.log), 30,
                 "the encoder to fail room 4")
        dropped, seconds = timed(lambda: encode(pair, "l4", 4, [image]))
        assert dropped.status_code == 502 and "aborted by language peer" in dropped.json()["error"], dropped.text
        assert seconds < AT_ONCE_S
        for resp, seconds in (f.result() for f in queued):
            assert_overloaded(resp, "no free blocks for the default allocation within 2s")
            assert 2 - 0.1 < seconds < 2 + AT_ONCE_S  # refused at its --queue-timeout
        assert encode(pair, "l1", 1, [image]).status_code == 200 and holder.result().status_code == 200
        assert not any("rid=l4 " in line for line in pair.encode.log), "the encoder worked for a refused room"
        assert_pools_free(pair)


@pytest.mark.unanswered_ok("the client goes away: its 1 s timeout is the point")
def test_a_generate_client_that_goes_away_ends_the_rooms_encode(image, calls, model) -> None:
    with Pair(model_path=model, language_args=ONE_ALLOCATION) as pair:
        holder = calls.submit(generate, pair, "c1", 1)
        wait_for(lambda: health(pair.language.url)["transferring"] == 1, 15, "room 1's init")
        encoding = calls.submit(timed, lambda: encode(pair, "c2", 2, [image]))
        wait_for(lambda: health(pair.encode.url)["staged_bytes"] > 0, 15, "room 2 staged")
        gone = calls.submit(generate, pair, "c2", 2, timeout=1.0)  # queued behind room 1; gives up after 1 s
        abandoned(gone)
        resp, seconds = encoding.result()
        assert resp.status_code == 502 and "aborted by language peer" in resp.json()["error"], resp.text
        assert seconds < 1.0 + AT_ONCE_S  # the /generate's client gives up after 1 s
        wait_for(lambda: health(pair.language.url)["queued"] == 0, 30, "the cancelled request to leave the queue")
        assert metric(pair.language.url, "epd_cancelled_total", phase="queued") == 1
        wait_for(lambda: health(pair.encode.url)["staged_bytes"] == 0, 30, "room 2's staging memory back")
        assert encode(pair, "c1", 1, [image]).status_code == 200 and holder.result().status_code == 200
        assert_pools_free(pair)


@pytest.mark.unanswered_ok("the client goes away: its 1 s timeout is the point")
def test_an_encode_client_that_goes_away_fails_the_room_for_its_language_peer(image, calls, model, silent_port) -> None:
    with Pair(model_path=model) as pair:
        waiting = calls.submit(timed, lambda: generate(pair, "e1", 1))
        wait_for(lambda: health(pair.language.url)["transferring"] == 1, 15, "room 1's init")
        # Its image comes from a server that never answers; the client gives up after 1 s.
        abandoned(calls.submit(encode, pair, "e1", 1, [f"http://127.0.0.1:{silent_port}/slow.png"], timeout=1.0))
        resp, seconds = waiting.result()
        assert resp.status_code == 502, resp.text
        assert "the encode request's client went away" in resp.json()["error"]
        assert seconds < 1.0 + AT_ONCE_S  # the /encode's client gives up after 1 s
        assert metric(pair.encode.url, "epd_cancelled_total") == 1
        # Cancelled before any language peer asked: the room is failed when one does.
        abandoned(calls.submit(encode, pair, "e2", 2, [f"http://127.0.0.1:{silent_port}/slow.png"], timeout=1.0))
        late, seconds = timed(lambda: generate(pair, "e2", 2))
        assert late.status_code == 502 and "client went away" in late.json()["error"], late.text
        assert seconds < AT_ONCE_S
        assert pair.request([image])["match"]
        assert_pools_free(pair)


def test_abort_request_before_the_encode_arrives_means_no_work_for_the_room(image, calls, model) -> None:
    with Pair(model_path=model) as pair:
        assert pair.request([image])["match"]  # the encoder's route is known from here on
        waiting = calls.submit(generate, pair, "a1", 1)
        wait_for(lambda: health(pair.language.url)["transferring"] == 1, 15, "room 1's init")
        reply = requests.post(f"{pair.language.url}/abort_request", json={"rid": "a1"}, timeout=10)
        assert reply.json() == {"rid": "a1", "aborted": True}
        resp = waiting.result()
        assert resp.status_code == 499 and resp.json()["kind"] == "cancelled", resp.text
        late, seconds = timed(lambda: encode(pair, "a1", 1, [image]))
        assert late.status_code == 502 and "aborted by language peer" in late.json()["error"], late.text
        assert seconds < AT_ONCE_S
        assert not any("rid=a1 " in line for line in pair.encode.log), "the encoder worked for an aborted room"
        unknown = requests.post(f"{pair.language.url}/abort_request", json={"rid": "nobody"}, timeout=10)
        assert unknown.status_code == 200 and unknown.json()["aborted"] is False
        assert_pools_free(pair)


def test_a_peer_that_never_answers_its_route_lookup_holds_up_nobody_else(small_image, calls, model,
                                                                          silent_port) -> None:
    with Pair(model_path=model) as pair:
        # Room 2's image is encoded first (staged: nobody asked for it yet), so what runs beside the
        # hung lookup is only its /generate: a lookup of the encoder's route, an init and a copy.
        encoded = calls.submit(encode, pair, "h2", 2, [small_image])
        wait_for(lambda: metric(pair.encode.url, "epd_encoder_items_total", source="encoded") == 1, 60,
                 "room 2's image encoded")
        stuck = calls.submit(generate, pair, "h1", 1, port=silent_port)
        wait_for(lambda: health(pair.language.url)["resolving"] == 1, 30, "the lookup under way")
        unrelated, seconds = timed(lambda: generate(pair, "h2", 2))
        assert unrelated.status_code == 200 and encoded.result().status_code == 200, unrelated.text
        assert unrelated.json()["sha256"] == encoded.result().json()["sha256"]
        # The lookup ends only at its timeout, the heartbeat interval: still under way, it held up
        # nothing; and the request took well under that interval, not what was left of it.
        lookup_s = ConnectorConfig.heartbeat_interval
        assert health(pair.language.url)["resolving"] == 1
        assert seconds < lookup_s / 2, f"an unrelated request took {seconds:.1f}s behind a hung lookup"
        resp = stuck.result()  # the lookup gives up after the heartbeat interval
        assert resp.status_code == 502 and resp.json()["kind"] == "peer_unreachable", resp.text
        assert f"127.0.0.1:{silent_port}" in resp.json()["error"]
        assert_pools_free(pair)
