"""How many embedding rows a media item takes, and the image grids read back from the M-RoPE
positions that come with an embedding over the reference fork's wire."""

from __future__ import annotations

import numpy as np

MERGE = 2  # 2x2 patches per embedding row (Qwen-VL's spatial merge)


class LayoutError(ValueError):
    """Rows, grids or positions that do not describe the media they came for; maps to HTTP 400
    when the client's input caused it, else it is the encoder's fault."""


def image_token_count(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * (h // MERGE) * (w // MERGE)


def grids_from_positions(mrope: np.ndarray) -> list[tuple[int, int, int]]:
    """Each image's ``(t, h, w)`` patch grid, read from the M-RoPE positions that came with the
    embedding (the reference fork's wire carries them: no extension needed). The encoder lays
    its images out alone in a row: image one's pads start at 1 (after its ``<|vision_start|>``),
    each next one 3 past the last position of the one before (its ``<|vision_end|>``, the next
    ``<|vision_start|>``). Anything else is a :class:`LayoutError`: the language side must not
    place images it cannot check."""
    if mrope.ndim != 2 or mrope.shape[0] != 3 or mrope.shape[1] == 0:
        raise LayoutError(f"image positions must be [3, n>0], got {list(mrope.shape)}")
    # A still image has one frame: its t axis is constant, and jumps at the next image.
    starts = np.flatnonzero(np.diff(mrope[0]) != 0) + 1
    grids, expected_base = [], 1
    for rows in np.split(mrope.astype(np.int64), starts, axis=1):
        base = int(rows[0, 0])
        gh, gw = int(rows[1].max()) - base + 1, int(rows[2].max()) - base + 1
        hi, wi = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        layout = np.stack([np.zeros(gh * gw, np.int64), hi.ravel(), wi.ravel()]) + base
        if base != expected_base or rows.shape != layout.shape or not np.array_equal(rows, layout):
            raise LayoutError(f"the received positions of image {len(grids) + 1} are not the layout of any image "
                              f"grid (first position {base}, expected {expected_base})")
        grids.append((1, gh * MERGE, gw * MERGE))
        expected_base = int(rows.max()) + 3
    return grids
