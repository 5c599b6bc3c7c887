"""A family that is not Qwen: MiniMax-M3-VL (``scripts/checkpoint_minimax.py``), SGLang's own
encoder in the encode worker, SGLang's language server, the resumable connector between.

MiniMax-M3-VL's model resizes each image before its processor (the long side to at most 2016 px,
sides to multiples of 28, the short side to at least 112) and the processor then keeps the
size; the encode worker knows the token count from the header by that rule
(``sglang_encoder._resize_rule``). The reference is transformers' own
``MiniMaxM3SparseForConditionalGeneration.generate`` with its own processor (no resize of its
own) on the image as SGLang's rule resizes it (its own function); greedy ids equal at every step
(``monolithic.greedy_mismatch``). transformers' tower mixes the images of one call (no
attention mask across them), so the reference runs it on each image alone, as the family's own
tower and SGLang's encode them. The language side allocates
1024 tokens first, so 1920x1080 (2,691 tokens) and 3840x2160 (2,880) come in resume rounds.
"""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import requests
from checkpoint_minimax import write_minimax_m3_vl_checkpoint
from monolithic import Greedy, greedy_generate, greedy_mismatch
from PIL import Image
from sglang_stack import NEW_TOKENS, SIZES, encoder_health, sglang_pair, write_images
from transfer_large_image import make_image

from harness.workers import WorkerProcess

pytestmark = pytest.mark.sglang

FIRST_ALLOCATION = 1024
PROMPT = "]~!b[]~b]user\n{images}Describe it.[e~[\n]~b]ai\n"
IMAGE = "]<]image[>["


def prompt(n_images: int) -> str:
    return PROMPT.format(images=IMAGE * n_images)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_minimax_m3_vl_checkpoint(tmp_path_factory.mktemp("minimax")))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    return write_images(tmp_path_factory.mktemp("minimax-images"))


@pytest.fixture(scope="module")
def workers(folder):
    with sglang_pair(folder, "--skip-server-warmup", "--embedding-default-allocate-buffer-size",
                         str(FIRST_ALLOCATION)) as pair:
        yield pair


@pytest.fixture(scope="module")
def transformers_model(folder):
    """transformers' model of the family, its processor, and ``pictures(paths)``: the images as
    SGLang's rule resizes them (its own function; the processor then keeps the size)."""
    import torch
    from sglang.srt.multimodal.processors.minimax_m3_vl import DEFAULT_IMAGE_LONG_SIDE, _resize_image_to_long_side
    from transformers import AutoProcessor, MiniMaxM3SparseForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    factor = processor.image_processor.patch_size * processor.image_processor.merge_size

    def pictures(paths: list[str]) -> list[Image.Image]:
        return [_resize_image_to_long_side(Image.open(p).convert("RGB"), factor, DEFAULT_IMAGE_LONG_SIDE)
                for p in paths]

    return model, processor, pictures


def each_image_alone(get_image_features):
    """transformers' ``get_image_features``, one call per image. Its tower runs every image of a
    call as one sequence with no attention mask, so each image's patches attend to the others';
    the family's own tower, as SGLang's, attends within each image."""
    def per_image(pixel_values, image_grid_thw, **kwargs):
        pixels = pixel_values.split(image_grid_thw.prod(-1).tolist())
        outputs = [get_image_features(p, grid[None], **kwargs) for p, grid in zip(pixels, image_grid_thw, strict=True)]
        outputs[0].pooler_output = tuple(out.pooler_output[0] for out in outputs)
        return outputs[0]

    return per_image


@pytest.fixture(scope="module")
def reference(transformers_model):
    """transformers' ``generate``, its tower run on each image alone (:func:`each_image_alone`)."""
    model, processor, pictures = transformers_model
    model.model.get_image_features = each_image_alone(model.model.get_image_features)

    def greedy(paths: list[str]) -> Greedy:
        inputs = processor(text=[prompt(len(paths))], images=pictures(paths), do_resize=False, return_tensors="pt")
        return greedy_generate(model, inputs, NEW_TOKENS)

    return greedy


def generate(language: WorkerProcess, paths: list[str], rid: str) -> dict:
    body = {"rid": rid, "text": prompt(len(paths)), "image_data": paths,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
    answer = requests.post(f"{language.url}/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_encode_worker_runs_sglangs_encoder_for_minimax(workers) -> None:
    encode, language = workers
    assert "encoder=sglang:minimax_m3_vl" in encode.ready_line, encode.ready_line
    assert encoder_health(encode)["modalities"] == ["image"]
    # the language server's model is built without the vision tower (its projector and merger in
    # it), whose weights are never read (sglang_ext.no_encoder_tower); the greedy tests pass through it
    dropped = [line for line in language.log if "built without its vision tower" in line]
    assert dropped and "MiniMaxM3SparseForConditionalGeneration" in dropped[0], dropped
    assert not [line for line in encode.log if "built without its" in line]


@pytest.mark.parametrize("size", [*SIZES, "other"])
def test_greedy_ids_equal_monolithic(workers, images, reference, size) -> None:
    """448x448 and 640x336 (resized to 644x336 by the model's rule) in the first allocation;
    1920x1080 and 3840x2160 (its long side to 2016) in resume rounds."""
    _, language = workers
    body = generate(language, [images[size]], f"minimax-{size}")
    assert greedy_mismatch(body["output_ids"], reference([images[size]])) is None
    assert body["meta_info"]["resume_rounds"] == (1 if size in ("1920x1080", "3840x2160") else 0), body["meta_info"]


def test_two_images_in_one_prompt_equal_monolithic(workers, images, reference) -> None:
    _, language = workers
    body = generate(language, [images["other"], images["448x448"]], "minimax-two")
    assert greedy_mismatch(body["output_ids"], reference([images["other"], images["448x448"]])) is None


def test_an_openai_chat_is_generates_answer(workers, images, folder) -> None:
    """The ``openai`` client's image_url part through the checkpoint's chat template."""
    from openai import OpenAI

    _, language = workers
    data = "data:image/png;base64," + base64.b64encode(Path(images["448x448"]).read_bytes()).decode()
    chat = OpenAI(base_url=f"{language.url}/v1", api_key="unused").chat.completions.create(
        model=folder, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}},
                                               {"type": "text", "text": "Describe it."}]}])
    assert chat.choices[0].message.content == generate(language, [images["448x448"]], "minimax-chat")["text"]


def test_transformers_tower_mixes_the_images_of_one_call_and_the_reference_does_not(transformers_model,
                                                                                   images) -> None:
    """Why the reference runs the tower per image: two images in one call of transformers' own
    ``get_image_features`` give other rows than each alone, by far more than a rounding."""
    import torch

    model, processor, pictures = transformers_model
    pair = pictures([images["other"], images["448x448"]])
    original = type(model.model).get_image_features.__get__(model.model)

    def rows(get_image_features, shown: list[Image.Image]) -> torch.Tensor:
        inputs = processor.image_processor(images=shown, do_resize=False, return_tensors="pt")
        with torch.inference_mode():
            out = get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        return torch.cat(out.pooler_output).float()

    alone = torch.cat([rows(original, [picture]) for picture in pair])
    together = rows(original, pair)
    assert (together - alone).abs().max() > 0.1 * alone.abs().max()  # mixed
    assert torch.equal(rows(each_image_alone(original), pair), alone)


def test_the_reference_depends_on_the_picture(reference, images) -> None:
    """Else the equality checks above would pass for any embedding."""
    assert reference([images["448x448"]]).ids != reference([images["other"]]).ids


def test_token_counts_before_encoding_are_the_encoders(workers, tmp_path) -> None:
    """The model's own resize rule, which the worker applies to the header, gives the token
    count SGLang's encoder makes (kept, enlarged, shrunk, extreme sizes): the worker answers
    500 when they differ, and the prompt grows by the count foreseen."""
    from embedding_side.sglang_encoder import _resize_rule

    _, language = workers
    resize = _resize_rule("minimax_m3_vl", 28, 1, 1 << 40, None)
    prompt_tokens = {}
    for width, height in [(448, 448), (392, 280), (640, 336), (33, 33), (57, 1000), (1920, 1080), (4000, 100)]:
        path = str(tmp_path / f"{width}x{height}.png")
        make_image(width, height, seed=1).save(path)
        body = {"text": prompt(1), "image_data": [path], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        answer = requests.post(f"{language.url}/generate", json=body, timeout=300)
        assert answer.status_code == 200, (width, height, answer.text)
        h, w = resize(height, width)
        prompt_tokens[(width, height)] = answer.json()["meta_info"]["prompt_tokens"] - h * w // (28 * 28)
    assert len(set(prompt_tokens.values())) == 1, prompt_tokens  # the same text around each image
