"""A numpy stand-in for SGLang's encoder (a test double): Qwen2.5-VL's geometry and token counts,
rows in microseconds, no torch. Tests that need many encode workers or many requests fast use it
beside the same behaviour tested on SGLang's encoder.

``python tests/fake_encoder.py --disaggregation-mode encode ...`` is SGLang's launcher with the
encode worker's encoder replaced by this one (how :class:`workers.WorkerProcess` starts it with
``fake_encoder=True``); :class:`workers.InProcessWorker` takes one as ``encoder``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project, as `python -m` has it

from embedding_side.encoders import EncodedImages, check_shape, grid_for, settings_fingerprint  # noqa: E402
from embedding_side.positions import IMAGE_PAD_ID  # noqa: E402

PATCH, MERGE = 14, 2
FACTOR = PATCH * MERGE  # 28 pixels per merged token side
# The Qwen2.5-VL hub preprocessor_config: 4 to 16384 merged tokens per image.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 16384 * FACTOR * FACTOR


def to_bf16_bytes(values: np.ndarray) -> np.ndarray:
    """float32 [n, hidden] -> bf16 bytes [n, hidden * 2], round to nearest even."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(np.uint8).reshape(values.shape[0], -1)


class FakeEncoder:
    """Deterministic numpy encoder: each merged token is the mean colour of its 28x28 cell plus its
    normalised position, projected by a fixed seeded matrix (content-dependent, bit-reproducible).
    Images are resized by transformers' ``smart_resize`` with the Qwen2.5-VL hub settings."""

    name = "fake"
    patch_size, merge_size, image_token_id, max_batch = PATCH, MERGE, IMAGE_PAD_ID, 1
    modalities = ("image",)

    def __init__(self, hidden_size: int = 3584, seed: int = 0) -> None:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        self.hidden_size, self.seed, self._smart_resize = hidden_size, seed, smart_resize
        self._proj = np.random.default_rng(seed).standard_normal((6, hidden_size)).astype(np.float32)

    def fingerprint(self) -> str:
        return settings_fingerprint({"encoder": self.name, "hidden": self.hidden_size, "seed": self.seed,
                                     "grid": [PATCH, MERGE, MIN_PIXELS, MAX_PIXELS]})

    def resize(self, height: int, width: int) -> tuple[int, int]:
        check_shape(height, width)  # the refusal SGLang's encoder gives a client
        return self._smart_resize(height, width, factor=FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)

    def offload(self, level: int) -> None:
        pass  # no weights beyond the fixed projection

    def reload(self) -> None:
        pass

    def encode(self, images: list[Image.Image]) -> EncodedImages:
        grids, parts = [], []
        for image in images:
            grid = grid_for(image, self.resize, PATCH)
            gh, gw = grid[1] // MERGE, grid[2] // MERGE
            cells = np.asarray(image.resize((gw, gh), Image.Resampling.BOX), np.float32).reshape(-1, 3) / 255.0
            ys, xs = np.divmod(np.arange(gh * gw, dtype=np.float32), gw)
            features = np.column_stack([cells, ys / gh, xs / gw, np.ones(gh * gw, np.float32)])
            parts.append(features @ self._proj)
            grids.append(grid)
        return EncodedImages(to_bf16_bytes(np.concatenate(parts)), grids, self.hidden_size)


def install() -> None:
    """Every encode worker this process builds from here on runs the fake (a worker forked by the
    tests' zygote calls this before SGLang's launcher runs)."""
    from sglang_ext import launch_server

    launch_server.make_encoder = lambda args, config: FakeEncoder(config.hidden_size)


if __name__ == "__main__":
    install()
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
