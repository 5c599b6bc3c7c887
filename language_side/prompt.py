"""Prompts for the language model: token ids with each image's pads expanded, and the M-RoPE
positions of the whole sequence, laid out as Qwen2.5-VL does.

A prompt is raw text, or chat messages rendered with the tokenizer's chat template; either way
each image appears once as ``<|vision_start|><|image_pad|><|vision_end|>``. Here that single pad
becomes ``t * h * w / 4`` pads (the image's merged patch grid). Positions, three axes per token:
a text token advances all three by one from the previous maximum; an image's pads take
``(t, h, w)`` offsets on the merged grid after the position of its ``<|vision_start|>``; decoding
continues from ``max position + 1`` (``delta = max + 1 - length`` is what the model adds to the
cache length for each new token). Vectorised per segment: no loop over tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MERGE = 2  # 2x2 patches per embedding token
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class PromptError(ValueError):
    """A prompt that cannot be built (placeholder count, grid, length); maps to HTTP 400."""


@dataclass(frozen=True)
class SpecialIds:
    image_pad: int
    vision_start: int
    vision_end: int

    @classmethod
    def of(cls, tokenizer) -> SpecialIds:
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}
        if None in ids.values() or tokenizer.unk_token_id in ids.values():
            raise ValueError(f"the tokenizer lacks Qwen's vision tokens: {ids}")
        return cls(ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"])


@dataclass(frozen=True)
class Prompt:
    input_ids: np.ndarray  # int64 [seq]
    positions: np.ndarray  # int64 [3, seq]
    image_mask: np.ndarray  # bool [seq]: rows that take the image embedding, in image order
    delta: int  # max position + 1 - seq: decoding position = cache length + delta

    @property
    def image_tokens(self) -> int:
        return int(self.image_mask.sum())


def image_token_count(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * (h // MERGE) * (w // MERGE)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """Chat messages -> prompt text (the template puts one placeholder per image part)."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def build_prompt(tokenizer, text: str, grids: list[tuple[int, int, int]], max_length: int) -> Prompt:
    """Tokenise ``text`` (one placeholder per image, in order) and lay the images out."""
    ids = SpecialIds.of(tokenizer)
    tokens = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)
    if not len(tokens):
        raise PromptError("the prompt is empty")
    pads = np.flatnonzero(tokens == ids.image_pad)
    if len(pads) != len(grids):
        raise PromptError(f"the prompt has {len(pads)} image placeholders for {len(grids)} images")
    for pad in pads:
        if not (0 < pad < len(tokens) - 1 and tokens[pad - 1] == ids.vision_start and tokens[pad + 1] == ids.vision_end):
            raise PromptError(f"an image placeholder must be {IMAGE_PLACEHOLDER} (pad at token {int(pad)})")
    for grid in grids:
        t, h, w = grid
        if min(t, h, w) <= 0 or h % MERGE or w % MERGE:
            raise PromptError(f"image grid {grid} is not a positive (t, h, w) with h and w even")
    counts = [image_token_count(g) for g in grids]
    length = len(tokens) - len(pads) + sum(counts)
    if length > max_length:
        raise PromptError(f"the prompt is {length} tokens ({sum(counts)} of them image tokens); the model "
                          f"takes at most {max_length}")
    text_only = np.delete(tokens, pads)
    at = pads - np.arange(len(pads))  # where each image goes in the text without its pad
    input_ids = np.insert(text_only, np.repeat(at, counts), ids.image_pad)
    first_rows = at + np.cumsum([0, *counts[:-1]]).astype(np.int64)  # each image's first row
    positions = np.empty((3, length), np.int64)
    image_mask = input_ids == ids.image_pad
    start, next_pos = 0, 0  # the next row to fill, the next free position
    for pad, count, (t, h, w) in zip(first_rows, counts, grids, strict=True):
        n_text = pad - start  # text before the image (its <|vision_start|> included)
        positions[:, start:pad] = np.arange(next_pos, next_pos + n_text)
        base = next_pos + n_text
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(h // MERGE), np.arange(w // MERGE), indexing="ij")
        positions[:, pad:pad + count] = np.stack([ti.ravel(), hi.ravel(), wi.ravel()]) + base
        next_pos = int(positions[:, pad:pad + count].max()) + 1
        start = pad + count
    positions[:, start:] = np.arange(next_pos, next_pos + length - start)
    delta = int(positions.max()) + 1 - length
    return Prompt(input_ids, positions, image_mask, delta)


def grids_from_positions(mrope: np.ndarray) -> list[tuple[int, int, int]]:
    """Each image's ``(t, h, w)`` patch grid, read from the M-RoPE positions that came with the
    embedding (the reference fork's wire carries them: no extension needed). The encoder lays
    its images out alone in a row: image one's pads start at 1 (after its ``<|vision_start|>``),
    each next one 3 past the last position of the one before (its ``<|vision_end|>``, the next
    ``<|vision_start|>``). Anything
    else is a :class:`PromptError`: the language side must not place images it cannot check."""
    if mrope.ndim != 2 or mrope.shape[0] != 3 or mrope.shape[1] == 0:
        raise PromptError(f"image positions must be [3, n>0], got {list(mrope.shape)}")
    # A still image has one frame: its t axis is constant, and jumps at the next image.
    starts = np.flatnonzero(np.diff(mrope[0]) != 0) + 1
    grids, expected_base = [], 1
    for rows in np.split(mrope.astype(np.int64), starts, axis=1):
        base = int(rows[0, 0])
        gh, gw = int(rows[1].max()) - base + 1, int(rows[2].max()) - base + 1
        hi, wi = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        layout = np.stack([np.zeros(gh * gw, np.int64), hi.ravel(), wi.ravel()]) + base
        if base != expected_base or rows.shape != layout.shape or not np.array_equal(rows, layout):
            raise PromptError(f"the received positions of image {len(grids) + 1} are not the layout of any image "
                              f"grid (first position {base}, expected {expected_base})")
        grids.append((1, gh * MERGE, gw * MERGE))
        expected_base = int(rows.max()) + 3
    return grids
