"""Under load nothing deadlocks: many concurrent request pairs of mixed sizes, in random order,
against pools far smaller than the work (real worker processes, SGLang's encoder)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from bench_load import SIZES
from test_workers import Pair, assert_pools_free
from transfer_large_image import make_image, run_request

pytestmark = pytest.mark.load

FOUR_K = (3840, 2160)


@pytest.fixture(scope="module")
def mixed_images(tmp_path_factory) -> dict[tuple[int, int], str]:
    root = tmp_path_factory.mktemp("load-images")
    out = {}
    for i, (w, h) in enumerate(SIZES):
        out[(w, h)] = str(root / f"{w}x{h}.png")
        make_image(w, h, seed=40 + i).save(out[(w, h)])
    return out


def run_pairs(pair: Pair, images: dict, count: int, seed: int, timeout: float = 240) -> list[dict]:
    """``count`` request pairs at once, sizes and the order of /encode and /generate at random."""
    rng = random.Random(seed)
    jobs = [(rng.choice(SIZES), rng.random() < 0.5, rng.uniform(0, 0.3)) for _ in range(count)]
    rooms = [next(pair.rooms) for _ in jobs]

    def one(i: int) -> dict:
        size, encode_first, gap = jobs[i]
        res = run_request(pair.encode.url, pair.language.url, pair.encode.bootstrap_port, f"load-{rooms[i]}",
                          rooms[i], [images[size]], timeout, encode_first=encode_first, gap=gap)
        return {**res, "size": size}

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


@pytest.fixture(scope="module")
def model(seeded_checkpoint) -> str:
    return seeded_checkpoint(3584)


@pytest.fixture(scope="module")
def small_language_pool(model):
    pair = Pair(model_path=model, language_args=("--embedding-cache-buffer-size", "96"))
    yield pair
    pair.stop()


def test_32_concurrent_pairs_against_a_96_block_language_pool_all_complete(small_language_pool, mixed_images) -> None:
    results = run_pairs(small_language_pool, mixed_images, 32, seed=48)
    failed = [r for r in results if not r["match"]]
    assert not failed, failed[:3]
    assert {r["size"] for r in results} == set(SIZES)
    assert sum(r["resume_rounds"] for r in results) >= sum(r["size"] == FOUR_K for r in results)
    assert_pools_free(small_language_pool)


def test_an_encoder_pool_smaller_than_one_4k_image_refuses_it_at_once_and_serves_the_rest(mixed_images, model) -> None:
    # 64 encoder blocks hold 8192 tokens; a 4K image needs 83 blocks (10,549 tokens).
    pair = Pair(model_path=model, encode_args=("--embedding-cache-buffer-size", "64"),
                language_args=("--embedding-cache-buffer-size", "96"))
    try:
        results = run_pairs(pair, mixed_images, 16, seed=64)
        for r in results:
            if r["size"] == FOUR_K:  # refused on both sides, with the reason, before any work
                assert (r["encode_status"], r["language_status"]) == (413, 413), r
                assert "needs 83 blocks (10549 tokens); the encode pool has 64" in r["encode_error"]
                assert "the encode pool has 64" in r["language_error"]
            else:
                assert r["match"], r
        assert any(r["size"] == FOUR_K for r in results) and any(r["match"] for r in results)
        assert_pools_free(pair)
    finally:
        pair.stop()
