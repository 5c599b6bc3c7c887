"""Every equality check with transformers' reference can fail: on the seeded checkpoints, a wrong
embedding fed to transformers' own language model (another image, another clip, another video, an
image's rows under another grid, one image of two replaced by a part of another request) gives ids
that ``monolithic.greedy_mismatch`` rejects, at a step it names. Two rows swapped or every row
shifted by one move a greedy lead less than bf16 rounding does on a checkpoint whose steps are
decided far above that rounding, so ids cannot tell them: the row comparison
(``tests/test_sglang_encoder_rows.py``: each element within one bf16 step of its row's largest
value) is the check that catches those, and it does here, at the row it names.

In-process, on the checkpoints and media ``tests/test_checkpoint_margins.py`` measures.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from image_cache import saved_image
from monolithic import Greedy, greedy_generate, greedy_mismatch, reference_inputs, rows_mismatch
from sglang_stack import NEW_TOKENS, prompt, write_audio_clips

pytestmark = pytest.mark.fast


def caught_at(why: str | None) -> int:
    """The step ``greedy_mismatch`` names (it must name one)."""
    assert why is not None, "the comparison passed a wrong embedding"
    found = re.match(r"step (\d+): ", why)
    assert found, why
    return int(found.group(1))


def with_rows(model, inputs: dict, replace: Callable[[list[torch.Tensor]], list[torch.Tensor]],
              modality: str = "image") -> dict:
    """``inputs`` with the tower's rows of each medium computed up front and made by ``replace``
    from the true ones (transformers' generate takes a model's encoder outputs in place of pixels)."""
    pixels = "pixel_values" if modality == "image" else "pixel_values_videos"
    grid = f"{modality}_grid_thw"
    encode = getattr(model.model, f"get_{modality}_features")
    with torch.no_grad():
        encoded = encode(inputs[pixels], inputs[grid], return_dict=True)
    encoded.pooler_output = tuple(replace(list(encoded.pooler_output)))
    return {key: value for key, value in inputs.items() if key != pixels} | {"mm_encoder_outputs": {modality: encoded}}


def another_grid(grid: torch.Tensor) -> torch.Tensor:
    """A grid with as many patches (so as many rows) laid out otherwise: half the rows, twice as wide."""
    (frames, height, width), = grid.tolist()
    assert height % 4 == 0, grid
    return torch.tensor([[frames, height // 2, width * 2]])


def swapped(rows: torch.Tensor, first: int, second: int) -> torch.Tensor:
    out = rows.clone()
    out[[first, second]] = rows[[second, first]]
    return out


def shifted(rows: torch.Tensor) -> torch.Tensor:
    """Every row one place later, the first repeated (a transfer off by one row)."""
    return torch.cat([rows[:1], rows[:-1]])


def assert_rows_caught(rows: torch.Tensor) -> None:
    """The row comparison names the first wrong row of two rows swapped and of a shift by one."""
    assert rows_mismatch(rows, rows) is None
    assert rows_mismatch(swapped(rows, 3, 7), rows).startswith("row 3: ")
    assert rows_mismatch(shifted(rows), rows).startswith("row 1: ")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    """The tests' 448x448 (seed 40) and 640x336 pictures, and another 448x448 (seed 41)."""
    root = tmp_path_factory.mktemp("catch-images")
    sizes = {"448x448": (448, 448, 40), "another 448x448": (448, 448, 41), "other": (640, 336, 60)}
    return {name: saved_image(root / f"{name}.png", w, h, seed=seed) for name, (w, h, seed) in sizes.items()}


def test_qwen2_5_vl_comparison_catches_wrong_embeddings(seeded_checkpoint, images) -> None:
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    folder = seeded_checkpoint(256, layers=2)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    processor, tokenizer = AutoProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)

    def inputs(names: list[str]) -> dict:
        pictures = [Image.open(images[name]).convert("RGB") for name in names]
        return reference_inputs(processor.image_processor, tokenizer, prompt(len(names)), pictures)

    def greedy(batch: dict) -> Greedy:
        return greedy_generate(model, batch, NEW_TOKENS)

    one, two = inputs(["448x448"]), inputs(["other", "448x448"])
    reference, reference_two = greedy(one), greedy(two)
    another = greedy(inputs(["another 448x448"]))
    steps = {"another image": caught_at(greedy_mismatch(another.ids, reference))}

    wrong_grid = dict(one, image_grid_thw=another_grid(one["image_grid_thw"]))
    steps["another grid"] = caught_at(greedy_mismatch(greedy(wrong_grid).ids, reference))

    assert greedy(with_rows(model, two, lambda rows: rows)).ids == reference_two.ids  # the path itself is faithful
    another_rows = with_rows(model, inputs(["another 448x448"]), lambda rows: rows)["mm_encoder_outputs"]
    part = with_rows(model, two, lambda rows: [rows[0], another_rows["image"].pooler_output[0]])
    steps["a part from another request"] = caught_at(greedy_mismatch(greedy(part).ids, reference_two))

    true_rows = with_rows(model, one, lambda rows: rows)["mm_encoder_outputs"]["image"].pooler_output[0]
    assert_rows_caught(true_rows)
    print(f"caught at steps {steps}")


@pytest.fixture(scope="module")
def clip_frames() -> dict[str, tuple]:
    """Two 8-frame videos of 392x280 (decoded frames and their metadata, as SGLang samples them of
    the tests' first clip): moving stripes with noise, and the same stripes with other noise."""
    import numpy as np

    y, x = np.mgrid[0:280, 0:392]
    clips = {}
    for name, seed in (("video", 0), ("another video", 1)):
        rng = np.random.default_rng(seed)
        stripes = np.sin(x / 17.0) * 80 + np.cos(y / 13.0) * 40 + 128
        frames = np.stack([np.roll(stripes, 4 * i, axis=1)[..., None] + rng.normal(0, 30, (280, 392, 3))
                           for i in range(8)]).clip(0, 255).astype(np.uint8)
        clips[name] = (frames, {"fps": 2.0, "frames_indices": list(range(8)), "total_num_frames": 8})
    return clips


def test_qwen3_vl_comparison_catches_wrong_embeddings(tmp_path_factory, images, clip_frames) -> None:
    from make_checkpoint import write_qwen3_vl_checkpoint
    from PIL import Image
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    folder = write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("catch-qwen3-vl"))
    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()

    def inputs(names: list[str], videos: list[str] = ()) -> dict:
        pictures = [Image.open(images[name]).convert("RGB") for name in names] or None
        clips = {"videos": [clip_frames[v][0] for v in videos], "video_metadata": [clip_frames[v][1] for v in videos],
                 "do_sample_frames": False} if videos else {}
        return dict(processor(text=[prompt(len(names), len(videos))], images=pictures, return_tensors="pt", **clips))

    def greedy(batch: dict) -> Greedy:
        return greedy_generate(model, batch, NEW_TOKENS)

    one, two, video = inputs(["448x448"]), inputs(["other", "448x448"]), inputs([], ["video"])
    reference, reference_two, reference_video = greedy(one), greedy(two), greedy(video)
    steps = {"another image": caught_at(greedy_mismatch(greedy(inputs(["another 448x448"])).ids, reference)),
             "another grid": caught_at(greedy_mismatch(
                 greedy(dict(one, image_grid_thw=another_grid(one["image_grid_thw"]))).ids, reference)),
             "another video": caught_at(greedy_mismatch(greedy(inputs([], ["another video"])).ids, reference_video))}
    assert greedy(with_rows(model, two, lambda rows: rows)).ids == reference_two.ids
    another_rows = with_rows(model, inputs(["another 448x448"]), lambda rows: rows)["mm_encoder_outputs"]["image"]
    part = with_rows(model, two, lambda rows: [rows[0], another_rows.pooler_output[0]])
    steps["a part from another request"] = caught_at(greedy_mismatch(greedy(part).ids, reference_two))
    video_rows = with_rows(model, video, lambda rows: rows, "video")["mm_encoder_outputs"]["video"].pooler_output[0]
    assert_rows_caught(video_rows)
    print(f"caught at steps {steps}")


def test_minimax_m3_vl_comparison_catches_wrong_embeddings(tmp_path_factory, images) -> None:
    """No wrong grid: MiniMax's language model numbers its positions 1-D, so the grid matters only
    to the tower, on the encode side."""
    from checkpoint_minimax import write_minimax_m3_vl_checkpoint
    from PIL import Image
    from test_sglang_minimax import prompt as minimax_prompt
    from transformers import AutoProcessor, MiniMaxM3SparseForConditionalGeneration

    folder = write_minimax_m3_vl_checkpoint(tmp_path_factory.mktemp("catch-minimax"))
    processor = AutoProcessor.from_pretrained(folder)
    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()

    def inputs(names: list[str]) -> dict:
        pictures = [Image.open(images[name]).convert("RGB") for name in names]
        return dict(processor(text=[minimax_prompt(len(names))], images=pictures, return_tensors="pt"))

    def greedy(batch: dict) -> Greedy:
        return greedy_generate(model, batch, NEW_TOKENS)

    one, two = inputs(["448x448"]), inputs(["448x448", "448x448"])
    reference, reference_two = greedy(one), greedy(two)
    steps = {"another image": caught_at(greedy_mismatch(greedy(inputs(["another 448x448"])).ids, reference)),
             "a part from another request": caught_at(greedy_mismatch(
                 greedy(inputs(["448x448", "another 448x448"])).ids, reference_two))}
    print(f"caught at steps {steps}")


def test_qwen2_audio_comparison_catches_wrong_embeddings(tmp_path_factory) -> None:
    """Another clip of the same length, and a part from another request (the first of the two clips
    test_sglang_audio sends another request's)."""
    import soundfile
    from checkpoint_qwen2_audio import write_qwen2_audio_checkpoint
    from test_sglang_audio import prompt as audio_prompt
    from transformers import AutoProcessor, Qwen2AudioForConditionalGeneration

    root = tmp_path_factory.mktemp("catch-qwen2-audio")
    folder = write_qwen2_audio_checkpoint(root / "checkpoint")
    clips = write_audio_clips(root, {"1s": (1.0, 16000), "7.3s": (7.3, 16000), "another 1s": (1.0, 16000)})
    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()

    def greedy(names: list[str]) -> Greedy:
        waves = [soundfile.read(clips[name])[0] for name in names]
        batch = processor(text=[audio_prompt(len(names))], audio=waves, sampling_rate=16000, return_tensors="pt")
        batch["input_features"] = batch["input_features"].to(torch.bfloat16)
        return greedy_generate(model, batch, NEW_TOKENS)

    steps = {"another clip": caught_at(greedy_mismatch(greedy(["another 1s"]).ids, greedy(["1s"]))),
             "a part from another request": caught_at(greedy_mismatch(greedy(["another 1s", "7.3s"]).ids,
                                                                      greedy(["1s", "7.3s"])))}
    print(f"caught at steps {steps}")
