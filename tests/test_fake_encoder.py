"""The numpy test double (``tests/fake_encoder.py``) against what it stands in for: the seeded
checkpoint's image processor (the one SGLang's encoder runs) resizes, counts tokens and grids the
same way, and the double's rows are deterministic and follow the pixels."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from fake_encoder import PATCH, FakeEncoder
from PIL import Image
from transfer_large_image import make_image

from embedding_side.encoders import grid_for, tokens_for

pytestmark = pytest.mark.fast

# Sides around a multiple of 28, the minimum (56 x 56) and maximum (16384 tokens: 3584 x 3584) areas
SIDES = [1, 2, 13, 14, 27, 28, 29, 55, 56, 57, 100, 111, 112, 113, 448, 1000, 2160, 3583, 3584, 3585, 3840, 5000, 14000]


def sizes() -> list[tuple[int, int]]:
    rng = np.random.default_rng(0)
    random = np.exp(rng.uniform(0, np.log(20000), (300, 2))).astype(int) + 1
    edges = [(10, 2000), (2000, 10), (10, 2001), (1, 200), (1, 201), (2, 401), (56, 56), (55, 57), (3584, 3585)]
    return [*itertools.product(SIDES, SIDES), *map(tuple, random.tolist()), *edges]


@pytest.fixture(scope="module")
def processor(seeded_checkpoint):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(seeded_checkpoint(256, layers=2)).image_processor


def test_the_fake_resizes_as_the_checkpoints_processor(processor) -> None:
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    fake, refused = FakeEncoder(8), 0
    factor = processor.patch_size * processor.merge_size
    for h, w in sizes():
        if max(h, w) / min(h, w) > 200:
            with pytest.raises(ValueError, match=f"image {w}x{h}: aspect ratio must be at most 200"):
                fake.resize(h, w)
            refused += 1
            continue
        assert fake.resize(h, w) == smart_resize(h, w, factor, processor.size["shortest_edge"],
                                                 processor.size["longest_edge"]), (h, w)
    assert refused > 10  # the aspect ratio limit was reached on both sides
    for h, w in [(0, 5), (5, 0)]:
        with pytest.raises(ValueError, match="aspect ratio"):
            fake.resize(h, w)


def test_token_counts_and_grids_are_the_processors(processor) -> None:
    """Tokens known before encoding = the processor's patch count / 4, and the grid is what the
    processor gives the tower; the hub settings' counts for the sizes the tests use."""
    fake = FakeEncoder(8)
    for h, w in [(448, 448), (2160, 3840), (100, 100), (2000, 20), (57, 55), (3585, 3585), (13, 1000)]:
        image = Image.new("RGB", (w, h))
        assert tokens_for(image, fake) * 4 == processor.get_number_of_image_patches(h, w)
        if h * w <= 1000 * 1000:
            grid = processor(images=[image], return_tensors="np")["image_grid_thw"].tolist()
            assert grid == [list(grid_for(image, fake.resize, PATCH))]
    counts = {(w, h): tokens_for(Image.new("RGB", (w, h)), fake)
              for w, h in [(448, 448), (1024, 1024), (2048, 2048), (3840, 2160), (100, 100), (20, 2000)]}
    assert counts == {(448, 448): 256, (1024, 1024): 1369, (2048, 2048): 5329, (3840, 2160): 10549,
                      (100, 100): 16, (20, 2000): 71}


def test_the_fakes_rows_are_deterministic_and_follow_the_pixels() -> None:
    a, b = make_image(448, 448, 1), make_image(448, 448, 2)
    fake = FakeEncoder()
    encoded = fake.encode([a, make_image(1000, 300, 3)])
    assert encoded.grid_thw == [(1, 32, 32), (1, 22, 72)] and encoded.embeddings.shape == (256 + 396, 3584 * 2)
    assert np.array_equal(fake.encode([a]).embeddings, FakeEncoder().encode([a]).embeddings)
    assert not np.array_equal(fake.encode([a]).embeddings, fake.encode([b]).embeddings)
