"""The seeded checkpoint folder (scripts/make_checkpoint.py) that stands in for real Qwen2.5-VL
weights on both workers: transformers loads it whole, and its offline tokenizer round-trips. (Its
tower's rows through SGLang's encoder: tests/test_sglang_encoder_rows.py.)"""

from __future__ import annotations

import pytest
import torch
from checkpoint_text import SPECIAL_TOKENS
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module", params=[3584, 2048], ids=["7B-width", "3B-width"])
def checkpoint(request, seeded_checkpoint) -> tuple[str, int]:
    return seeded_checkpoint(request.param), request.param


def test_transformers_loads_the_whole_model_in_its_dtype(checkpoint) -> None:
    folder, hidden = checkpoint
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder)
    assert model.dtype == torch.bfloat16
    assert model.config.text_config.hidden_size == model.config.vision_config.out_hidden_size == hidden
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    assert model.config.text_config.eos_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(tokenizer) <= model.config.text_config.vocab_size


def test_the_offline_tokenizer_round_trips_text_and_keeps_special_tokens_whole(checkpoint) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint[0])
    text = "héllo wörld, 你好 🙂\n\ttabs"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text.encode()) and max(ids) < 256  # one token per byte
    assert tokenizer.decode(ids) == text
    for token in SPECIAL_TOKENS:
        assert tokenizer(f"a{token}b")["input_ids"][1] >= 256
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."},
                                             {"type": "image"}]}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|vision_start|><|image_pad|>"
        "<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
