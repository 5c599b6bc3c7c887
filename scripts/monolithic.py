"""The reference every equality check compares with (tests and the main job): transformers' own
Qwen2.5-VL generate, from the pixels, in one process, on the same checkpoint folder.

Where our stack runs other code than transformers' for the same math (SGLang's vision tower and
language model), bf16 values differ from the reference's in the last bit here and there; greedy
ids then agree except where the reference itself had two tokens within a bit of each other.
:func:`greedy_mismatch` is that comparison: the ids must be equal, or equal up to one step whose
token the reference scored within :data:`NEAR_TIE_NATS` of its own choice (after which the two
continue from different prefixes, so nothing later is compared). Where the code is the same (our
own connector moving transformers' embedding), tests compare the ids exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from language_side.layout import image_token_count

NEW_TOKENS = 24
IMAGE_PAD = "<|image_pad|>"


def reference_tokens(model, encoder, tokenizer, text: str, images, max_new_tokens: int = NEW_TOKENS) -> list[int]:
    """transformers' own generate, from pixels, in one process."""
    return greedy_generate(model, reference_inputs(encoder, tokenizer, text, images), max_new_tokens).ids


def reference_inputs(encoder, tokenizer, text: str, images) -> dict:
    """What transformers' Qwen2.5-VL ``generate`` takes for ``text`` with ``images``: the prompt
    with each image's placeholder expanded, and the pixels as its image processor makes them."""
    kwargs = {}
    grids = []
    if images:
        inputs = encoder.processor(images=images, return_tensors="pt")
        kwargs = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    ids = torch.tensor([expand_image_pads(tokenizer, text, grids)])
    mm_types = (ids == tokenizer.convert_tokens_to_ids(IMAGE_PAD)).long()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": mm_types, **kwargs}


def expand_image_pads(tokenizer, text: str, grids: list[tuple[int, int, int]]) -> list[int]:
    """``text``'s ids with each image's one ``<|image_pad|>`` repeated once per embedding row."""
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokens.count(pad) != len(grids):
        raise ValueError(f"the prompt has {tokens.count(pad)} image placeholders for {len(grids)} images")
    rows = iter(image_token_count(g) for g in grids)
    return [t for token in tokens for t in ([pad] * next(rows) if token == pad else [token])]


def sampled_frames(path: str) -> tuple[np.ndarray, dict]:
    """The frames of the video at ``path`` that SGLang's encoder samples (``smart_nframes`` at its
    default rate, evenly spaced indices), decoded with the library it decodes with here (decord),
    and their metadata as transformers' video processors take it (with ``do_sample_frames=False``).
    The frames are not resized: callers use sizes that SGLang's first resize keeps (multiples of
    28 within its pixel bounds); transformers' processor then resizes as it would anyway."""
    import decord
    from sglang.srt.multimodal.processors.qwen_vl import smart_nframes

    reader = decord.VideoReader(path)
    total, fps = len(reader), reader.get_avg_fps()
    count = smart_nframes({}, total_frames=total, video_fps=fps)
    indices = np.unique(np.linspace(0, total - 1, num=count, dtype=np.int64)).tolist()
    return reader.get_batch(indices).asnumpy(), {"fps": fps, "frames_indices": indices, "total_num_frames": total}


# Two steps of bf16 at the logits' magnitude here (8 to 32: a step of 0.0625 to 0.125)
NEAR_TIE_NATS = 0.25


@dataclass
class Greedy:
    """The reference's greedy ids and, per step, its log-probabilities over the vocabulary."""

    ids: list[int]
    logprobs: torch.Tensor  # [steps, vocab], float32


def greedy_generate(model, inputs: dict, max_new_tokens: int) -> Greedy:
    """``model.generate`` (greedy) on processor ``inputs``, with the scores of each step."""
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    prompt_length = inputs["input_ids"].shape[1]
    logprobs = torch.stack([torch.log_softmax(step[0].float(), -1) for step in out.scores])
    return Greedy(out.sequences[0, prompt_length:].tolist(), logprobs)


def greedy_mismatch(got: list[int], reference: Greedy, tolerance: float = NEAR_TIE_NATS) -> str | None:
    """None when ``got`` is the reference's greedy output as the module docstring defines it, else
    what differs. Lengths are compared only where every step agreed: after a near tie the two
    continue from different prefixes, and one may reach the end-of-sequence token sooner."""
    for step, (ours, theirs) in enumerate(zip(got, reference.ids, strict=False)):
        if ours != theirs:
            gap = float(reference.logprobs[step, theirs] - reference.logprobs[step, ours])
            if gap > tolerance:
                return (f"step {step}: {ours} where the reference chose {theirs}, {gap:.3f} nats below it "
                        f"(a near tie is at most {tolerance}): {got} vs {reference.ids}")
            return None
    if len(got) != len(reference.ids):
        return f"{len(got)} ids, the reference has {len(reference.ids)}: {got} vs {reference.ids}"
    return None
