"""Two real processes over Mooncake TCP on 127.0.0.1 and real ZMQ: bytes verified by sha256.

Fixtures check after every test that both pools have every block free.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from connector.messages import RegisterMsg
from connector.receiver import receive_embedding

pytestmark = pytest.mark.transports("mooncake", "memory")


def transfer(lang, peer, room: int, tokens: int, seed: int | None = None):
    """Stage on the encode peer, receive on the language side, compare every digest."""
    expected = peer.call("stage", room=room, tokens=tokens, seed=room if seed is None else seed)["digests"]
    emb, receiver = receive_embedding(lang.manager, peer.bootstrap_addr, room, timeout=120)
    try:
        assert emb.num_tokens == tokens
        assert emb.digests() == expected
        assert int(emb.aux[0]) == tokens
    finally:
        emb.release()
    return receiver


@pytest.mark.parametrize("tokens, rounds", [
    (100, 0),  # one partial block
    (128, 0),  # exactly one block
    (8192, 0),  # exactly the default allocation
    (8193, 1),  # one token over: one resume round
    (3 * 8192, 1),  # the remainder fits the pool: one resume for all of it
])
def test_sizes_around_the_default_allocation(make_peer, make_language, tokens: int, rounds: int) -> None:
    peer, lang = make_peer(), make_language()
    receiver = transfer(lang, peer, 1, tokens)
    assert receiver.resume_rounds == rounds


def test_three_times_default_in_at_least_two_resume_rounds(make_peer, make_language) -> None:
    # 64 default blocks, then 64 more (what is free), then the rest: >= 2 resumes.
    peer, lang = make_peer(), make_language(num_blocks=128)
    receiver = transfer(lang, peer, 7, 3 * 8192)
    assert receiver.resume_rounds >= 2
    assert lang.manager.stats["spilled_tokens"] > 0  # the pool could not hold everything at once


def test_pool_too_small_for_the_remainder_takes_three_or_more_rounds(make_peer, make_language) -> None:
    peer, lang = make_peer(), make_language(num_blocks=24, default_allocate_tokens=2048)
    receiver = transfer(lang, peer, 3, 10_000)  # 79 blocks through a 24-block pool
    assert receiver.resume_rounds + 1 >= 4  # rounds = first + resumes


def test_several_rounds_without_spilling_keep_blocks_in_place(make_peer, make_language) -> None:
    peer, lang = make_peer(), make_language(num_blocks=200, default_allocate_tokens=1024)
    receiver = transfer(lang, peer, 4, 20_000)  # 8 blocks, then the rest in one go
    assert receiver.resume_rounds == 1 and lang.manager.stats["spilled_tokens"] == 0


def test_32_concurrent_rooms_of_random_sizes(make_peer, make_language) -> None:
    rng = random.Random(32)
    sizes = [rng.randint(1, 20_000) for _ in range(32)]
    peer = make_peer(num_blocks=sum(-(-s // 128) for s in sizes) + 8, hidden_size=512)
    lang = make_language(num_blocks=400, hidden_size=512)
    with ThreadPoolExecutor(32) as pool:
        receivers = list(pool.map(lambda a: transfer(lang, peer, 100 + a[0], a[1]), enumerate(sizes)))
    assert sum(r.resume_rounds for r in receivers) >= sum(s > 8192 for s in sizes)


def test_rooms_and_blocks_are_reused_across_many_transfers(make_peer, make_language) -> None:
    peer, lang = make_peer(num_blocks=100), make_language(num_blocks=80)
    for room in range(12):
        transfer(lang, peer, 1000 + room, 1 + room * 777)


def test_a_fork_style_register_without_optional_frames_works(make_peer, make_language, monkeypatch) -> None:
    peer, lang = make_peer(), make_language()
    full = lang.manager._register_msg()
    fork = RegisterMsg(full.endpoint, full.dst_port, full.session_id, full.base_ptrs)
    assert len(fork.encode()) == 5
    monkeypatch.setattr(lang.manager, "_register_msg", lambda: fork)
    transfer(lang, peer, 5, 9000)


def test_an_embedding_copied_at_assembly_is_copied_outside_the_managers_lock(make_peer, make_language,
                                                                             monkeypatch) -> None:
    """A room whose blocks are not one run is copied into a new array at assembly
    (75 MB for a 4K image); the manager's lock, which every status of every room needs, is free
    meanwhile. Bytes still equal what was staged."""
    peer, lang = make_peer(), make_language()
    m = lang.manager
    monkeypatch.setattr(m.pool, "view", lambda *args: None)  # as if the rounds' blocks were scattered
    real_read_into = m.pool.read_into
    lock_free_during_copy: list[bool] = []

    def read_into(*args) -> None:  # noqa: ANN002
        with ThreadPoolExecutor(1) as other:  # another thread: the lock is reentrant for this one
            lock_free_during_copy.append(other.submit(_try_lock, m._lock).result())
        real_read_into(*args)

    monkeypatch.setattr(m.pool, "read_into", read_into)
    receiver = transfer(lang, peer, 1, 20_000)  # two rounds: two runs of blocks
    assert receiver.resume_rounds >= 1 and lock_free_during_copy and all(lock_free_during_copy)
    assert lang.allocator.all_free()


def test_a_spill_copies_outside_the_managers_lock(make_peer, make_language, monkeypatch) -> None:
    """With no block free, a room's landed rounds are copied to host memory to make
    room (a spill); the manager's lock is free meanwhile. Bytes still equal what was staged."""
    peer, lang = make_peer(), make_language(num_blocks=128)
    m = lang.manager
    real_read_into = m.pool.read_into
    lock_free_during_copy: list[bool] = []

    def read_into(*args) -> None:  # noqa: ANN002
        with ThreadPoolExecutor(1) as other:
            lock_free_during_copy.append(other.submit(_try_lock, m._lock).result())
        real_read_into(*args)

    monkeypatch.setattr(m.pool, "read_into", read_into)
    transfer(lang, peer, 7, 3 * 8192)  # the pool cannot hold it all at once
    assert m.stats["spilled_tokens"] > 0 and lock_free_during_copy and all(lock_free_during_copy)
    assert lang.allocator.all_free()


def _try_lock(lock) -> bool:  # noqa: ANN001
    # Held across the copy, it never comes free while the copy waits for this: a long wait only
    # delays that failure, and a thread holding it for a moment, descheduled, lets it go in time.
    if not lock.acquire(timeout=30.0):
        return False
    lock.release()
    return True
