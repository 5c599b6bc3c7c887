"""Token ids and M-RoPE positions of image tokens, laid out as Qwen2.5-VL does.

Each image sits in the prompt as ``<|vision_start|> <|image_pad|> x n <|vision_end|>``; its
pads get 3-D positions ``(t, h, w)`` on the merged grid, offset by the position after the
preceding token. The delta is ``max position + 1 - sequence length`` (aux[1]). Audio tokens
are a sequence: the same position on all three axes, one after another.
"""

from __future__ import annotations

import numpy as np

IMAGE_PAD_ID = 151655  # Qwen2.5-VL's <|image_pad|> in its hub tokenizer
MERGE = 2


def image_positions(grids: list[tuple[int, int, int]], merge: int = MERGE,
                    pad_id: int = IMAGE_PAD_ID) -> tuple[np.ndarray, np.ndarray, int]:
    """``(fill_ids [n], mrope [3, n], delta)`` for the pads of ``grids`` in order (``merge``:
    patches per token side; ``pad_id``: the checkpoint's image placeholder id)."""
    parts, next_pos, seq_len = [], 0, 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        start = next_pos + 1  # after <|vision_start|>
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pos = np.stack([ti.ravel(), hi.ravel(), wi.ravel()]).astype(np.int32) + start
        parts.append(pos)
        next_pos = int(pos.max()) + 2  # past the last pad and <|vision_end|>
        seq_len += pos.shape[1] + 2
    mrope = np.concatenate(parts, axis=1)
    fill_ids = np.full(mrope.shape[1], pad_id, np.int32)
    return fill_ids, mrope, next_pos - seq_len


def sequence_positions(tokens: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(fill_ids, mrope, delta)`` of ``tokens`` placeholders in a row (audio): positions 1 to
    ``tokens`` after the start token, the same on every axis, so the delta is 0."""
    mrope = np.tile(np.arange(1, tokens + 1, dtype=np.int32), (3, 1))
    return np.full(tokens, pad_id, np.int32), mrope, 0
