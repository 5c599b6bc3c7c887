"""Qwen2-VL and Qwen3-VL-MoE served end to end: SGLang's encoder as the encode worker, SGLang's
language server fed through the connector, both started with SGLang's launcher on a seeded
checkpoint of the family.

Qwen2-VL has its own tower (LayerNorm, QuickGELU, no windows); Qwen3-VL-MoE is Qwen3-VL's tower
(deepstack rows) before a mixture-of-experts language model. Every generated id is checked against
transformers' monolithic ``generate`` of the family from the pixels, strictly
(``monolithic.greedy_mismatch``), with the negative test that another image's answer fails that
comparison.
"""

from __future__ import annotations

import pytest
from make_checkpoint import write_qwen2_vl_checkpoint, write_qwen3_vl_checkpoint
from monolithic import greedy_mismatch
from sglang_stack import (
    family_reference,
    generate,
    generate_as_reference,
    generate_videos,
    sglang_pair,
    write_clips,
    write_images,
)

pytestmark = pytest.mark.sglang

# family -> (writer, SGLang's model class, what the encoder calls itself)
FAMILIES = {
    "Qwen2VL": (write_qwen2_vl_checkpoint, "Qwen2VLForConditionalGeneration", "sglang:qwen2_vl"),
    "Qwen3VLMoe": (lambda folder: write_qwen3_vl_checkpoint(folder, moe=True), "Qwen3VLMoeForConditionalGeneration",
                   "sglang:qwen3_vl_moe"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory) -> str:
    return str(FAMILIES[family][0](tmp_path_factory.mktemp(family)))


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("family-media")
    return write_images(root) | write_clips(root)


@pytest.fixture(scope="module")
def workers(folder):
    with sglang_pair(folder, "--max-total-tokens", "32768", "--skip-server-warmup") as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(folder):
    return family_reference(folder)


def test_images_equal_monolithic_and_another_image_is_caught(family, workers, media, reference) -> None:
    encode, language = workers
    _, model_class, encoder_name = FAMILIES[family]
    assert f"encoder={encoder_name}" in encode.ready_line, encode.ready_line
    assert [line for line in language.log if f"{model_class} built without its vision tower" in line]
    body = generate_as_reference(language, [media["448x448"]], f"{family}-448", reference)
    assert body["meta_info"]["encode_ms"] > 0, body["meta_info"]
    generate_as_reference(language, [media["448x448"], media["other"]], f"{family}-two", reference)
    other = generate(language, [media["other"]], f"{family}-other")
    assert other.status_code == 200, other.text
    assert greedy_mismatch(other.json()["output_ids"], reference([media["448x448"]])) is not None


def test_a_video_equals_monolithic(family, workers, media, reference) -> None:
    _, language = workers
    body = generate_videos(language, [media["392x280x8"]], f"{family}-video")
    assert greedy_mismatch(body["output_ids"], reference([], [media["392x280x8"]])) is None
