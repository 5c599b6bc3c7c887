"""The seeded checkpoint folder (scripts/make_checkpoint.py) that stands in for real Qwen2.5-VL
weights on both workers: transformers loads it whole, its offline tokenizer round-trips, and the
encode worker's tower, loaded from it, encodes exactly as the monolithic model's tower does (with the
same arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from make_checkpoint import SPECIAL_TOKENS
from transfer_large_image import make_image
from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from embedding_side.encoders import QwenVisionEncoder
from sglang_ext.cpu_gemm import use_float32_products

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


def test_the_encode_workers_tower_matches_the_monolithic_models(checkpoint) -> None:
    """Byte for byte with the same arithmetic: on a CPU without bf16 arithmetic our tower computes
    its products on float32 copies (``sglang_ext/cpu_gemm.py``), and so does the monolithic
    model's tower for this comparison; on PyTorch's own bf16 kernels it is a few bf16 steps off."""
    folder, hidden = checkpoint
    encoder = QwenVisionEncoder(folder)
    images = [make_image(448, 448, seed=1), make_image(1000, 300, seed=2)]
    ours = encoder.encode(images)
    full = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    inputs = encoder.processor(images=images, return_tensors="pt")

    def monolithic_rows() -> torch.Tensor:
        with torch.inference_mode():
            features = full.model.get_image_features(inputs["pixel_values"].to(torch.bfloat16),
                                                     image_grid_thw=inputs["image_grid_thw"])
        features = getattr(features, "pooler_output", features)
        return (torch.cat(list(features)) if isinstance(features, (tuple, list)) else features).contiguous()

    on_bf16_kernels = monolithic_rows()
    use_float32_products(full.model.visual)
    reference = monolithic_rows()
    assert ours.embeddings.shape == (reference.shape[0], hidden * 2)
    assert np.array_equal(ours.embeddings, reference.view(torch.uint8).numpy())
    rows = torch.from_numpy(ours.embeddings).view(torch.bfloat16).float()
    assert (rows - on_bf16_kernels.float()).abs().max() <= 4 * 2.0 ** -7 * on_bf16_kernels.float().abs().max()
