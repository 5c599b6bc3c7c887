"""A seeded image request through SGLang's own server as the language worker (and SGLang's
encoder): the same ids alone and among concurrent requests of other sampling parameters
(``sglang_ext/seeds.py``; the in-process half is ``test_seeds.py``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from sglang_stack import LANGUAGE_FLAGS, generate, sglang_pair, write_images

pytestmark = pytest.mark.sglang

NEW_TOKENS = 24
TARGET = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 2024}
# a row without top_p or top_k: alone its batches take SGLang's plain seeded draw, among the
# others (the target's top_p) its top-k/top-p one; both must give it the same noise
PLAIN = {"temperature": 1.0, "sampling_seed": 77}
CROWDS = {
    "text, temperature 1": ([{"temperature": 1.0, "top_p": 1.0, "sampling_seed": seed} for seed in range(5)], False),
    "images, mixed parameters": ([{"temperature": 0.7, "top_k": 40, "sampling_seed": 5},
                                  {"temperature": 1.3, "top_p": 0.5, "sampling_seed": 6}, {"temperature": 0.0},
                                  {"temperature": 1.0, "sampling_seed": 7},
                                  {"temperature": 1.0, "top_p": 1.0, "top_k": 3, "sampling_seed": 8}], True),
}


@pytest.fixture(scope="module")
def pair(seeded_checkpoint):
    with sglang_pair(seeded_checkpoint(256, layers=2), *LANGUAGE_FLAGS) as (encode, language):
        yield encode, language


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("seeded-images"))


def sampled(language, paths: list[str], rid: str, params: dict, new_tokens: int = NEW_TOKENS) -> list[int]:
    answer = generate(language, paths, rid, sampling_params={"max_new_tokens": new_tokens, "ignore_eos": True} | params)
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"]


@pytest.mark.parametrize("crowd", list(CROWDS))
def test_a_seeded_image_request_gets_the_same_ids_alone_and_among_others(pair, images, crowd) -> None:
    """Top_p 0.95 at temperature 0.9 (and a plain temperature-1 request), each with an image and
    its seed: alone twice, then sent while 5 other seeded (or greedy) requests run, which
    outlast them: the same ids."""
    _, language = pair
    image = [images["448x448"]]
    alone = sampled(language, image, f"target-alone-{crowd}", TARGET)
    plain = sampled(language, image, f"plain-alone-{crowd}", PLAIN)
    assert sampled(language, image, f"target-again-{crowd}", TARGET) == alone and len(set(alone)) > 4
    others, with_images = CROWDS[crowd]
    with ThreadPoolExecutor(len(others) + 2) as pool:
        running = [pool.submit(sampled, language, [images["other"]] if with_images else [], f"other-{i}-{crowd}",
                               params, 2 * NEW_TOKENS) for i, params in enumerate(others)]
        target = pool.submit(sampled, language, image, f"target-among-{crowd}", TARGET)
        plain_among = pool.submit(sampled, language, image, f"plain-among-{crowd}", PLAIN)
        assert target.result() == alone
        assert plain_among.result() == plain
        assert all(len(r.result()) == 2 * NEW_TOKENS for r in running)
