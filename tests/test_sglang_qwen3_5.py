"""Qwen3.5 and Qwen3.5-MoE, SGLang's hybrid families (linear-attention and full-attention layers):
the encode role served, the language role refused on this CPU in one line.

SGLang's encoder (with our plugin) on a seeded checkpoint of each gives transformers' own tower's
rows for images and videos, row by row within the rounding of two bf16 towers, and another
medium's rows, or a row out of place, are caught. An encoder has no radix cache, so SGLang's check
of the hybrid layers' cache snapshots (which a CPU lacks) does not refuse it; the encode worker
starts through SGLang's launcher. SGLang's CPU engine runs the linear-attention layers only with
sgl_kernel's CPU kernels, which this install lacks: the language role, and SGLang's PD roles, exit
with one line that says so."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import sglang_stack
import torch
from make_checkpoint import write_qwen3_5_checkpoint
from monolithic import bf16_step, sampled_frames
from PIL import Image
from transfer_large_image import make_image

from harness.workers import WorkerProcess
from sglang_ext.encoder_flags import encoder_argv

pytestmark = pytest.mark.sglang

# Each side rounds its last product to bf16, within one step of its row's largest value of the
# exact one: two implementations of the tower are within two steps (test_sglang_encoder_units').
SAME_ROWS_STEPS = 2


@pytest.fixture(scope="module", params=["Qwen3_5", "Qwen3_5Moe"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory) -> str:
    return str(write_qwen3_5_checkpoint(tmp_path_factory.mktemp(family), moe=family == "Qwen3_5Moe"))


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, str]:
    """Two pictures, and the tests' two clips (one sampled down from 120 frames)."""
    root = tmp_path_factory.mktemp("qwen3.5-media")
    paths = {}
    for width, height in [(640, 336), (448, 448)]:
        paths[f"{width}x{height}"] = str(root / f"{width}x{height}.png")
        make_image(width, height, seed=5).save(paths[f"{width}x{height}"])
    return paths | sglang_stack.write_clips(root)


@pytest.fixture(scope="module")
def encoded(folder, media, tmp_path_factory) -> dict[str, torch.Tensor]:
    """Each medium's rows through SGLang's encoder with our plugin, as the encode worker runs it
    (in a process of its own: SGLang's parallel groups are made once per process)."""
    rows = sglang_stack.encoded_rows(folder, list(media.values()), tmp_path_factory.mktemp("qwen3.5-rows") / "rows.st")
    return {name: rows[path].view(torch.bfloat16).float() for name, path in media.items()}


@pytest.fixture(scope="module")
def tower(folder):
    """transformers' own model of the family (its tower is what these tests compare with) and its processor."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16).eval()
    return model, AutoProcessor.from_pretrained(folder)


def steps_apart(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference of an element, in bf16 steps of its row's largest value."""
    assert got.shape == expected.shape
    return float(((got - expected).abs() / bf16_step(expected.abs().max(dim=1, keepdim=True).values)).max())


def test_the_encode_role_asks_sglang_for_no_radix_cache() -> None:
    assert "--disable-radix-cache" in encoder_argv(["--model-path", "m", "--disaggregation-mode", "encode"])


def image_rows(model, processor, picture) -> torch.Tensor:
    inputs = processor.image_processor(images=[picture], return_tensors="pt")
    with torch.inference_mode():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return torch.cat(out.pooler_output).float()


def test_image_rows_equal_transformers_tower_and_another_image_or_a_shift_is_caught(encoded, media, tower) -> None:
    model, processor = tower
    for name in ("640x336", "448x448"):
        got = encoded[name]
        assert got.shape[1] == 256  # the tower's output alone: Qwen3.5 has no deepstack layers
        picture = Image.open(media[name]).convert("RGB")
        expected = image_rows(model, processor, picture)
        assert steps_apart(got, expected) <= SAME_ROWS_STEPS, name
        other = image_rows(model, processor, make_image(*picture.size, seed=99))
        assert steps_apart(got, other) > 10 * SAME_ROWS_STEPS, name
        assert steps_apart(got, expected.roll(1, dims=0)) > 10 * SAME_ROWS_STEPS, name  # a row out of place


def test_video_rows_equal_transformers_tower_on_the_frames_sglang_samples(encoded, media, tower) -> None:
    """On the frames SGLang's encoder samples, through transformers' own video processor and
    tower; a row out of place is caught."""
    model, processor = tower
    for name in sglang_stack.CLIPS:
        frames, metadata = sampled_frames(media[name])
        inputs = processor.video_processor(videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                                           return_tensors="pt")
        with torch.inference_mode():
            expected = torch.cat(model.model.get_video_features(
                inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output).float()
        assert steps_apart(encoded[name], expected) <= SAME_ROWS_STEPS, name
        assert steps_apart(encoded[name], expected.roll(1, dims=0)) > 10 * SAME_ROWS_STEPS, name


def test_the_encode_worker_starts_and_the_language_roles_are_refused_in_one_line(tmp_path) -> None:
    """Through SGLang's launcher, on Qwen3.5 (Qwen3.5-MoE's roles run the same code; its rows
    above show its encoder)."""
    family, folder = "Qwen3_5", str(write_qwen3_5_checkpoint(tmp_path / "Qwen3_5"))  # family: the refusal names it
    launch = [sys.executable, "-m", "sglang.launch_server", "--model-path", folder, "--port", "1"]
    roles = {"language": ("--disaggregation-mode", "language", "--encoder-urls", "http://127.0.0.1:1"),
             "prefill": ("--disaggregation-mode", "prefill", "--language-only", "--encoder-urls", "http://127.0.0.1:1"),
             "decode": ("--disaggregation-mode", "decode")}
    with ThreadPoolExecutor(len(roles) + 1) as pool:
        encoder = pool.submit(WorkerProcess, "encode", "--model-path", folder)
        refused = {role: pool.submit(subprocess.run, [*launch, *flags], capture_output=True, text=True, timeout=120)
                   for role, flags in roles.items()}
        for role, run in refused.items():
            out = run.result()
            assert out.returncode != 0 and "Traceback" not in out.stderr, (role, out.stderr[-2000:])
            assert out.stderr.strip().splitlines()[-1] == (
                f"error: {family}ForConditionalGeneration's language model has linear-attention layers, which SGLang "
                "runs on a CPU only with sgl_kernel's CPU kernels (sgl_kernel.mamba), and this install has none: "
                "serve its language side on a GPU (its encode role runs here)"), (role, out.stderr[-2000:])
        worker = encoder.result()
    try:
        health = requests.get(f"{worker.url}/health", timeout=10).json()
        assert health["status"] == "ok" and health["modalities"] == ["image", "video"]
        assert "encoder=sglang:qwen3_5" in worker.ready_line
    finally:
        worker.stop()
