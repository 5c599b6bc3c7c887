"""SGLang's encoder as the encode worker runs it (our CPU hooks on: vision attention without a
mask, bf16 products on float32 copies where the CPU has no bf16 arithmetic) against the same
encoder with no plugin of ours (``SGLANG_PLUGINS=none``, as upstream runs it), on the seeded
Qwen2.5-VL checkpoint: the same rows in the same order, each element within one bf16 step of the
largest value of its row. The hooks round differently (one accumulation order, one rounding of a
product instead of two), so about a quarter of the elements differ, by that one step; nothing
else does. And SGLang's vision rotary run eagerly (``TORCH_COMPILE_DISABLE=1``, as the rest of the
suite runs it) gives the compiled rows users get, bit for bit."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from monolithic import rows_mismatch
from PIL import Image
from sglang_stack import encoded_rows
from transfer_large_image import make_image

pytestmark = [pytest.mark.sglang, pytest.mark.usefixtures("compiled_torch")]


def images(root: Path) -> list[str]:
    """A smooth test picture at two sizes and two pictures of uniform noise (where the greedy ids of
    a checkpoint without clear leads followed the rounding)."""
    paths = []
    for name, picture in [("448x448", make_image(448, 448, seed=40)), ("1280x720", make_image(1280, 720, seed=41))]:
        picture.save(root / f"{name}.png")
        paths.append(str(root / f"{name}.png"))
    noise = np.random.default_rng(99)
    for i in range(2):
        Image.fromarray(noise.integers(0, 255, (448, 448, 3)).astype(np.uint8)).save(root / f"noise{i}.png")
        paths.append(str(root / f"noise{i}.png"))
    return paths


def test_rows_are_upstreams_within_one_bf16_step_and_eager_rows_the_compiled_ones(seeded_checkpoint, tmp_path) -> None:
    folder = seeded_checkpoint(3584)
    paths = images(tmp_path)
    make_image(3840, 2160, seed=42).save(tmp_path / "3840x2160.png")  # upstream's masked attention: 7 GB at 4K
    ours_paths = [*paths, str(tmp_path / "3840x2160.png")]
    runs = {"ours": (ours_paths, {}), "upstream": (paths, {"plugins": False}),
            "ours eager": (ours_paths, {"extra": {"TORCH_COMPILE_DISABLE": "1"}})}
    with ThreadPoolExecutor(3) as pool:  # at once: the fresh interpreter spends most of its time importing SGLang
        ours, upstream, eager = pool.map(lambda run: encoded_rows(folder, runs[run][0], tmp_path / f"{run}.safetensors",
                                                                  **runs[run][1]), runs)
    for path in ours_paths:
        assert torch.equal(eager[path], ours[path]), path
    differing = []
    for path in paths:
        got, expected = ours[path].view(torch.bfloat16), upstream[path].view(torch.bfloat16)
        assert got.shape == expected.shape, path
        got, expected = got.view(-1, 3584).float(), expected.view(-1, 3584).float()
        assert rows_mismatch(got, expected) is None, path
        differing.append(float((got != expected).float().mean()))
    # the hooks are on in ours (a test of nothing otherwise): some elements do round the other way. An
    # element does when a rounding boundary lies between the two sides' unrounded values (a chance of
    # their distance in steps): with those under half a step apart (a rounding, not another
    # computation), fewer than half of the elements do.
    assert 0.0 < min(differing) and max(differing) < 0.5, differing
