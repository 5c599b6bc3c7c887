"""What the encode worker asks of an encoder (SGLang's own, :mod:`embedding_side.sglang_encoder`),
and what an image costs it, known from the image's header before it is encoded.

An encoder maps a list of RGB images to one bf16 embedding ``[tokens, hidden]`` (images in
order) plus each image's ``(t, h, w)`` patch grid; tokens per image = ``t * h * w / merge**2``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from PIL import Image


@dataclass
class EncodedImages:
    """One request's images (or videos) encoded: its rows in order and each item's grid."""

    embeddings: np.ndarray  # uint8 [tokens, hidden * 2]: bf16 bytes, row-major
    grid_thw: list[tuple[int, int, int]]  # patch grid per image (or video), before the merge
    hidden_size: int
    # per video, what the language side's positions need besides the grid (Qwen3-VL's
    # "video_timestamps", Qwen2.5-VL's "second_per_grid_ts"), as JSON lists
    extras: dict = field(default_factory=dict)


class VisionEncoder(Protocol):
    hidden_size: int
    name: str
    patch_size: int  # pixels per patch side
    merge_size: int  # patches per embedding token side
    image_token_id: int  # the prompt's placeholder id each embedding row fills
    max_batch: int  # requests it encodes at once (SGLang's encoder fuses them into one forward pass)
    # "image", and "video" / "audio" for an encoder that also has video_token_id, video_sampling(clip)
    # and encode_videos(clips) / audio_token_id, audio_tokens(clip) and encode_audios(clips)
    modalities: tuple[str, ...]

    def encode(self, images: list[Image.Image]) -> EncodedImages: ...

    def fingerprint(self) -> str: ...

    def resize(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) this encoder's preprocessing resizes an image to (ValueError for a
        shape it refuses): what the image's token count and memory are known from before it is
        encoded."""

    def offload(self, level: int) -> None:
        """Sleep: level 1 keeps the weights in host memory, level 2 drops them."""

    def reload(self) -> None:
        """Wake: weights back where they compute (reloaded from their source after level 2)."""


def settings_fingerprint(settings: dict) -> str:
    """A short stable hash of the settings an embedding depends on (a cache key's second half)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tensors_digest(named_tensors) -> str:
    """SHA-256 of ``(name, tensor)`` pairs as loaded: each name, dtype, shape and the bytes, in
    name order. What a model computes with, by content: a copy of a checkpoint in another folder
    (or a hub cache) digests the same, two checkpoints that differ in one weight do not (about
    0.8 s for a 7B model's 1.35 GB vision tower on one core)."""
    import torch  # only where a model is

    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda pair: pair[0]):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


# (height, width) -> the resized (height, width): an encoder's ``resize``
Resize = Callable[[int, int], tuple[int, int]]


def check_shape(height: int, width: int) -> None:
    """Refuse a shape Qwen's preprocessing cannot resize, with the message a client gets."""
    if min(height, width) <= 0 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {width}x{height}: aspect ratio must be at most 200")


def decode_bytes(image: Image.Image, resize: Resize) -> int:
    """Host memory that decoding and preprocessing one image takes at its peak, estimated from
    its header: the decoded pixels and a converted copy (Pillow keeps 4 bytes a pixel), then
    float32 copies, the patches (repeated twice in time) and the tower's input and activations
    per pixel of the image as ``resize`` resizes it (68 bytes measured for a 4K frame)."""
    h, w = resize(image.height, image.width)
    return 8 * image.width * image.height + 72 * h * w


def grid_for(image: Image.Image, resize: Resize, patch: int) -> tuple[int, int, int]:
    """The image's ``(t, h, w)`` patch grid, before the merge."""
    h, w = resize(image.height, image.width)
    return 1, h // patch, w // patch


def tokens_for(image: Image.Image, encoder: VisionEncoder) -> int:
    """Embedding tokens of one image, known before ``encoder`` encodes it (ValueError for a
    refused shape)."""
    t, h, w = grid_for(image, encoder.resize, encoder.patch_size)
    return t * h * w // (encoder.merge_size * encoder.merge_size)
