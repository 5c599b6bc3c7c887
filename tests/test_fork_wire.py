"""Our workers against peers that speak exactly the reference fork's wire (tests/fork_peers.py).

Both directions, real ZMQ and Mooncake: our encode process -> a fork-shaped language side, and
a fork-shaped encode side -> our language-side manager. Every transfer is checked byte for
byte, every status frame count and every block of every pool.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import requests
from conftest import PEER_DEFAULTS, wait_peer_idle
from fork_peers import ForkEncoder, ForkLanguage
from transfer_large_image import make_image

from connector.failures import FailureKind
from connector.poll import KVPoll
from connector.receiver import ReceiverPhase, receive_embedding
from harness.peer_control import EncodePeer
from harness.workers import WorkerProcess

T = TypeVar("T")
TOKENS = 10_000  # 79 blocks of 128: a first round of 8192 tokens and at least one resume
EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"
# "At once" against our encoder's bootstrap timeout (connector_peer.py's default): half of it
AT_ONCE_S = PEER_DEFAULTS["bootstrap_timeout"] / 2


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.02)


def peer_pool_whole(peer: EncodePeer) -> bool:
    stats = peer.call("stats")
    return stats["free_blocks"] == stats["num_blocks"]


def _closing(factory: Callable[..., T]) -> Iterator[Callable[..., T]]:
    """A fixture body: start doubles with ``factory``, close every one at teardown."""
    made: list[T] = []

    def start(**kwargs: object) -> T:
        made.append(factory(**kwargs))
        return made[-1]

    yield start
    for double in made:
        double.close()  # type: ignore[attr-defined]


@pytest.fixture
def fork_language() -> Iterator[Callable[..., ForkLanguage]]:
    yield from _closing(ForkLanguage)


@pytest.fixture
def fork_encoder() -> Iterator[Callable[..., ForkEncoder]]:
    yield from _closing(ForkEncoder)


def assert_fork_encoder_untouched(fork: ForkEncoder) -> None:
    """Nothing but register, init and resume reached it, and both its threads still run."""
    assert fork.foreign_messages() == [], (f"the fork encoder got messages it cannot parse (frame count, frame 0): "
                                           f"{fork.foreign_messages()}; {fork.violations}")
    assert fork.violations == [] and fork.alive, fork.violations


# ---- our encoder -> fork language side ----------------------------------------------------------


@pytest.mark.parametrize("resume_cap_blocks, rounds", [(None, 1), (8, 2)])
def test_our_encoder_feeds_a_fork_language_side_byte_identical(make_peer, fork_language,
                                                               resume_cap_blocks: int | None, rounds: int) -> None:
    peer = make_peer()
    lang = fork_language(resume_cap_blocks=resume_cap_blocks)
    expected = peer.call("stage", room=1, tokens=TOKENS, seed=7)["digests"]
    room = lang.start(1, lang.lookup(peer.bootstrap_addr, 1))
    lang.wait(1, EVENTUALLY_S)
    assert lang.violations == [] and all(len(m) == 2 for m in lang.received), lang.received
    assert room.error == "" and not room.failed
    assert room.statuses == [KVPoll.Transferring] * rounds + [KVPoll.Success]
    assert room.resume_rounds == rounds
    assert room.result is not None and room.result.num_tokens == TOKENS
    assert room.result.digests() == expected
    stats = wait_peer_idle(peer)
    assert stats["free_blocks"] == stats["num_blocks"], f"encode peer pool not whole: {stats}"
    assert lang.allocator.all_free()


@pytest.mark.parametrize("init_first", [False, True], ids=["stage_then_init", "init_then_stage"])
def test_block_size_mismatch_fails_a_fork_language_side_with_a_two_frame_status(make_peer, fork_language,
                                                                                 init_first: bool) -> None:
    peer = make_peer(block_size=128)
    lang = fork_language(block_size=64)
    rank = lang.lookup(peer.bootstrap_addr, 1)
    if not init_first:
        peer.call("stage", room=1, tokens=1000, seed=1)
    room = lang.start(1, rank)
    lang.wait(1, AT_ONCE_S)  # refused, not ended by the bootstrap timeout
    assert lang.violations == [] and lang.received == [[b"1", b"0"]], lang.received
    assert room.failed and room.statuses == [KVPoll.Failed]
    if init_first:  # the room was refused before it existed: staging it now must not revive it
        try:
            peer.call("stage", room=1, tokens=1000, seed=1)
        except RuntimeError as exc:  # refusing the stage outright is as good
            assert "mismatch" in str(exc), exc
            status = None
        else:
            status = peer.call("status", room=1)
    else:
        status = peer.call("status", room=1)
    if status is not None:
        assert status["status"] == "Failed", f"the refused room is {status} on our encoder"
        assert "mismatch" in status["reason"], status
    wait_for(lambda: peer_pool_whole(peer), AT_ONCE_S, "our encoder's blocks to be free (not at the bootstrap timeout)")
    assert lang.allocator.all_free()


# ---- fork encoder -> our language side ----------------------------------------------------------


@pytest.mark.parametrize("reserved, rounds", [(0, 1), (8, 2)])
def test_fork_encoder_feeds_our_language_side_byte_identical(fork_encoder, make_language,
                                                             reserved: int, rounds: int) -> None:
    # 80 blocks: 64 for the first round, 15 of 16 for the rest; with 8 reserved only 8 are
    # left after the first round, so the rest comes in two resumes.
    fork, lang = fork_encoder(), make_language(num_blocks=80)
    held = lang.allocator.allocate(reserved) if reserved else []
    expected = fork.stage(1, TOKENS, seed=3).digests()
    emb, receiver = receive_embedding(lang.manager, fork.bootstrap_addr, 1, timeout=EVENTUALLY_S)
    try:
        assert emb.num_tokens == TOKENS and emb.digests() == expected
    finally:
        emb.release()
        lang.allocator.free(held)
    assert receiver.resume_rounds == rounds
    assert fork.statuses_sent == [(1, KVPoll.Transferring)] * rounds + [(1, KVPoll.Success)]
    assert_fork_encoder_untouched(fork)
    assert fork.allocator.all_free() and lang.allocator.all_free()


def test_abort_with_a_fork_encoder_sends_nothing_and_frees_blocks_at_its_status(fork_encoder, make_language) -> None:
    ack_timeout = 1.0
    fork, lang = fork_encoder(), make_language(num_blocks=80, abort_ack_timeout=ack_timeout)
    fork.stage(1, 3000, seed=5, hold=True)  # one round, written only once released
    receiver = lang.manager.create_receiver(fork.bootstrap_addr, 1)
    receiver.init(lang.allocator.allocate(64))
    wait_for(lambda: fork.inited(1), EVENTUALLY_S, "the fork encoder to get the init")
    receiver.abort(FailureKind.CANCELLED, "client went away")
    assert receiver.poll() == KVPoll.Failed
    time.sleep(ack_timeout + 1.0)
    assert_fork_encoder_untouched(fork)
    assert lang.allocator.free_blocks == 80 - 64, \
        "the aborted room's blocks were freed while the fork encoder still owed a write into them"
    fork.release(1)
    wait_for(lambda: fork.statuses_sent == [(1, KVPoll.Success)], EVENTUALLY_S, "the fork encoder to write the room")
    wait_for(lang.allocator.all_free, EVENTUALLY_S, "the fork's status to free the aborted room's blocks")
    assert lang.manager.active_rooms() == 0
    # The fork encoder still serves: the next room arrives byte-identical.
    expected = fork.stage(2, TOKENS, seed=6).digests()
    emb, _ = receive_embedding(lang.manager, fork.bootstrap_addr, 2, timeout=EVENTUALLY_S)
    try:
        assert emb.digests() == expected
    finally:
        emb.release()
    assert_fork_encoder_untouched(fork)
    assert fork.allocator.all_free() and lang.allocator.all_free()


def test_a_refused_fork_init_fails_the_rooms_encode_request_at_once(fork_language) -> None:
    """The init (block size 64 against our 128) comes before the encode request: the request
    fails with the reason instead of encoding for a room nobody can receive."""
    encode = WorkerProcess("encode", fake_encoder=True)
    try:
        lang = fork_language(block_size=64)
        room = lang.start(5, lang.lookup(f"127.0.0.1:{encode.bootstrap_port}", 5))
        lang.wait(5, EVENTUALLY_S)
        assert room.failed and lang.received == [[b"5", b"0"]], lang.received
        image = make_image(448, 448, seed=2)
        with tempfile.NamedTemporaryFile(suffix=".png") as f:
            image.save(f.name)
            reply = requests.post(f"{encode.url}/encode", json={"rid": "r5", "bootstrap_room": 5, "images": [f.name]},
                                  timeout=30)
        assert reply.status_code == 502 and "block size mismatch" in reply.json()["error"], reply.text
        assert any("WARNING" in line and "block size mismatch" in line for line in encode.log)
        health = requests.get(f"{encode.url}/health", timeout=5).json()
        assert health["free_blocks"] == health["num_blocks"] and health["staged_bytes"] == 0, health
    finally:
        assert encode.stop() == 0


def test_a_suspend_with_a_fork_encoder_sends_nothing_and_ends_at_the_rounds_status(fork_encoder, make_language) -> None:
    fork, lang = fork_encoder(), make_language(num_blocks=80)
    staged = fork.stage(1, TOKENS, seed=8, hold=True)  # its first round is written only once released
    receiver = lang.manager.create_receiver(fork.bootstrap_addr, 1)
    receiver.init(lang.allocator.allocate(64))
    wait_for(lambda: fork.inited(1), EVENTUALLY_S, "the fork encoder to get the init")
    assert lang.manager.fork_rounds_owed() == [1]  # the language worker refuses to sleep now
    threading.Timer(0.5, fork.release, args=(1,)).start()
    lang.manager.suspend_all([receiver], timeout=EVENTUALLY_S)  # no SUSPEND: the round's status ends it
    assert receiver.phase == ReceiverPhase.SUSPENDED and lang.manager.fork_rounds_owed() == []
    saved = receiver.checkpoint()
    assert saved.landed == 8192 and saved.total_tokens == TOKENS and lang.allocator.all_free()
    assert saved.data is not None and saved.data.embeddings[:8192].tobytes() == staged.embeddings[:8192].tobytes()
    assert_fork_encoder_untouched(fork)
