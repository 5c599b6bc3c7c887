"""Flow control pieces in-process: the staging budget, blocks lent to rooms nobody asked for and
taken back, pings that fence writes, an encode worker whose encoder fails, the decode budget. The real processes under load are in test_load.py."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from fake_encoder import FakeEncoder
from test_early_resume import GatedTransport
from test_faults import wait_for
from transfer_large_image import make_image

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from connector.failures import FailureKind, TransferFailure
from connector.messages import AbortMsg, InitMsg, StatusMsg
from connector.poll import KVPoll
from connector.sender import EmbeddingSenderManager
from connector.staging import ByteBudget
from embedding_side.encoders import decode_bytes
from embedding_side.images import MediaPolicy, open_image
from embedding_side.worker import EncodeWorker
from harness.connector_peer import synthetic_embedding
from harness.workers import free_port
from worker_infra.sleep import WorkerState

pytestmark = pytest.mark.fast

EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"
GATE_S = 30.0  # how long the gated encoder holds a forward pass before it gives up on the test
AT_ONCE_S = 20.0  # an answer within this came before the held pass ended (below GATE_S)


def granted(future: Future) -> bool:
    return future.done() and future.exception() is None


def test_staging_grants_in_arrival_order_within_the_budget() -> None:
    budget = ByteBudget(100)
    a, b, c = (budget.request(room, 40, urgent=False) for room in (1, 2, 3))
    assert granted(a) and granted(b) and not c.done() and budget.used == 80
    d = budget.request(4, 10, urgent=False)
    assert not d.done(), "a small request must not overtake the one waiting ahead of it"
    budget.release(1)
    assert granted(c) and granted(d) and budget.used == 90


def test_a_room_already_asked_for_is_granted_at_once_budget_or_not() -> None:
    budget = ByteBudget(100)
    budget.request(1, 100, urgent=False)
    waiting = budget.request(2, 50, urgent=False)
    assert budget.request(3, 70, urgent=True).done() and budget.used == 170
    assert not waiting.done()
    budget.promote(2)  # its init arrived while it waited
    assert granted(waiting) and budget.used == 220 and budget.waiting == 0


def test_a_request_larger_than_the_budget_waits_for_an_empty_one_then_goes_alone() -> None:
    budget = ByteBudget(100)
    budget.request(1, 10, urgent=False)
    big = budget.request(2, 500, urgent=False)
    assert not big.done()
    budget.release(1)
    assert granted(big) and budget.used == 500


def test_a_waiter_that_ends_gets_the_error_and_frees_its_place() -> None:
    budget = ByteBudget(100)
    budget.request(1, 90, urgent=False)
    first, second = budget.request(2, 50, urgent=False), budget.request(3, 10, urgent=False)
    budget.release(2, RuntimeError("aborted by language peer"))
    with pytest.raises(RuntimeError, match="aborted by language peer"):
        first.result(0)
    assert granted(second) and budget.used == 100
    first_cancelled = budget.request(4, 50, urgent=False)
    first_cancelled.cancel()  # its caller gave up (queue timeout)
    budget.release(1)
    budget.release(3)
    assert budget.used == 0 and budget.waiting == 0


def test_data_that_arrives_is_charged_what_it_really_takes() -> None:
    budget = ByteBudget(100)
    budget.request(1, 30, urgent=False)
    budget.settle(1, 32)
    budget.settle(2, 20)  # handed over without asking first
    budget.charge(3, 5)  # taken out of pool blocks
    assert budget.used == 57
    for room in (1, 2, 3):
        budget.release(room)
    assert budget.used == 0


@pytest.fixture
def encoder(raw_language):
    """An in-process sender with a 100-block pool, a byte mover that copies in memory, and a raw
    language peer with a 300-block pool."""
    config = ConnectorConfig(num_blocks=100, hidden_size=64)
    src, dst = BufferPool(100, 128, 64), BufferPool(300, 128, 64)
    transport = GatedTransport()
    transport.release.set()
    allocator = BlockAllocator(100)
    sender = EmbeddingSenderManager(config, transport, src, allocator)
    raw_language.connect(sender.rank_port)
    raw_language.register(dst)
    yield sender, allocator, dst, raw_language
    sender.close()


def landed(dst: BufferPool, first_block: int, tokens: int) -> Embedding:
    out = Embedding.empty(tokens, 64, "bfloat16")
    dst.read_into(list(range(first_block, first_block + dst.blocks_for(tokens))), out, 0, tokens)
    out.aux[:] = dst.aux[first_block]
    return out


def test_blocks_lent_to_rooms_nobody_asked_for_come_back_for_a_room_that_was(encoder) -> None:
    sender, allocator, dst, raw = encoder
    tokens = 40 * 128  # 40 blocks each: two fit the 100-block pool, not three
    embs = {room: synthetic_embedding(tokens, 64, "bfloat16", seed=room) for room in (1, 2, 3)}
    senders = {room: sender.create_sender(room) for room in embs}
    for room, emb in embs.items():
        senders[room].send(emb)
    assert senders[1].wait_in_pool(EVENTUALLY_S) and senders[2].wait_in_pool(EVENTUALLY_S)  # borrowed while free
    assert not senders[3].wait_in_pool(0.3)  # no room left: it waits in host memory
    raw.send(InitMsg(3, "127.0.0.1", raw.port, raw.session, tuple(range(40)), 1, tokens))
    raw.answer_ping()
    assert raw.expect() == StatusMsg(3, KVPoll.Success, tokens)
    assert sender.stats["evicted"] == 1  # room 2, the newest borrower, gave its blocks back
    assert landed(dst, 0, tokens).digests() == embs[3].digests()
    for room, first in ((1, 40), (2, 80)):
        raw.send(InitMsg(room, "127.0.0.1", raw.port, raw.session, tuple(range(first, first + 40)), 1, tokens))
        assert raw.expect() == StatusMsg(room, KVPoll.Success, tokens)
        assert landed(dst, first, tokens).digests() == embs[room].digests()
    wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")
    assert sender.staging.used == 0


def test_an_embedding_larger_than_the_pool_is_refused_at_hand_over(encoder) -> None:
    sender, allocator, _, _ = encoder
    with pytest.raises(ValueError, match="more blocks than the pool's 100"):
        sender.create_sender(9).send(synthetic_embedding(101 * 128, 64, "bfloat16", seed=9))
    assert allocator.all_free()


def test_an_asked_for_room_waits_only_for_asked_for_rooms_to_finish(encoder) -> None:
    """The pool is full of a room being written; the next asked-for room is placed when it ends."""
    sender, allocator, dst, raw = encoder
    tokens = 80 * 128
    first, second = (synthetic_embedding(tokens, 64, "bfloat16", seed=s) for s in (5, 6))
    sender.create_sender(5).send(first)
    sender.create_sender(6).send(second)
    raw.send(InitMsg(5, "127.0.0.1", raw.port, raw.session, tuple(range(80)), 1, tokens))
    raw.send(InitMsg(6, "127.0.0.1", raw.port, raw.session, tuple(range(80, 160)), 1, tokens))
    raw.answer_ping()
    statuses = {raw.expect().room for _ in range(2)}
    assert statuses == {5, 6}
    assert landed(dst, 0, tokens).digests() == first.digests()
    assert landed(dst, 80, tokens).digests() == second.digests()
    wait_for(allocator.all_free, EVENTUALLY_S, "the source blocks")


class BrokenEncoder(FakeEncoder):
    """Fails its forward pass (as an out-of-memory error would) or its offload, when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_encode = self.fail_offload = False

    def encode(self, images):
        if self.fail_encode:
            raise MemoryError("out of memory in the vision tower")
        return super().encode(images)

    def offload(self, level: int) -> None:
        if self.fail_offload:
            raise RuntimeError("offload failed")


@pytest.fixture
def encode_worker(raw_language, raw_pool, tmp_path):
    """An in-process encode worker around a :class:`BrokenEncoder`, a raw language peer
    registered with a real Mooncake pool, and a small image."""
    transport, pool = raw_pool
    raw_language.session = transport.session_id
    worker = EncodeWorker(ConnectorConfig(num_blocks=100), BrokenEncoder(), free_port(),
                          MediaPolicy.create([str(tmp_path)]))
    raw_language.connect(worker.sender.rank_port)
    raw_language.register(pool)
    image = str(tmp_path / "img.png")
    make_image(448, 448, seed=3).save(image)
    yield worker, raw_language, image
    worker.close()


def asked_and_encoded(worker: EncodeWorker, raw, room: int, image: str) -> dict:
    """Init ``room`` from the raw peer, then encode it; returns the reply (or raises)."""
    raw.send(InitMsg(room, "127.0.0.1", raw.port, raw.session, tuple(range(64)), 1, 8192))
    wait_for(lambda: worker.sender.asked_for(room), EVENTUALLY_S, "the init")
    return asyncio.run(worker.encode(f"rid{room}", room, [image], wait_for_delivery=False))


def test_an_encoder_error_fails_the_room_on_both_sides_and_frees_its_memory(encode_worker) -> None:
    worker, raw, image = encode_worker
    worker.encoder.fail_encode = True
    with pytest.raises(TransferFailure, match="encode failed: MemoryError: out of memory") as err:
        asked_and_encoded(worker, raw, 7, image)
    assert err.value.kind == FailureKind.INTERNAL
    failed = raw.expect(room=7)
    assert failed.status == KVPoll.Failed and failed.reason.startswith("internal: encode failed: MemoryError")
    assert worker.sender.staging.used == 0 and worker.allocator.all_free()
    worker.encoder.fail_encode = False
    assert asked_and_encoded(worker, raw, 8, image)["num_tokens"] == 256  # the worker goes on
    assert raw.expect(room=8) == StatusMsg(8, KVPoll.Success, 256)


def test_a_sleep_that_fails_leaves_the_worker_awake_with_its_pool(encode_worker) -> None:
    worker, raw, image = encode_worker
    worker.encoder.fail_offload = True
    with pytest.raises(RuntimeError, match="offload failed"):
        worker.sleep(1, preserve_state=True)
    assert worker.gate.state == WorkerState.AWAKE and worker.pool is not None
    assert asked_and_encoded(worker, raw, 9, image)["num_tokens"] == 256  # places and writes again
    assert raw.expect(room=9) == StatusMsg(9, KVPoll.Success, 256)
    wait_for(worker.allocator.all_free, EVENTUALLY_S, "the source blocks")


class GatedEncoder(FakeEncoder):
    """Holds each forward pass until ``go`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def encode(self, images):
        assert self.go.wait(GATE_S), "the test never let the encoder go"
        return super().encode(images)


def decoding_one_at_a_time(raw, raw_pool, tmp_path) -> tuple[EncodeWorker, str, int]:  # noqa: ANN001
    """An encode worker on the gated fake whose decode memory takes one 896x896 image at a time,
    rooms 1 and 2 inited by ``raw``; the worker, the image and the decode bytes it takes."""
    transport, pool = raw_pool
    raw.session = transport.session_id
    image = str(tmp_path / "img.png")
    make_image(896, 896, seed=4).save(image)
    one = decode_bytes(open_image(image, MediaPolicy.create([str(tmp_path)])), FakeEncoder(8).resize)
    media = MediaPolicy.create([str(tmp_path)], decode_bytes=one * 3 // 2)  # room for one request at a time
    worker = EncodeWorker(ConnectorConfig(num_blocks=100), GatedEncoder(), free_port(), media)
    raw.connect(worker.sender.rank_port)
    raw.register(pool)
    for room in (1, 2):
        raw.send(InitMsg(room, "127.0.0.1", raw.port, raw.session, tuple(range(8 * room - 8, 8 * room)), 1, 1024))
        wait_for(lambda r=room: worker.sender.asked_for(r), EVENTUALLY_S, "the init")
    return worker, image, one


def test_decoding_waits_for_its_memory_in_arrival_order_and_never_exceeds_the_budget(raw_language, raw_pool,
                                                                                     tmp_path) -> None:
    raw = raw_language
    worker, image, one = decoding_one_at_a_time(raw, raw_pool, tmp_path)
    try:

        async def both() -> list:
            return await asyncio.gather(*(worker.encode(f"rid{room}", room, [image], wait_for_delivery=False)
                                          for room in (1, 2)), return_exceptions=True)

        with ThreadPoolExecutor(1) as runner:
            replies = runner.submit(asyncio.run, both())
            wait_for(lambda: worker._queues()["decode_waiting"] == 1, 10, "the second request to wait")
            assert worker._queues()["decode_bytes"] == one  # the first holds its share; nothing else is decoded
            worker.encoder.go.set()
            results = replies.result(timeout=30)
        assert [r["num_tokens"] for r in results] == [1024, 1024], results
        assert worker._queues()["decode_bytes"] == 0 and worker._queues()["decode_waiting"] == 0
        with pytest.raises(TransferFailure, match="over the decode budget") as err:  # 413 before any decoding
            asyncio.run(worker.encode("rid3", 3, [image, image], wait_for_delivery=False))
        assert err.value.kind == FailureKind.TOO_LARGE
        statuses = [raw.expect(), raw.expect()]
        assert sorted((m.room, m.status) for m in statuses) == [(1, KVPoll.Success), (2, KVPoll.Success)]
    finally:
        worker.close()


def test_a_room_failed_while_it_waits_for_decode_memory_answers_at_once(raw_language, raw_pool, tmp_path) -> None:
    """The second of two requests waits for decode memory the first holds (its pass held by the
    gate); its language peer aborts it: its client gets the abort at once, not once the first's
    pass ends or the queue timeout passes, and its place in the queue goes."""
    raw = raw_language
    worker, image, _ = decoding_one_at_a_time(raw, raw_pool, tmp_path)
    try:
        with ThreadPoolExecutor(2) as runner:
            first = runner.submit(asyncio.run, worker.encode("rid1", 1, [image], wait_for_delivery=False))
            wait_for(lambda: worker._computing == 1, 10, "the first forward pass")
            second = runner.submit(asyncio.run, worker.encode("rid2", 2, [image], wait_for_delivery=False))
            wait_for(lambda: worker._queues()["decode_waiting"] == 1, 10, "the second request to wait")
            raw.send(AbortMsg(2, "127.0.0.1", raw.port, raw.generation))
            with pytest.raises(TransferFailure) as err:
                second.result(timeout=AT_ONCE_S)  # the first's pass is still held
            assert err.value.kind == FailureKind.ABORTED, err.value
            assert worker._queues()["decode_waiting"] == 0
            worker.encoder.go.set()
            assert first.result(timeout=30)["num_tokens"] == 1024
        wait_for(lambda: worker._queues()["decode_bytes"] == 0, 10, "the decode memory")
    finally:
        worker.encoder.go.set()
        worker.close()


@pytest.mark.parametrize("failed_by", ["stop", "language abort"])
def test_a_room_failed_during_its_forward_pass_answers_the_encode_request_at_once(raw_language, raw_pool, tmp_path,
                                                                                  failed_by) -> None:
    """The encode request is answered when its room fails (SIGINT's stop, or its language peer's
    abort), not when the forward pass under way ends: that took seconds for a 4K image, and a
    stopping server closed the connection without an answer. The pass's memory is released when
    the pass ends."""
    transport, pool = raw_pool
    raw = raw_language
    raw.session = transport.session_id
    image = str(tmp_path / "img.png")
    make_image(448, 448, seed=3).save(image)
    worker = EncodeWorker(ConnectorConfig(num_blocks=100), GatedEncoder(), free_port(),
                          MediaPolicy.create([str(tmp_path)]))
    try:
        raw.connect(worker.sender.rank_port)
        raw.register(pool)
        raw.send(InitMsg(4, "127.0.0.1", raw.port, raw.session, tuple(range(2)), 1, 256))
        wait_for(lambda: worker.sender.asked_for(4), EVENTUALLY_S, "the init")
        with ThreadPoolExecutor(1) as runner:
            reply = runner.submit(asyncio.run, worker.encode("rid4", 4, [image], wait_for_delivery=False))
            wait_for(lambda: worker._computing == 1, 10, "the forward pass")
            if failed_by == "stop":
                worker.stop()
            else:
                raw.send(AbortMsg(4, "127.0.0.1", raw.port, raw.generation))
            with pytest.raises(TransferFailure) as err:
                reply.result(timeout=AT_ONCE_S)  # the encoder is still held
        assert err.value.kind == (FailureKind.SHUTTING_DOWN if failed_by == "stop" else FailureKind.ABORTED), err.value
        assert worker._queues()["decode_bytes"] > 0  # the pass still holds what it decoded
        worker.encoder.go.set()
        wait_for(lambda: worker._queues()["decode_bytes"] == 0 and worker.sender.staging.used == 0, 10,
                 "the pass's memory")
    finally:
        worker.encoder.go.set()
        worker.close()
