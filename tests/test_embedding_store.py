"""The cluster's embedding cache in process: its entries' check, its bounds when the store does
not answer or is full, the encode worker's reuse of items (in the store, or being encoded by
another request), and the language side's routing by image hash. A dictionary stands in for
Mooncake Store here; tests/test_global_cache.py runs the real one between worker processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import ManualClock
from fake_encoder import FakeEncoder
from test_faults import wait_for
from transfer_large_image import make_image

from connector.config import ConnectorConfig
from connector.messages import InitMsg
from connector.poll import KVPoll
from embedding_side.encoders import EncodedImages
from embedding_side.images import MediaPolicy
from embedding_side.shared_encodings import SharedEncodings, join_items, split_items
from embedding_side.worker import EncodeWorker
from harness.workers import free_port
from language_side.dispatch import AFFINITY_SLACK_IMAGES, Encoder, EncoderDispatch
from language_side.embedding_cache import EmbeddingCache
from worker_infra import embedding_store
from worker_infra.embedding_store import (
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    EmbeddingStore,
    EntryRejected,
    StoredMedia,
    StoreSettings,
    StoreState,
    media_key,
    pack,
    unpack,
)

pytestmark = pytest.mark.fast

SECRET = b"a-secret-of-the-cluster-0123456789"
KEY = media_key("image", "ab" * 32, "f" * 32)
EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"


def item(tokens: int = 4, width: int = 8, seed: int = 0, grid: tuple[int, ...] = (1, 4, 4)) -> StoredMedia:
    rows = np.random.default_rng(seed).integers(0, 255, (tokens, width), dtype=np.uint8)
    return StoredMedia(rows, grid, {"second_per_grid_ts": 0.5})


class DictStore:
    """Mooncake Store's calls this module makes, on a dictionary (``answer``: what every call
    waits for, to stand for a master that does not answer)."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}
        self.answer = threading.Event()
        self.answer.set()
        self.put_code = 0

    def get_size(self, key: str) -> int:
        self.answer.wait()
        return len(self.entries[key]) if key in self.entries else OBJECT_NOT_FOUND

    def get_into(self, key: str, ptr: int, size: int) -> int:
        ctypes.memmove(ptr, self.entries[key], size)
        return size

    def upsert_from(self, key: str, ptr: int, size: int) -> int:
        self.answer.wait()
        if self.put_code == 0:
            self.entries[key] = ctypes.string_at(ptr, size)
        return self.put_code

    def remove(self, key: str, force: bool = False) -> int:
        self.entries.pop(key, None)
        return 0

    def close(self) -> int:
        return 0


def store_on(client: DictStore, timeout_s: float = 0.3) -> EmbeddingStore:
    store = EmbeddingStore(StoreSettings("127.0.0.1:1", "P2PHANDSHAKE", "127.0.0.1", 0, timeout_s, SECRET),
                           client_factory=lambda settings, transport: client)
    assert store.connect()
    return store


def count(counter, label: str) -> float:
    return counter.labels(label)._value.get()


def test_an_entry_round_trips_and_any_changed_byte_or_other_key_or_secret_is_refused() -> None:
    original = item()
    blob = pack(KEY, original, SECRET)
    back = unpack(KEY, blob, SECRET)
    assert np.array_equal(back.rows, original.rows) and back.grid == original.grid and back.extras == original.extras
    assert back.rows.flags.writeable
    for where in (0, 12, len(blob) // 2, len(blob) - 40, len(blob) - 1):  # magic, header, rows, rows, tag
        changed = blob.copy()
        changed[where] ^= 1
        with pytest.raises(EntryRejected):
            unpack(KEY, changed, SECRET)
    with pytest.raises(EntryRejected, match="tag"):
        unpack(KEY, blob, b"another-secret-of-the-same-length-")
    with pytest.raises(EntryRejected, match="another key"):
        unpack(media_key("image", "cd" * 32, "f" * 32), blob, SECRET)
    with pytest.raises(EntryRejected):
        unpack(KEY, blob[:20], SECRET)


def test_a_lookup_of_a_store_that_does_not_answer_ends_at_its_bound_then_the_store_is_skipped(monkeypatch, caplog) -> None:
    clock = ManualClock()  # the store's skip window moves only when the test says
    monkeypatch.setattr(embedding_store, "time", SimpleNamespace(monotonic=clock))
    client = DictStore()
    timeout_s = 0.3
    store = store_on(client, timeout_s)
    client.entries[KEY] = pack(KEY, item(), SECRET).tobytes()
    client.answer.clear()  # the master stops answering
    started = time.monotonic()
    assert asyncio.run(store.get(KEY)) is None
    # ended by its own bound (the log names it), not before; the upper bound only tells "ended" from "never"
    assert timeout_s <= time.monotonic() - started < timeout_s + EVENTUALLY_S
    assert f"a lookup took over {timeout_s:g}s" in caplog.text
    assert store.state == StoreState.UNAVAILABLE and count(store.lookups, "error") == 1
    assert asyncio.run(store.get(KEY)) is None and count(store.lookups, "skipped") == 1  # no second wait
    client.answer.set()
    clock.advance(embedding_store.RETRY_AFTER_S)
    found = asyncio.run(store.get(KEY))
    assert found is not None and np.array_equal(found.rows, item().rows) and store.state == StoreState.AVAILABLE


def test_a_full_store_drops_the_write_and_stays_available() -> None:
    client = DictStore()
    client.put_code = NO_AVAILABLE_HANDLE
    store = store_on(client)
    done = threading.Event()
    store.put_soon(KEY, item(), on_done=done.set)
    assert done.wait(EVENTUALLY_S)
    assert count(store.puts, "full") == 1 and store.state == StoreState.AVAILABLE and not client.entries


def test_a_bad_entry_is_a_miss_and_is_removed() -> None:
    client = DictStore()
    store = store_on(client)
    forged = pack(KEY, item(seed=1), b"not-the-cluster-secret-at-all-000")
    client.entries[KEY] = forged.tobytes()
    assert asyncio.run(store.get(KEY)) is None
    assert count(store.lookups, "rejected") == 1
    deadline = time.monotonic() + EVENTUALLY_S
    while KEY in client.entries and time.monotonic() < deadline:
        time.sleep(0.01)
    assert KEY not in client.entries


def test_items_split_and_join_back_in_order_with_their_metadata() -> None:
    rows = np.arange(10 * 6, dtype=np.uint8).reshape(10, 6)
    encoded = EncodedImages(rows, [(1, 4, 4), (2, 4, 6)], 3, {"video_timestamps": [[0.0], [0.0, 1.0]]})
    items = split_items(encoded, merge_size=2)
    assert [len(i.rows) for i in items] == [4, 6] and items[1].extras == {"video_timestamps": [0.0, 1.0]}
    joined = join_items(items, 3)
    assert np.array_equal(joined.embeddings, rows) and joined.grid_thw == [(1, 4, 4), (2, 4, 6)]
    assert joined.extras == encoded.extras


def test_an_item_two_requests_send_at_once_is_encoded_once_and_a_failed_leader_hands_it_back() -> None:
    client = DictStore()
    store = store_on(client)
    shared = SharedEncodings(store, lambda: "f" * 32)

    async def wait(future: concurrent.futures.Future):
        return await asyncio.wrap_future(future)

    async def scenario():
        keys = shared.keys("image", ["ab" * 32])
        found, claims = await shared.reuse(keys, wait)
        assert found == {} and list(claims) == keys  # nothing anywhere: this request encodes it
        follower = asyncio.ensure_future(shared.reuse(keys, wait))
        await asyncio.sleep(0.05)
        assert not follower.done()  # it waits for the leader, not for an encoder
        shared.settle(claims, keys, [item()])
        got, theirs = await follower
        assert np.array_equal(got[0].rows, item().rows) and theirs == {}
        # a leader that fails: its follower gets nothing and claims the item itself
        other = shared.keys("image", ["cd" * 32])
        _, claims = await shared.reuse(other, wait)
        follower = asyncio.ensure_future(shared.reuse(other, wait))
        await asyncio.sleep(0.05)
        shared.abandon(claims)
        found, theirs = await follower
        assert found == {} and list(theirs) == other
        shared.abandon(theirs)

    asyncio.run(scenario())
    deadline = time.monotonic() + EVENTUALLY_S
    while not client.entries and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(client.entries) == [media_key("image", "ab" * 32, "f" * 32)]


def dispatch_over(n: int) -> EncoderDispatch:
    dispatch = EncoderDispatch([f"http://10.0.0.{i}:8000" for i in range(n)], None, EmbeddingCache(0))
    return dispatch


def pick(dispatch: EncoderDispatch, affinity: str, tried: frozenset = frozenset(),
         siblings: frozenset = frozenset()) -> Encoder:
    return asyncio.run(dispatch._pick(set(tried), "image", affinity, set(siblings)))


def test_an_image_goes_to_the_encoder_it_hashes_to_unless_that_one_is_the_slack_busier() -> None:
    dispatch = dispatch_over(4)
    digests = [f"{i:064x}" for i in range(64)]
    chosen = {d: pick(dispatch, d).url for d in digests}
    assert len(set(chosen.values())) == 4  # spread over every encoder
    assert all(pick(dispatch, d).url == url for d, url in chosen.items())  # and always the same one
    hashed = next(e for e in dispatch.encoders if e.url == chosen[digests[0]])
    slack = AFFINITY_SLACK_IMAGES * dispatch.tokens_per_image
    hashed.outstanding = slack - 1  # less busier than the slack: it keeps the image
    assert pick(dispatch, digests[0]) is hashed
    hashed.outstanding = slack  # the slack busier than the others: the least loaded takes it
    assert pick(dispatch, digests[0]) is not hashed
    hashed.outstanding = 0
    # another part of the same request went there: this one goes elsewhere (the parts side by side)
    assert pick(dispatch, digests[0], siblings=frozenset({hashed.url})) is not hashed
    assert pick(dispatch, digests[0], siblings=frozenset(e.url for e in dispatch.encoders)) is hashed
    # that encoder out of rotation (or tried): the image goes where it hashes among the others, the
    # same one every time, and images hashed elsewhere stay where they were
    again = pick(dispatch, digests[0], frozenset({hashed.url}))
    assert again is not hashed and pick(dispatch, digests[0], frozenset({hashed.url})) is again
    assert all(pick(dispatch, d, frozenset({hashed.url})).url == url for d, url in chosen.items() if url != hashed.url)


class CountingEncoder(FakeEncoder):
    """The numpy double, counting the images of each forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.passes: list[int] = []

    def encode(self, images):  # noqa: ANN001, ANN201
        self.passes.append(len(images))
        return super().encode(images)


def store_backed_worker(raw, raw_pool, folder):  # noqa: ANN001, ANN201
    """An encode worker (the counting double) on a dictionary store, the raw language side ``raw``
    registered with it, and ``encoded(room, images, **encode_args)``: one request through it,
    delivered to ``raw``; the reply. Returns ``(worker, client, encoded)``."""
    transport, pool = raw_pool
    raw.session = transport.session_id
    client = DictStore()
    worker = EncodeWorker(ConnectorConfig(num_blocks=100), CountingEncoder(), free_port(),
                          MediaPolicy.create([str(folder)]), store=store_on(client))
    raw.connect(worker.sender.rank_port)
    raw.register(pool)

    def encoded(room: int, images: list[str], **encode_args) -> dict:
        raw.send(InitMsg(room, "127.0.0.1", raw.port, raw.session, tuple(range(64)), 1, 8192))
        wait_for(lambda: worker.sender.asked_for(room), EVENTUALLY_S, "the init")
        reply = asyncio.run(worker.encode(f"rid{room}", room, images, wait_for_delivery=False, **encode_args))
        assert raw.expect(room=room).status == KVPoll.Success
        return reply

    return worker, client, encoded


def test_an_encode_worker_encodes_only_what_the_store_lacks_and_sends_what_a_fresh_encode_would(
        raw_language, raw_pool, tmp_path) -> None:
    worker, client, encoded = store_backed_worker(raw_language, raw_pool, tmp_path)
    first, second = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    make_image(448, 448, seed=3).save(first)
    make_image(644, 476, seed=4).save(second)

    try:
        assert encoded(1, [first])["reused"] == 0
        wait_for(lambda: len(client.entries) == 1, EVENTUALLY_S, "the entry written")
        both = encoded(2, [first, second])  # the first from the store, the second encoded
        assert both["reused"] == 1 and worker.encoder.passes == [1, 1]
        worker.shared = None  # the same request encoded whole, with no store
        whole = encoded(3, [first, second])
        assert worker.encoder.passes == [1, 1, 2]
        assert {k: both[k] for k in ("sha256", "num_tokens", "grid_thw")} == \
            {k: whole[k] for k in ("sha256", "num_tokens", "grid_thw")}
    finally:
        worker.close()
