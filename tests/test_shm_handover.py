"""The shared-memory segment a received embedding reaches SGLang's scheduler in, made off the
event loop (``sglang_ext/shm_handover.py``), in this process: the scheduler's side of SGLang
(its ``ShmPointerMMData`` sent by msgpack and materialized) gets the same bytes and removes it;
one never sent is removed when its request ends; a cancelled handover leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import msgspec
import pytest
import torch
from sglang.srt.managers.mm_utils import ShmPointerMMData
from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
from sglang.srt.utils.msgpack_utils import dec_hook, enc_hook, ext_hook

from sglang_ext import shm_handover

pytestmark = pytest.mark.fast

SHM = Path("/dev/shm")
EVENTUALLY_S = 30.0  # a poll's deadline: what it catches is "never"


def item(seed: int = 0, rows: int = 512) -> MultimodalDataItem:
    embedding = torch.empty(rows, 256, dtype=torch.bfloat16).uniform_(generator=torch.Generator().manual_seed(seed))
    made = MultimodalDataItem(modality=Modality.IMAGE, precomputed_embeddings=embedding)
    made.set_hash(12345 + seed)
    return made


def test_the_scheduler_side_gets_the_same_bytes_and_removes_the_segment() -> None:
    given = item()
    rows = given.precomputed_embeddings.clone()
    [name] = asyncio.run(shm_handover.hand_over([given]))
    assert isinstance(given.precomputed_embeddings, ShmPointerMMData) and (SHM / name).exists()
    # the item as SGLang sends it to its scheduler (msgpack, its own hooks), which maps the rows
    sent = msgspec.msgpack.Decoder(MultimodalDataItem, dec_hook=dec_hook, ext_hook=ext_hook).decode(
        msgspec.msgpack.encode(given, enc_hook=enc_hook))
    assert sent.hash == given.hash and sent.precomputed_embeddings.precomputed_hash == given.hash
    assert torch.equal(sent.precomputed_embeddings.materialize(), rows)
    assert not (SHM / name).exists()
    shm_handover.unlink([name])  # the request's end, after the scheduler removed it: nothing to do


def test_a_segment_never_sent_is_removed_when_its_request_ends() -> None:
    names = asyncio.run(shm_handover.hand_over([item(1), item(2)]))
    assert all((SHM / name).exists() for name in names) and len(set(names)) == 2
    shm_handover.unlink(names)
    assert not any((SHM / name).exists() for name in names)


def test_a_cancelled_handover_leaves_no_segment() -> None:
    ours = f"sgl_shm_mm_{os.getpid()}_*"  # made here (the name carries its maker's pid), not by servers beside us
    before = set(SHM.glob(ours))

    async def cancelled() -> None:
        handing = asyncio.ensure_future(shm_handover.hand_over([item(3, rows=20_000), item(4)]))
        await asyncio.sleep(0)  # the first segment is being made on its thread
        handing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handing

    asyncio.run(cancelled())
    deadline = time.monotonic() + EVENTUALLY_S
    while set(SHM.glob(ours)) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(SHM.glob(ours)) - before


def test_with_dev_shm_full_the_item_keeps_its_rows_for_sglang(monkeypatch) -> None:
    """SGLang itself then sends the rows inline (``_wrap_shm_or_inline``); nothing is left behind."""
    def full(tensor, precomputed_hash=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("sglang.srt.managers.mm_utils.ShmPointerMMData", full)
    given = item(5)
    rows = given.precomputed_embeddings
    assert asyncio.run(shm_handover.hand_over([given])) == []
    assert given.precomputed_embeddings is rows
