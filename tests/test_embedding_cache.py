"""The language worker's image embedding cache: keys from the image bytes and the encoders'
preprocessing, an LRU over a byte budget, parts split back into images."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from transfer_large_image import make_image

from language_side.embedding_cache import EmbeddingCache, image_key, split_rows

pytestmark = pytest.mark.fast


def png_uri(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_two_images_that_differ_in_one_pixel_or_one_setting_never_share_a_key() -> None:
    image = make_image(64, 48, seed=3)
    other = image.copy()
    other.putpixel((10, 10), tuple((c + 1) % 256 for c in image.getpixel((10, 10))))
    key = image_key(png_uri(image), "fp1")
    assert key is not None and key == image_key(png_uri(image.copy()), "fp1")  # the bytes, not the object
    assert image_key(png_uri(other), "fp1") != key
    assert image_key(png_uri(image), "fp2") != key  # another preprocessing
    for source in ("/data/a.png", "http://x/a.png", "data:image/png;base64,@@@", "data:text/plain,abc"):
        assert image_key(source, "fp1") is None  # bytes the worker does not hold, or not base64


def test_the_cache_evicts_least_recently_used_by_bytes() -> None:
    cache = EmbeddingCache(budget_bytes=3000)
    rows = {k: np.full((10, 100), i, np.uint8) for i, k in enumerate("abcd")}  # 1000 bytes each
    for k in "abc":
        cache.put(k, rows[k], (1, 2, 2))
    assert cache.get("a") is not None  # a is now the most recent: b goes first
    cache.put("d", rows["d"], (1, 2, 2))
    assert cache.get("b") is None and {k for k in "acd" if cache.get(k) is not None} == {"a", "c", "d"}
    assert cache.used == 3000 and len(cache) == 3
    cache.put("big", np.zeros((40, 100), np.uint8), (1, 4, 10))  # larger than the whole budget: not kept
    assert cache.get("big") is None and len(cache) == 3
    got, grid = cache.get("c")
    assert np.array_equal(got, rows["c"]) and grid == (1, 2, 2)
    rows["c"][:] = 99  # the cache holds its own copy
    assert cache.get("c")[0][0, 0] == 2


def test_a_parts_rows_split_back_into_its_images() -> None:
    rows = np.arange(7 * 4, dtype=np.uint8).reshape(7, 4)
    first, second = split_rows(rows, [(1, 2, 2), (1, 6, 4)])  # 1 and 6 merged tokens
    assert np.array_equal(first, rows[:1]) and np.array_equal(second, rows[1:])
    with pytest.raises(ValueError, match="7 embedding rows for grids of 8 tokens"):
        split_rows(rows, [(1, 4, 4), (1, 4, 4)])
