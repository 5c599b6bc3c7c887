"""Prompt building on the language side: placeholders expanded to each image's tokens, and
M-RoPE positions equal to transformers' own ``get_rope_index`` on the same checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from embedding_side.positions import image_positions
from language_side.prompt import IMAGE_PLACEHOLDER, PromptError, build_prompt, grids_from_positions, render_chat

pytestmark = pytest.mark.fast

P = IMAGE_PLACEHOLDER


@pytest.fixture(scope="module")
def model_and_tokenizer(seeded_checkpoint):
    folder = seeded_checkpoint(2048)
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("text, grids", [
    ("just text, no image", []),
    (f"{P}What is this?", [(1, 154, 274)]),  # a 3840x2160 image: 10,549 tokens
    (f"<|im_start|>user\n{P}one{P}two and more text{P}{P}<|im_end|>", [(1, 16, 16), (1, 4, 6), (1, 2, 2), (1, 30, 8)]),
    (f"{P}", [(1, 2, 2)]),
])
def test_positions_match_transformers_get_rope_index(model_and_tokenizer, text, grids) -> None:
    model, tokenizer = model_and_tokenizer
    prompt = build_prompt(tokenizer, text, grids, max_length=32768)
    assert prompt.image_tokens == sum(t * h * w // 4 for t, h, w in grids)
    assert prompt.input_ids[prompt.image_mask].tolist() == [model.config.image_token_id] * prompt.image_tokens
    ids = torch.from_numpy(prompt.input_ids)[None]
    kwargs = {"image_grid_thw": torch.tensor(grids)} if grids else {}
    positions, deltas = model.model.get_rope_index(ids, mm_token_type_ids=torch.from_numpy(
        prompt.image_mask.astype(np.int64))[None], **kwargs)
    assert np.array_equal(prompt.positions, positions[:, 0].numpy())
    assert prompt.delta == int(deltas[0, 0])


def test_chat_messages_render_one_placeholder_per_image(model_and_tokenizer) -> None:
    _, tokenizer = model_and_tokenizer
    text = render_chat(tokenizer, [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}])
    prompt = build_prompt(tokenizer, text, [(1, 4, 4), (1, 2, 6)], max_length=1000)
    assert prompt.image_tokens == 4 + 3
    assert tokenizer.decode(prompt.input_ids).count("<|image_pad|>") == 7


@pytest.mark.parametrize("text, grids, words", [
    (f"{P}{P}", [(1, 2, 2)], "2 image placeholders for 1 images"),
    ("no image", [(1, 2, 2)], "0 image placeholders for 1 images"),
    ("<|image_pad|> alone", [(1, 2, 2)], "must be <|vision_start|><|image_pad|><|vision_end|>"),
    (f"{P}", [(1, 3, 2)], "is not a positive (t, h, w) with h and w even"),
    (f"{P}" + "x" * 60, [(1, 20, 20)], "the prompt is 162 tokens (100 of them image tokens); the model takes at most 100"),
])
def test_bad_prompts_are_refused_with_a_reason(model_and_tokenizer, text, grids, words) -> None:
    with pytest.raises(PromptError) as err:
        build_prompt(model_and_tokenizer[1], text, grids, max_length=100)
    assert words in str(err.value)


@pytest.mark.parametrize("grids", [[(1, 154, 274)], [(1, 16, 16), (1, 4, 6), (1, 2, 2), (1, 30, 8)], [(1, 2, 2)]])
def test_image_grids_come_back_from_the_positions_on_the_wire(grids) -> None:
    _, mrope, _ = image_positions(grids)  # what the encode side sends
    assert grids_from_positions(mrope) == grids


def test_positions_that_fit_no_image_grid_are_refused() -> None:
    _, mrope, _ = image_positions([(1, 4, 6), (1, 2, 2)])
    shifted = mrope.copy()
    shifted[:, 6:] += 1  # the second image one position too far
    swapped = mrope.copy()
    swapped[[1, 2], :6] = swapped[[2, 1], :6]  # h and w exchanged: a 3x2 grid read as 2x3
    for bad in (shifted, swapped, mrope[:, 1:]):
        with pytest.raises(PromptError, match="not the layout of any image grid"):
            grids_from_positions(bad)
    with pytest.raises(PromptError, match=r"must be \[3, n>0\]"):
        grids_from_positions(mrope[:2])
