"""The reference every equality check compares with (tests and the main job): transformers' own
Qwen2.5-VL generate, from the pixels, in one process, on the same checkpoint folder."""

from __future__ import annotations

import torch

from language_side.prompt import build_prompt

NEW_TOKENS = 24


def reference_tokens(model, encoder, tokenizer, text: str, images, max_new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' own generate, from pixels, in one process."""
    kwargs = {}
    grids = []
    if images:
        inputs = encoder.processor(images=images, return_tensors="pt")
        kwargs = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    prompt = build_prompt(tokenizer, text, grids, max_length=1 << 20)
    ids = torch.from_numpy(prompt.input_ids)[None]
    mm_types = torch.from_numpy(prompt.image_mask.astype("int64"))[None]
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm_types,
                             max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    return out[0, ids.shape[1]:].tolist()
