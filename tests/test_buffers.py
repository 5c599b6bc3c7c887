"""Pool layout, scatter/gather, zero-copy views, and write planning."""

from __future__ import annotations

import numpy as np
import pytest

from connector.addressing import plan_round
from connector.buffers import BufferPool, Embedding
from connector.config import ConnectorConfig
from harness.connector_peer import synthetic_embedding

pytestmark = pytest.mark.fast


def test_item_lengths_match_the_forks_table() -> None:
    assert BufferPool(2, 1024, 3584).item_lens == (7_340_032, 4_096, 12_288, 64)
    assert BufferPool(1, 8192, 3584).item_lens == (58_720_256, 32_768, 98_304, 64)


@pytest.mark.parametrize("tokens", [1, 127, 128, 129, 1000, 1024])
def test_scatter_then_gather_returns_the_same_embedding(tokens: int) -> None:
    pool = BufferPool(12, 128, 64)
    emb = synthetic_embedding(tokens, 64, "bfloat16", tokens)
    blocks = [11, 3, 4, 0, 7, 8, 9, 1, 2][: pool.blocks_for(tokens)]
    pool.write(blocks, emb)
    out = Embedding.empty(tokens, 64, "bfloat16")
    pool.read_into(blocks, out, 0, tokens)
    assert out.digests() | {"aux": ""} == emb.digests() | {"aux": ""}
    assert (pool.aux[blocks[0]] == emb.aux).all()


def test_partial_block_holds_mrope_as_3_by_n() -> None:
    pool = BufferPool(4, 128, 8)
    emb = synthetic_embedding(130, 8, "bfloat16", 1)
    pool.write([0, 1], emb)
    assert (pool.mrope[1, :6].reshape(3, 2) == emb.mrope_positions[:, 128:130]).all()
    assert (pool.mrope[0].reshape(3, 128) == emb.mrope_positions[:, :128]).all()


def test_view_is_zero_copy_only_for_one_run_of_blocks() -> None:
    pool = BufferPool(8, 128, 16)
    emb = synthetic_embedding(300, 16, "bfloat16", 2)
    pool.write([2, 3, 4], emb)
    view = pool.view([2, 3, 4], 300)
    assert view is not None and np.shares_memory(view.embeddings, pool.embeddings)
    assert view.sha256() == emb.sha256() and (view.mrope_positions == emb.mrope_positions).all()
    pool.write([5, 1, 6], emb)
    assert pool.view([5, 1, 6], 300) is None


def test_pool_rejects_mismatched_embeddings() -> None:
    pool = BufferPool(4, 128, 16)
    with pytest.raises(ValueError, match="need 2 blocks"):
        pool.write([0], synthetic_embedding(200, 16, "bfloat16", 0))
    with pytest.raises(ValueError, match="pool is 16"):
        pool.write([0], synthetic_embedding(10, 32, "bfloat16", 0))
    with pytest.raises(ValueError, match="dtype"):
        BufferPool(4, 128, 16, "int8")


def reference_plan(src, dst, tokens, bs, src_bases, dst_bases, item_lens, with_aux):
    """Per-block addresses exactly as the fork computes them (one entry per block and buffer)."""
    out = []
    nb = -(-tokens // bs)
    for k in range(nb):
        n = min(bs, tokens - k * bs)
        for buf in range(3):
            out.append((src_bases[buf] + src[k] * item_lens[buf], dst_bases[buf] + dst[k] * item_lens[buf],
                        item_lens[buf] * n // bs))
    if with_aux:
        out.append((src_bases[3] + src[0] * item_lens[3], dst_bases[3] + dst[0] * item_lens[3], item_lens[3]))
    return out




@pytest.mark.parametrize("tokens, src, dst, aux", [
    (1000, [0, 1, 2, 3, 4, 5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17], True),
    (1000, [0, 1, 2, 9, 4, 5, 6, 7], [3, 4, 5, 6, 0, 1, 2, 8], False),
    (129, [5, 6], [1, 0], True),
])
def test_coalesced_writes_cover_exactly_the_forks_bytes(tokens, src, dst, aux) -> None:
    bs, item = 128, (128 * 16, 128 * 4, 128 * 12, 64)
    sb, db = (1 << 20, 2 << 20, 3 << 20, 4 << 20), (5 << 20, 6 << 20, 7 << 20, 8 << 20)
    plan = plan_round(src, dst, tokens, bs, sb, db, item, aux)
    ref = reference_plan(src, dst, tokens, bs, sb, db, item, aux)
    want = {}
    for s, d, n in ref:
        for off in range(n):
            want[s + off] = d + off
    got = {}
    for s, d, n in zip(plan.src_addrs, plan.dst_addrs, plan.lengths, strict=True):
        for off in range(n):
            got[s + off] = d + off
    assert got == want
    assert plan.nbytes == sum(n for *_, n in ref)
    if src == [0, 1, 2, 3, 4, 5, 6, 7]:
        assert len(plan.lengths) == 4  # one write per buffer plus aux


def test_config_reads_the_reference_env_names_and_validates() -> None:
    env = {"SGLANG_MULTIMODAL_BLOCK_SIZE": "64", "SGLANG_EMBEDDING_CACHE_BUFFER_SIZE": "100",
           "SGLANG_EMBEDDING_DEFAULT_ALLOCATE_BUFFER_SIZE": "1000"}
    cfg = ConnectorConfig.from_env(env)
    assert (cfg.block_size, cfg.num_blocks, cfg.default_allocate_tokens) == (64, 100, 1000)
    assert cfg.default_allocate_blocks == 16  # 1000 tokens round up to 16 blocks of 64
    assert ConnectorConfig.from_env(env, block_size=32).block_size == 32
    with pytest.raises(ValueError, match="SGLANG_MULTIMODAL_BLOCK_SIZE='x'"):
        ConnectorConfig.from_env({"SGLANG_MULTIMODAL_BLOCK_SIZE": "x"})
    with pytest.raises(ValueError, match="block_size must be positive"):
        ConnectorConfig(block_size=0)
    assert ConnectorConfig().pool_bytes == 512 * (128 * (3584 * 2 + 16) + 64)


def test_pool_is_plain_memory_without_cuda_and_refuses_to_pin() -> None:
    """Pinned where CUDA is present (checked on a GPU machine only); here, without CUDA, plain
    memory by default and a clear error when pinning is asked for."""
    import torch

    assert not torch.cuda.is_available()
    assert BufferPool(2, 128, 64).pinned is False
    with pytest.raises(ValueError, match="a pinned pool needs CUDA"):
        BufferPool(2, 128, 64, pinned=True)


def test_a_machine_without_a_gpu_driver_is_answered_without_importing_torch(monkeypatch) -> None:
    """A process that has not imported torch (the transfer-only receiver, the fake encoder, the
    connector's test peers) is not made to import it (2 s of CPU) to learn there is no GPU."""
    import sys

    from connector import buffers

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(buffers, "GPU_DRIVER_FILES", ("/nonexistent/nvidiactl",))
    assert buffers.cuda_present() is False
    assert BufferPool(2, 128, 64).pinned is False
    assert "torch" not in sys.modules


def test_the_copy_for_sglang_carries_the_digest_of_its_own_bytes_whatever_lands_in_the_pool_meanwhile() -> None:
    """Bytes can land in a room's blocks late (a write Mooncake gave up on, then retransmitted by
    the kernel after a partition healed: docs/failure_bounds.md). The digest the language side
    checks against the encoder's is of the rows SGLang gets, not of the pool they were copied from,
    so such bytes fail the part (a digest mismatch, tried on another encoder) instead of reaching a
    prefill. Here a thread keeps changing the pool's rows while they are consumed."""
    import hashlib
    import threading

    from language_side.consumers import EmbeddingCopy

    pool = BufferPool(8, 128, 2048)
    pool.write(list(range(8)), synthetic_embedding(1000, 2048, "bfloat16", 1))
    view = pool.view(list(range(8)), 1000)  # one run of blocks: the pool's own memory
    assert view is not None
    stop = threading.Event()

    def land_late() -> None:
        while not stop.is_set():
            view.embeddings[:, :64] ^= 1

    writer = threading.Thread(target=land_late)
    writer.start()
    try:
        answers = [EmbeddingCopy().consume("r", view) for _ in range(60)]
    finally:
        stop.set()
        writer.join()
    assert all(answer["sha256"] == hashlib.sha256(answer["embedding"]).hexdigest() for answer in answers)
