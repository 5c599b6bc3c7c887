"""Vision encoders with Qwen2.5-VL geometry: the real transformers tower and a fast fake.

Both map a list of RGB images to one bf16 embedding ``[tokens, hidden]`` (images in order)
plus each image's ``(t, h, w)`` patch grid; tokens per image = ``t * h * w / 4`` (2x2 merge).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from embedding_side.positions import IMAGE_PAD_ID

log = logging.getLogger(__name__)

PATCH, MERGE, TEMPORAL = 14, 2, 2
FACTOR = PATCH * MERGE  # 28 pixels per merged token side
# The Qwen2.5-VL hub preprocessor_config: 4 to 16384 merged tokens per image.
MIN_PIXELS, MAX_PIXELS = 56 * 56, 16384 * FACTOR * FACTOR


@dataclass
class EncodedImages:
    """One request's images (or videos) encoded: its rows in order and each item's grid."""

    embeddings: np.ndarray  # uint8 [tokens, hidden * 2]: bf16 bytes, row-major
    grid_thw: list[tuple[int, int, int]]  # patch grid per image (or video), before the 2x2 merge
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
    # "image", and "video" for an encoder that also has video_token_id, video_sampling(clip) and
    # encode_videos(clips) (SGLangEncoder)
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


# (height, width) -> the resized (height, width): an encoder's ``resize``
Resize = Callable[[int, int], tuple[int, int]]


def check_shape(height: int, width: int) -> None:
    """Refuse a shape Qwen's preprocessing cannot resize, with the message a client gets."""
    if min(height, width) <= 0 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {width}x{height}: aspect ratio must be at most 200")


def smart_resize(height: int, width: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Qwen's resize rule: both sides multiples of 28, area within [min_pixels, max_pixels].

    The real encoder uses transformers' own (``QwenVisionEncoder.resize``); this copy, equal to it
    (tests/test_image_geometry.py compares them over a grid of sizes), is what the fake encoder
    and the defaults below use: importing transformers' costs a process 3 to 7 s (torch and
    torchvision come with it), and the fake encoder's worker processes import no torch at all."""
    check_shape(height, width)
    h, w = round(height / FACTOR) * FACTOR, round(width / FACTOR) * FACTOR
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(FACTOR, math.floor(height / scale / FACTOR) * FACTOR)
        w = max(FACTOR, math.floor(width / scale / FACTOR) * FACTOR)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * scale / FACTOR) * FACTOR, math.ceil(width * scale / FACTOR) * FACTOR
    return h, w


def decode_bytes(image: Image.Image, resize: Resize = smart_resize) -> int:
    """Host memory that decoding and preprocessing one image takes at its peak, estimated from
    its header: the decoded pixels and a converted copy (Pillow keeps 4 bytes a pixel), then
    float32 copies, the patches (repeated twice in time) and the tower's input and activations
    per pixel of the resized image (68 bytes measured for a 4K frame with the built-in tower)."""
    h, w = resize(image.height, image.width)
    return 8 * image.width * image.height + 72 * h * w


def grid_for(image: Image.Image, resize: Resize = smart_resize, patch: int = PATCH) -> tuple[int, int, int]:
    """The image's ``(t, h, w)`` patch grid, before the merge."""
    h, w = resize(image.height, image.width)
    return 1, h // patch, w // patch


def tokens_for(image: Image.Image, encoder: VisionEncoder) -> int:
    """Embedding tokens of one image, known before ``encoder`` encodes it (ValueError for a
    refused shape)."""
    t, h, w = grid_for(image, encoder.resize, encoder.patch_size)
    return t * h * w // (encoder.merge_size * encoder.merge_size)


def to_bf16_bytes(values: np.ndarray) -> np.ndarray:
    """float32 [n, hidden] -> bf16 bytes [n, hidden * 2], round to nearest even."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.view(np.uint8).reshape(values.shape[0], -1)


class FakeEncoder:
    """Deterministic numpy encoder for fast tests: real token counts and shapes, no torch.

    Each merged token is the mean colour of its 28x28 cell plus its normalised position,
    projected by a fixed seeded matrix: content-dependent and bit-reproducible.
    """

    name = "fake"
    patch_size, merge_size, image_token_id, max_batch = PATCH, MERGE, IMAGE_PAD_ID, 1
    modalities = ("image",)

    def __init__(self, hidden_size: int = 3584, seed: int = 0) -> None:
        self.hidden_size, self.seed = hidden_size, seed
        self._proj = np.random.default_rng(seed).standard_normal((6, hidden_size)).astype(np.float32)

    def fingerprint(self) -> str:
        return settings_fingerprint({"encoder": self.name, "hidden": self.hidden_size, "seed": self.seed,
                                     "grid": [PATCH, MERGE, TEMPORAL, MIN_PIXELS, MAX_PIXELS]})

    def resize(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width)

    def offload(self, level: int) -> None:
        pass  # no weights beyond the fixed projection

    def reload(self) -> None:
        pass

    def encode(self, images: list[Image.Image]) -> EncodedImages:
        grids, parts = [], []
        for image in images:
            grid = grid_for(image, self.resize)
            gh, gw = grid[1] // MERGE, grid[2] // MERGE
            cells = np.asarray(image.resize((gw, gh), Image.Resampling.BOX), np.float32).reshape(-1, 3) / 255.0
            ys, xs = np.divmod(np.arange(gh * gw, dtype=np.float32), gw)
            features = np.column_stack([cells, ys / gh, xs / gw, np.ones(gh * gw, np.float32)])
            parts.append(features @ self._proj)
            grids.append(grid)
        return EncodedImages(to_bf16_bytes(np.concatenate(parts)), grids, self.hidden_size)


def small_tower_config(out_hidden_size: int = 3584) -> dict:
    """A seeded stand-in with Qwen2.5-VL-7B geometry (14 px patches, 2x2 merge, 112 px windows,
    output 3584) and one narrow windowed block, so a 4K image encodes in about a second."""
    return dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=out_hidden_size,
                hidden_act="silu", patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                window_size=112, fullatt_block_indexes=[])


class QwenVisionEncoder:
    """transformers' Qwen2.5-VL vision tower, bf16 (its products on float32 copies on a CPU without
    bf16 arithmetic: :mod:`sglang_ext.cpu_gemm`), with the Qwen2-VL PIL image processor.

    ``model_path`` is a checkpoint folder (``config.json`` + ``*.safetensors``); only its vision
    tower is built and loaded. Without it, a seeded small tower (:func:`small_tower_config`).
    """

    name = "qwen2_5_vl"
    patch_size, merge_size, image_token_id, max_batch = PATCH, MERGE, IMAGE_PAD_ID, 1
    modalities = ("image",)

    def __init__(self, model_path: str | None = None, seed: int = 0, device: str = "cpu") -> None:
        import torch
        from transformers import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

        self._torch, self._smart_resize = torch, smart_resize
        self.device, self.model_path, self.seed = device, model_path, seed
        self._config_cls, self._model_cls = Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel
        self.processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        self.model = self._build()
        self.hidden_size = int(self.model.config.out_hidden_size)

    def fingerprint(self) -> str:
        """What an embedding depends on besides the image's bytes: preprocessing settings and the
        tower (its config and weight files by name, size and modification time, or the built-in
        seed), as of the last time the weights were read."""
        return self._fingerprint

    def _build(self):
        from sglang_ext.cpu_gemm import use_float32_products

        torch = self._torch
        if self.model_path:
            vision_cfg, state = _load_checkpoint(Path(self.model_path))
            config = self._config_cls(**vision_cfg)
        else:
            config, state = self._config_cls(**small_tower_config()), None
        config._attn_implementation = "sdpa"
        torch.manual_seed(self.seed)  # the built-in tower is the same on every build
        model = self._model_cls(config)
        if state is not None:
            missing, unexpected = model.load_state_dict(state, strict=False)
            if missing:
                raise ValueError(f"{self.model_path}: vision weights missing {len(missing)} tensors, e.g. {missing[:3]}")
            if unexpected:
                log.warning("%s: ignoring %d unexpected vision tensors", self.model_path, len(unexpected))
        # Weights in bf16; buffers (the rotary frequencies) stay float32, as transformers loads
        # them: rounded to bf16 they shift every position's angle and the output with it.
        float32_buffers = [(module, name, buffer.clone()) for module in model.modules()
                           for name, buffer in module._buffers.items() if buffer is not None]
        model = model.to(device=self.device, dtype=torch.bfloat16)
        for module, name, buffer in float32_buffers:
            module._buffers[name] = buffer.to(self.device)
        self._fingerprint = self._weights_fingerprint()
        use_float32_products(model)  # on a CPU without bf16 arithmetic (sglang_ext/cpu_gemm.py)
        return model.eval()

    def _weights_fingerprint(self) -> str:
        model: object = f"builtin-seed-{self.seed}"
        if self.model_path:
            folder = Path(self.model_path)
            model = [(folder / "config.json").read_text(), sorted(
                (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob("*.safetensors"))]
        return settings_fingerprint({"encoder": self.name, "model": model, "processor": [
            MIN_PIXELS, MAX_PIXELS, PATCH, MERGE, TEMPORAL]})

    def resize(self, height: int, width: int) -> tuple[int, int]:
        """transformers' ``smart_resize`` with its image processor's settings: what ``encode``'s
        preprocessing does to the image (our message for a refused shape)."""
        check_shape(height, width)
        p = self.processor
        return self._smart_resize(height, width, factor=p.patch_size * p.merge_size,
                                  min_pixels=p.size["shortest_edge"], max_pixels=p.size["longest_edge"])

    def offload(self, level: int) -> None:
        if level == 1:
            self.model = self.model.to("cpu")
        else:
            self.model = None

    def reload(self) -> None:
        self.model = self._build() if self.model is None else self.model.to(self.device)

    def encode(self, images: list[Image.Image]) -> EncodedImages:
        torch = self._torch
        inputs = self.processor(images=images, return_tensors="pt")
        grid = inputs["image_grid_thw"]
        with torch.inference_mode():
            out = self.model(inputs["pixel_values"].to(self.device, torch.bfloat16), grid_thw=grid.to(self.device))
        emb = out.pooler_output if hasattr(out, "pooler_output") else out
        data = emb.to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy()
        return EncodedImages(data.reshape(emb.shape[0], -1), [tuple(map(int, g)) for g in grid.tolist()],
                             self.hidden_size)


def write_builtin_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """Save the seeded small tower as a Qwen2.5-VL-style checkpoint folder (config.json +
    model.safetensors), for ``--model-path`` where a real checkpoint cannot be had."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = QwenVisionEncoder(seed=seed).model
    save_file({f"visual.{k}": v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    vision = small_tower_config()
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "hidden_size": vision.pop("out_hidden_size"), "vision_config": vision}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _load_checkpoint(path: Path) -> tuple[dict, dict]:
    """The vision config and the vision tower's tensors of a Qwen2.5-VL checkpoint folder."""
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--model-path {path}: no config.json")
    config = json.loads(config_file.read_text())
    vision = dict(config.get("vision_config") or {})
    vision.setdefault("out_hidden_size", config.get("hidden_size", 3584))
    vision.pop("model_type", None)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"--model-path {path}: no *.safetensors files")
    state = {}
    for file in files:  # only the tower's tensors are read: the language model's stay on disk
        with safe_open(file, "pt") as shard:
            for key in shard.keys():
                for prefix in ("model.visual.", "visual."):
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = shard.get_tensor(key)
    if not state:
        raise ValueError(f"--model-path {path}: no vision tower tensors (keys starting with 'visual.')")
    return vision, state
