"""SGLang's item hash for a received embedding, in this process: the digest the connector took of
the rows (end to end) is the value SGLang's own ``hash_feature`` gives the same tensor, it is
adopted only where the item's tensor is those bytes, and SGLang then does not hash them again."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.managers import mm_utils
from sglang.srt.managers.schedule_batch import MultimodalDataItem
from sglang.srt.multimodal.processors.hash_executor import MultimodalHashExecutor

from connector.buffers import rows_sha256
from language_side.dispatch import Embedded
from sglang_ext.mm_receiver import ResumableReceiver

pytestmark = pytest.mark.fast

HIDDEN = 64


class Processor:
    """SGLang's ``get_validated_mm_data`` (``qwen_vl.py: get_mm_data``) reduced to what the hash
    sees: one item per image, whose ``precomputed_embeddings`` is that image's view of the rows
    given for its modality (``images``: how many the rows hold, in equal parts)."""

    def __init__(self, images: int = 1) -> None:
        self.images = images

    def get_validated_mm_data(self, prompt, embeddings, **layout):
        return SimpleNamespace(mm_items=[
            MultimodalDataItem(modality=modality, precomputed_embeddings=rows)
            for modality, tensor in embeddings.items() for rows in tensor.chunk(self.images)])


class Dispatch:
    def __init__(self, embedded: Embedded) -> None:
        self.embedded = embedded

    async def embed(self, rid, images, cache_salt=None):
        return self.embedded


def received(digest: bool = True) -> Embedded:
    rows = np.random.default_rng(3).integers(0, 256, (16 * 4, 2 * HIDDEN), dtype=np.uint8)
    return Embedded(rows, [(1, 8, 8)], rows_sha256=rows_sha256(rows) if digest else None)


def items(embedded: Embedded, dtype: torch.dtype = torch.bfloat16, processor: Processor | None = None) -> list:
    request = SimpleNamespace(rid="r", image_data=["a.png"], video_data=None, audio_data=None)
    inputs = asyncio.run(ResumableReceiver(Dispatch(embedded), dtype).recv_mm_data(
        request, processor or Processor(), "prompt"))
    return inputs.mm_items


def test_the_connectors_digest_is_sglangs_own_item_hash_and_sglang_does_not_hash_again(monkeypatch) -> None:
    embedded = received()
    [item] = items(embedded)
    assert item.hash is not None and item.pad_value is not None
    assert item.hash == mm_utils.hash_feature(item.precomputed_embeddings)  # SGLang's function, same bytes
    assert item.hash == int(embedded.rows_sha256[:16], 16)

    def no_hash(value):
        raise AssertionError("SGLang hashed an embedding whose digest it had")

    monkeypatch.setattr(mm_utils, "hash_feature", no_hash)
    before = (item.hash, item.pad_value)
    asyncio.run(MultimodalHashExecutor().set_pad_values([item]))  # what the tokenizer manager runs next
    assert (item.hash, item.pad_value) == before


@pytest.mark.parametrize("case", ["no digest (joined or cached rows)", "converted to float16", "two images in the part"])
def test_an_item_that_is_not_the_digested_bytes_is_left_for_sglang_to_hash(case) -> None:
    embedded = received(digest=case != "no digest (joined or cached rows)")
    made = items(embedded, torch.float16 if case == "converted to float16" else torch.bfloat16,
                 Processor(images=2 if case == "two images in the part" else 1))
    assert all(item.hash is None and item.pad_value is None for item in made)
    asyncio.run(MultimodalHashExecutor().set_pad_values(made))
    assert [item.hash for item in made] == [mm_utils.hash_feature(item.precomputed_embeddings) for item in made]
    if case == "no digest (joined or cached rows)":  # the same bytes: SGLang's value is the digest's
        assert made[0].hash == int(rows_sha256(embedded.rows)[:16], 16)
