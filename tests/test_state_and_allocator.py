"""The room state machine and the block allocator."""

from __future__ import annotations

import threading

import pytest

from connector.allocator import BlockAllocator
from connector.failures import FailureKind
from connector.poll import KVPoll, RoomState

pytestmark = pytest.mark.fast


def test_status_only_moves_forward() -> None:
    s = RoomState()
    assert s.advance(KVPoll.WaitingForInput)
    assert s.advance(KVPoll.Transferring)
    assert not s.advance(KVPoll.WaitingForInput)  # same round: backwards is refused
    assert not s.advance(KVPoll.Bootstrapping)
    assert s.status == KVPoll.Transferring


def test_resume_rounds_are_told_apart_by_sent_tokens() -> None:
    s = RoomState(KVPoll.WaitingForInput)
    assert s.advance(KVPoll.Transferring, 0)
    assert s.advance(KVPoll.WaitingForInput, 8192)  # the resume: new round at sent_tokens 8192
    assert s.advance(KVPoll.Transferring, 8192)
    assert not s.advance(KVPoll.Transferring, 0)  # a stale status of round one
    assert s.progress.sent_tokens == 8192


def test_failed_always_wins_and_is_final() -> None:
    s = RoomState()
    assert s.advance(KVPoll.Success, 100)
    assert not s.advance(KVPoll.Transferring, 200)
    assert s.fail(FailureKind.PEER_DEAD, "peer died")
    assert s.status == KVPoll.Failed and s.reason == "peer died" and s.kind == FailureKind.PEER_DEAD
    assert not s.fail(FailureKind.TIMEOUT, "again") and s.reason == "peer died" and s.kind == FailureKind.PEER_DEAD
    assert not s.advance(KVPoll.Success, 300)


def test_allocation_is_all_or_nothing_and_contiguous() -> None:
    a = BlockAllocator(10)
    first = a.allocate(4)
    assert first == [0, 1, 2, 3]
    assert a.allocate(7) is None and a.free_blocks == 6
    second = a.allocate(6)
    assert second == [4, 5, 6, 7, 8, 9] and a.free_blocks == 0
    a.free(first)
    assert a.allocate(3) == [0, 1, 2]


def test_best_fit_prefers_the_smallest_run_that_holds_the_request() -> None:
    a = BlockAllocator(12)
    ids = a.allocate(12)
    a.free(ids[0:2])  # run of 2
    a.free(ids[4:9])  # run of 5
    assert a.allocate(2) == [0, 1]
    assert a.allocate(4) == [4, 5, 6, 7]
    a.free([0, 1, 4, 5, 6, 7])
    assert a.allocate(7) == [0, 1, 4, 5, 6, 7, 8]  # no run fits: lowest ids


def test_bad_free_raises_and_frees_nothing() -> None:
    a = BlockAllocator(4)
    ids = a.allocate(2)
    with pytest.raises(ValueError, match="double free or never allocated"):
        a.free([ids[0], 3])  # 3 was never handed out
    with pytest.raises(ValueError, match="double free"):
        a.free([ids[0], ids[0]])
    with pytest.raises(ValueError, match="outside"):
        a.free([4])
    assert a.free_blocks == 2
    a.free(ids)
    with pytest.raises(ValueError):
        a.free(ids)
    assert a.all_free()


def test_concurrent_allocate_and_free_never_hand_out_a_block_twice() -> None:
    a = BlockAllocator(64)
    seen_twice = []
    held: set[int] = set()
    lock = threading.Lock()

    def worker(seed: int) -> None:
        for i in range(300):
            ids = a.allocate(1 + (seed + i) % 5)
            if ids is None:
                continue
            with lock:
                if held & set(ids):
                    seen_twice.append(ids)
                held.update(ids)
            with lock:
                held.difference_update(ids)
            a.free(ids)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not seen_twice and a.all_free()


def test_allocator_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        BlockAllocator(4).allocate(0)
