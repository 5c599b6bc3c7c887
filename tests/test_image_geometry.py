"""Qwen's image geometry: our ``smart_resize`` (what the fake encoder and the default geometry use,
without importing transformers) against transformers' own, and the real encoder's geometry,
which is transformers' with its image processor's settings."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from PIL import Image

from embedding_side.encoders import (
    FACTOR,
    MAX_PIXELS,
    MIN_PIXELS,
    PATCH,
    FakeEncoder,
    QwenVisionEncoder,
    grid_for,
    smart_resize,
    tokens_for,
)

pytestmark = pytest.mark.fast

# Sides around a multiple of 28, the minimum (56 x 56) and maximum (16384 tokens: 3584 x 3584) areas
SIDES = [1, 2, 3, 13, 14, 27, 28, 29, 41, 42, 55, 56, 57, 83, 84, 85, 100, 111, 112, 113, 200, 448, 999, 1000,
         2160, 3583, 3584, 3585, 3598, 3840, 4095, 5000, 7000, 14000]
# (min_pixels, max_pixels): ours, transformers' defaults, and a narrow band
LIMITS = [(MIN_PIXELS, MAX_PIXELS), (56 * 56, 28 * 28 * 1280), (28 * 28, 28 * 28 * 4)]


def sizes() -> list[tuple[int, int]]:
    rng = np.random.default_rng(0)
    random = np.exp(rng.uniform(0, np.log(20000), (2000, 2))).astype(int) + 1
    edges = [(10, 2000), (2000, 10), (10, 2001), (1, 200), (1, 201), (2, 401), (56, 56), (55, 57), (3584, 3584),
             (3584, 3585), (3585, 3585)]
    return [*itertools.product(SIDES, SIDES), *map(tuple, random.tolist()), *edges]


@pytest.fixture(scope="module")
def hf_smart_resize():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    return hf


@pytest.fixture(scope="module")
def qwen() -> QwenVisionEncoder:
    return QwenVisionEncoder()


@pytest.mark.parametrize("limits", LIMITS, ids=lambda lim: f"{lim[0]}-{lim[1]}")
def test_ours_equals_transformers_smart_resize(hf_smart_resize, limits: tuple[int, int]) -> None:
    refused = 0
    for h, w in sizes():
        try:
            want = hf_smart_resize(h, w, factor=FACTOR, min_pixels=limits[0], max_pixels=limits[1])
        except ValueError:
            with pytest.raises(ValueError, match=f"image {w}x{h}: aspect ratio must be at most 200"):
                smart_resize(h, w, *limits)
            refused += 1
            continue
        assert smart_resize(h, w, *limits) == want, (h, w)
    assert refused > 10  # the aspect ratio limit was reached on both sides


def test_the_real_encoder_resizes_with_transformers_and_its_processor(qwen, hf_smart_resize) -> None:
    fake = FakeEncoder()
    for h, w in sizes():
        if max(h, w) / min(h, w) > 200:
            for encoder in (qwen, fake):
                with pytest.raises(ValueError, match=f"image {w}x{h}: aspect ratio must be at most 200"):
                    encoder.resize(h, w)
            continue
        assert qwen.resize(h, w) == fake.resize(h, w) == hf_smart_resize(h, w, FACTOR, MIN_PIXELS, MAX_PIXELS)
    for h, w in [(0, 5), (5, 0)]:
        with pytest.raises(ValueError, match="aspect ratio"):
            qwen.resize(h, w)


def test_token_counts_are_the_image_processors(qwen) -> None:
    """Tokens known before encoding = the processor's patch count / 4 (what vLLM asks it), and the
    grid is what the processor gives the tower."""
    for h, w in [(448, 448), (2160, 3840), (100, 100), (2000, 20), (57, 55), (3585, 3585), (13, 1000)]:
        image = Image.new("RGB", (w, h))
        assert tokens_for(image, qwen) * 4 == qwen.processor.get_number_of_image_patches(h, w)
        assert tokens_for(image, qwen) == tokens_for(image, FakeEncoder(8))
        if h * w <= 1000 * 1000:
            grid = qwen.processor(images=[image], return_tensors="np")["image_grid_thw"].tolist()
            assert grid == [list(grid_for(image, qwen.resize))] == [[1, qwen.resize(h, w)[0] // PATCH,
                                                                      qwen.resize(h, w)[1] // PATCH]]
