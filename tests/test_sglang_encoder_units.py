"""embedding_side/sglang_encoder.py in this process, on a seeded Qwen3-VL checkpoint: SGLang's
encoder's rows equal transformers' own tower's, the token counts known before encoding are the
ones it produces, batching and sleep change nothing, and what it cannot serve is refused."""

from __future__ import annotations

import argparse
from pathlib import Path
from unittest import mock

import pytest
import sglang_stack
import torch
from make_checkpoint import write_qwen3_vl_checkpoint
from monolithic import bf16_step
from PIL import Image
from transfer_large_image import make_image

from connector.failures import FailureKind, TransferFailure
from embedding_side.encoders import tokens_for
from embedding_side.images import MediaPolicy
from embedding_side.videos import open_video
from sglang_ext.args import embedding_width
from sglang_ext.encoder_flags import encoder_argv, standalone_server_args

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(write_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3-units")))


@pytest.fixture(scope="module")
def encoder(folder):
    from embedding_side.sglang_encoder import SGLangEncoder

    return SGLangEncoder(standalone_server_args(argparse.Namespace(model_path=folder, host="127.0.0.1", device="cpu")))


def rows(encoded) -> torch.Tensor:
    return torch.from_numpy(encoded.embeddings.copy()).view(torch.bfloat16).float()


def test_geometry_and_width_come_from_the_checkpoint(encoder, folder) -> None:
    assert encoder.name == "sglang:qwen3_vl"
    assert (encoder.patch_size, encoder.merge_size) == (16, 2)
    # the tower's output and its two deepstack layers side by side, as the language side splits them
    assert encoder.hidden_size == 256 * 3 == embedding_width(argparse.Namespace(hidden_size=None, model_path=folder))


def test_rows_equal_transformers_tower(encoder, folder) -> None:
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16).eval()
    picture = make_image(640, 336, seed=5)
    inputs = processor.image_processor(images=[picture], return_tensors="pt")
    with torch.inference_mode():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    expected = torch.cat([torch.cat(out.pooler_output), *(torch.cat(f) for f in out.deepstack_features)], dim=1).float()
    got = rows(encoder.encode([picture]))
    assert got.shape == expected.shape
    # The same tower in another order and other kernels: each side rounds its last product to bf16,
    # within one step of its row's largest value of the exact one, so the two are within two steps.
    steps = ((got - expected).abs() / bf16_step(expected.abs().max(dim=1, keepdim=True).values)).max()
    assert steps <= 2, f"an element {float(steps):.2f} bf16 steps (of its row's largest value) away"


def test_token_counts_before_encoding_are_the_encoders(encoder) -> None:
    for width, height in [(448, 448), (57, 1000), (1921, 1079), (33, 33)]:
        picture = Image.new("RGB", (width, height), (90, 30, 200))
        encoded = encoder.encode([picture])
        t, h, w = encoded.grid_thw[0]
        assert tokens_for(picture, encoder) == encoded.embeddings.shape[0] == t * h * w // 4, (width, height)


def test_video_token_counts_before_encoding_are_the_encoders(encoder, tmp_path) -> None:
    """From the header alone (SGLang's frame sampling and first resize, then the video
    processor's count): sizes it keeps, scales up (under its minimum) and down, an odd frame
    count, a long clip sampled down; and its timestamps, one per temporal patch."""
    clips = {"keep": (392, 280, 8, 2), "small": (160, 96, 6, 2), "large": (1280, 720, 10, 5),
             "odd": (300, 200, 9, 3), "long": (448, 252, 120, 30)}
    with mock.patch.dict(sglang_stack.CLIPS, clips, clear=True):
        paths = sglang_stack.write_clips(tmp_path)
    media = MediaPolicy.create([str(tmp_path)])
    for name, path in paths.items():
        clip = open_video(path, media)
        sampling = encoder.video_sampling(clip)
        encoded = encoder.encode_videos([clip.data])
        (t, h, w), = encoded.grid_thw
        assert sampling.tokens == encoded.embeddings.shape[0] == t * h * w // 4, name
        assert t == sampling.frames // 2 and len(encoded.extras["video_timestamps"][0]) == t, (name, encoded.extras)
    with pytest.raises(ValueError, match="nframes"):  # one frame: too short to sample
        with mock.patch.dict(sglang_stack.CLIPS, {"one": (392, 280, 1, 2)}, clear=True):
            encoder.video_sampling(open_video(sglang_stack.write_clips(tmp_path)["one"], media))


def test_a_video_max_pixels_setting_is_followed_by_the_count(encoder, tmp_path, monkeypatch) -> None:
    """``--mm-process-config``'s video ``max_pixels`` caps SGLang's first resize: the count
    from the header follows it (read per request by both)."""
    path = sglang_stack.write_clips(tmp_path)["392x280x8"]
    clip = open_video(path, MediaPolicy.create([str(tmp_path)]))
    monkeypatch.setitem(encoder.encoder.preprocessor.vision_config, "video", {"max_pixels": 50_000})
    sampling = encoder.video_sampling(clip)
    assert sampling.height * sampling.width <= 50_000
    assert sampling.tokens == encoder.encode_videos([clip.data]).embeddings.shape[0]


def test_a_video_that_does_not_decode_is_the_clients_error_without_its_bytes(encoder, tmp_path) -> None:
    data = bytearray(Path(sglang_stack.write_clips(tmp_path)["392x280x8"]).read_bytes())
    start = data.find(b"mdat") + 104  # the frames zeroed after their first bytes: the header still reads
    data[start:] = bytes(len(data) - start)
    with pytest.raises(TransferFailure) as refused:
        encoder.encode_videos([bytes(data)])
    assert refused.value.kind == FailureKind.BAD_REQUEST and "Could not decode video" in str(refused.value)
    assert len(str(refused.value)) <= 500 and "\\x00" not in str(refused.value), str(refused.value)


def test_a_batch_and_a_sleep_change_no_row(encoder) -> None:
    pictures = [make_image(448, 448, seed=1), make_image(320, 640, seed=2)]
    alone = torch.cat([rows(encoder.encode([p])) for p in pictures])
    together = rows(encoder.encode(pictures))
    assert torch.equal(alone, together)
    encoder.offload(2)  # the weights dropped, then read again from the checkpoint
    assert encoder.encoder.model is None
    encoder.reload()
    assert torch.equal(rows(encoder.encode(pictures)), together)


def test_encoder_argv_is_sglangs_encoder_only_mode() -> None:
    argv = ["--model-path", "m", "--disaggregation-mode", "encode", "--disaggregation-transfer-backend", "mooncake",
            "--mm-attention-backend", "sdpa", "--num-blocks", "8", "--device", "cpu"]
    assert encoder_argv(argv) == ["--model-path", "m", "--mm-attention-backend", "sdpa", "--num-blocks", "8",
                                  "--device", "cpu", "--encoder-only", "--encoder-transfer-backend",
                                  "zmq_to_tokenizer", "--disable-radix-cache"]


def test_a_processor_without_qwen_geometry_is_refused() -> None:
    from embedding_side.sglang_encoder import _qwen_geometry

    with pytest.raises(ValueError, match="no Qwen-style geometry"):
        _qwen_geometry(object(), {}, "sglang:other")
    assert _qwen_geometry(argparse.Namespace(patch_size=14, merge_size=2, size={"shortest_edge": 3136,
                                                                                "longest_edge": 12845056}),
                          {"max_pixels": 1 << 20}, "x") == (14, 2, 3136, 1 << 20)
