"""SGLang's own multimodal encoder (its preprocessing, the model's vision tower, its batching) as
the encode worker's encoder, in this process.

SGLang's encoder server (``--encoder-only``) is an HTTP app around an ``MMEncoder`` (the model
file's ``get_image_feature`` on SGLang's model class, the checkpoint's HF processor, all of it
chosen by the checkpoint's architecture) and an ``EncoderScheduler`` (concurrent requests fused
into one forward pass, up to ``SGLANG_ENCODER_MAX_BATCH_SIZE``). Its transfer backends push the
result to a language server; ours is the resumable connector, which the language side pulls
through. So the worker builds those two objects as SGLang's runtime does (one rank), runs them on
an event loop of their own (the forward pass blocks the loop it runs on), submits each request's
decoded images to the scheduler from its compute threads, takes the staged embedding and
releases it: SGLang's delivery objects never run.

The geometry admission needs before the forward pass (tokens per image, from the header) is the
checkpoint processor's own ``smart_resize`` settings, or, for a family whose model resizes
images itself before its processor (MiniMax-M3-VL's ``preprocess_mm_for_encoder``), that
family's rule from SGLang's module; the worker checks the result's token count against it.
Families whose processor is not of Qwen's kind (patch, merge, pixel bounds) are refused at
start: their token count cannot be known before encoding yet.

Audio (Qwen2-Audio) goes as the file's bytes too; its token count follows from the header's
length and rate (the feature extractor's hop and window, the model's output length).

Videos (Qwen families) go to SGLang's encoder as the container's bytes: it decodes them, samples
frames at its rate (``qwen_vl.smart_nframes``, 2 fps by default), resizes them
(``qwen_vl.preprocess_video``) and runs the checkpoint's video processor and the model's
``get_video_feature``. Their token count is known from the header the same way: SGLang's frame
count and first resize, then the video processor's own ``get_num_of_video_patches``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
from PIL import Image

from connector import FailureKind, TransferFailure
from embedding_side.audio import AudioClip
from embedding_side.encoders import EncodedImages, check_shape, settings_fingerprint, tensors_digest
from embedding_side.videos import VideoClip, VideoSampling

log = logging.getLogger(__name__)

# the role SGLang's runtime context is published under for its encoder
ENCODER_ROLE = "encoder"
LOAD_ERROR = "Error while loading data "  # how SGLang's preprocessor words a load failure


class SGLangEncoder:
    """``VisionEncoder`` over SGLang's ``MMEncoder`` and ``EncoderScheduler`` (see the module
    docstring); ``server_args`` are SGLang's, parsed for ``--encoder-only``."""

    def __init__(self, server_args) -> None:
        from sglang.srt.plugins import load_plugins

        load_plugins()  # our hooks (the CPU vision attention); a no-op under SGLang's launcher
        from sglang.srt.managers.schedule_batch import Modality

        self.model_path = server_args.model_path
        self.encoder, self.scheduler = _build_runtime(server_args)
        config = self.encoder.model_config.hf_config
        self.name = f"sglang:{self.encoder.model_type}"
        dims = self.encoder._embedding_dims
        self.hidden_size = int(dims.get(Modality.IMAGE) or dims[Modality.AUDIO])
        self.dtype = self.encoder._embedding_dtype
        preprocessor = self.encoder.preprocessor
        processor = preprocessor.image_processor
        if processor is not None:
            overrides = preprocessor.vision_config.get("image", {})
            self.patch_size, self.merge_size, low, high = _qwen_geometry(processor, overrides, self.name)
            self._resize = _resize_rule(self.encoder.model_type, self.patch_size * self.merge_size, low, high,
                                        overrides.get("max_pixels"))
            self.image_token_id = int(getattr(config, "image_token_id", None) or config.image_token_index)
        else:  # an audio model: no image reaches resize() (the worker refuses them first)
            self.patch_size = self.merge_size = 1
            self._resize, self.image_token_id = None, -1
        self.video_token_id = getattr(config, "video_token_id", None)
        self._video_processor = getattr(preprocessor, "video_processor", None)
        takes_video = (self._video_processor is not None and self.video_token_id is not None
                       and "qwen" in self.encoder.model_type)
        self.audio_token_id = getattr(config, "audio_token_index", None) or getattr(config, "audio_token_id", None)
        self._audio_processor = getattr(preprocessor, "audio_processor", None)
        takes_audio = (self._audio_processor is not None and self.audio_token_id is not None
                       and self.encoder.model_type == "qwen2_audio")
        self.modalities = ("image",) * (processor is not None) + ("video",) * takes_video + ("audio",) * takes_audio
        self.max_batch = self.scheduler.max_batch_size
        settings = [p.to_dict() for p in (processor, self._audio_processor) if p is not None]
        started = time.monotonic()
        model = self.encoder.model
        self._fingerprint = settings_fingerprint({
            "encoder": self.name, "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config": _config_without_paths(config), "dtype": str(self.dtype),
            "weights": tensors_digest(model.state_dict().items()),
            "processor": settings, "mm_process_config": preprocessor.vision_config,
            "preprocessing": preprocessing_settings()})
        log.info("the encoder's fingerprint (its weights by content, config and preprocessing): %s, in %.1f s",
                 self._fingerprint, time.monotonic() - started)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="sglang-encoder", daemon=True)
        self._thread.start()
        log.info("SGLang's encoder for %s: %s, width %d, %s, batches of up to %d", self.model_path, self.name,
                 self.hidden_size, self.dtype, self.max_batch)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self.scheduler.start)
        self._loop.run_forever()

    def fingerprint(self) -> str:
        """What an embedding depends on besides the image: the loaded weights by content, the
        model's class and config, dtype, the processor's settings, SGLang's ``--mm-process-config``
        and the preprocessing settings its modules read (from the environment too)."""
        return self._fingerprint

    def resize(self, height: int, width: int) -> tuple[int, int]:
        check_shape(height, width)
        return self._resize(height, width)

    def offload(self, level: int) -> None:
        """Level 1 keeps the weights in host memory (moved there from a GPU), level 2 drops them."""
        if level == 1:
            if self.encoder.device != "cpu":
                self.encoder.model.to("cpu")
        else:
            self.encoder.model = None

    def reload(self) -> None:
        from sglang.srt.model_loader import get_model

        if self.encoder.model is None:
            self.encoder.model = get_model(model_config=self.encoder.model_config, load_config=self.encoder.load_config,
                                           device_config=self.encoder.device_config)
        elif self.encoder.device != "cpu":
            self.encoder.model.to(self.encoder.device)

    def video_sampling(self, clip: VideoClip) -> VideoSampling:
        """What SGLang's encoder makes of ``clip`` (ValueError for a clip it refuses): the frames
        ``preprocess_video`` samples and the size it resizes them to, and the tokens the video
        processor then makes of them."""
        from sglang.srt.multimodal.processors import qwen_vl

        config = self.encoder.preprocessor.vision_config.get("video", {})
        frames = qwen_vl.smart_nframes(config, total_frames=clip.frames, video_fps=clip.fps)
        frames = len(np.unique(np.linspace(0, clip.frames - 1, num=frames, dtype=np.int64)))
        # preprocess_video's bounds on the pixels of one sampled frame
        low = config.get("min_pixels", qwen_vl.VIDEO_MIN_PIXELS)
        total = config.get("total_pixels", qwen_vl.VIDEO_TOTAL_PIXELS)
        high = max(min(config.get("max_pixels", qwen_vl.VIDEO_MAX_PIXELS), total / frames * qwen_vl.FRAME_FACTOR),
                   int(low * 1.05))
        high = min(config.get("max_pixels", high), high)
        if "resized_height" in config and "resized_width" in config:
            height, width = qwen_vl.smart_resize(config["resized_height"], config["resized_width"],
                                                 factor=qwen_vl.IMAGE_FACTOR)
        else:
            height, width = qwen_vl.smart_resize(clip.height, clip.width, factor=qwen_vl.IMAGE_FACTOR,
                                                 min_pixels=low, max_pixels=high)
        patches = self._video_processor.get_num_of_video_patches(frames, height, width, videos_kwargs={})
        return VideoSampling(frames, height, width, patches // (self.merge_size * self.merge_size))

    def audio_tokens(self, clip: AudioClip) -> int:
        """The embedding tokens SGLang's encoder makes of ``clip`` (ValueError past the feature
        extractor's window): its samples at the extractor's rate (resampled to the length
        ``torchaudio.functional.resample`` gives), one mel frame per hop begun, then the model's
        own output length (SGLang's ``_get_feat_extract_output_lengths``)."""
        import torch

        extractor = self._audio_processor.feature_extractor
        rate = int(extractor.sampling_rate)
        samples = clip.frames if clip.sample_rate == rate else -(-clip.frames * rate // clip.sample_rate)
        mel_frames = -(-samples // int(extractor.hop_length))
        if mel_frames > int(extractor.nb_max_frames):
            raise ValueError(f"{clip.seconds:.1f} s of audio is past the encoder's "
                             f"{extractor.nb_max_frames * extractor.hop_length / rate:g} s window")
        return int(self.encoder.preprocessor._get_feat_extract_output_lengths(torch.tensor(mel_frames)))

    def warm_up(self) -> concurrent.futures.Future | None:
        """A small black image through the encoder, not waited for (None for an encoder of audio
        only): the first forward pass of a process compiles SGLang's vision rotary (torch.compile;
        2.3 s on a 2-core CPU), which would otherwise hold up the first client's request."""
        if "image" not in self.modalities:
            return None
        picture = Image.new("RGB", (56, 56))
        return asyncio.run_coroutine_threadsafe(self._encode(f"epd-warm-up-{uuid.uuid4().hex}", "IMAGE", [picture]),
                                                self._loop)

    def encode(self, images: list[Image.Image]) -> EncodedImages:
        """One request's images through SGLang's scheduler (batched with whatever else is queued
        there); called from a worker thread, it waits for the result."""
        return self._wait("IMAGE", list(images))

    def encode_videos(self, clips: list[bytes]) -> EncodedImages:
        """One request's videos (each a container's bytes) through SGLang's scheduler (one
        request at a time: it does not fuse videos); ``extras`` has each video's timestamps or
        seconds per temporal patch."""
        return self._wait("VIDEO", list(clips))

    def encode_audios(self, clips: list[bytes]) -> EncodedImages:
        """One request's audio clips (each a file's bytes) through SGLang's scheduler (batched
        with others); ``grid_thw`` is each clip's token count, as a 1-tuple, and ``extras`` has
        their mel frame counts (``audio_feature_lens``, what SGLang's language side takes)."""
        return self._wait("AUDIO", list(clips))

    def _wait(self, modality: str, items: list) -> EncodedImages:
        rid = f"epd-{uuid.uuid4().hex}"
        future = asyncio.run_coroutine_threadsafe(self._encode(rid, modality, items), self._loop)
        try:
            embedding, grids, extras = future.result()
        except BaseException:
            future.cancel()
            raise
        import torch

        rows = embedding.to("cpu", torch.bfloat16).contiguous()
        if rows.untyped_storage().nbytes() > rows.nbytes:  # a slice of a fused batch: not the whole batch kept
            rows = rows.clone()
        return EncodedImages(rows.view(torch.uint8).numpy(), grids, self.hidden_size, extras)

    async def _encode(self, rid: str, modality: str, items: list):
        request = {"req_id": rid, "modality": modality, "mm_items": items, "num_parts": 1, "part_idx": 0}
        try:
            _, tokens, width, error, status = await self.scheduler.submit(request)
            if error is not None:
                # a video whose frames do not decode is the input's fault, wherever SGLang found it
                about_input = status == 400 or modality == "VIDEO" and "decod" in str(error).lower()
                raise TransferFailure(FailureKind.BAD_REQUEST if about_input else FailureKind.INTERNAL,
                                      f"SGLang's encoder: {_scrubbed(str(error))}")
            staged = self.encoder.req_states[rid].embedding_data
            if width != self.hidden_size or staged.embedding.shape[0] != tokens:
                raise TransferFailure(FailureKind.INTERNAL, f"SGLang's encoder returned {tokens}x{width} in a "
                                                            f"{list(staged.embedding.shape)} embedding, expected "
                                                            f"width {self.hidden_size}")
            if modality == "AUDIO":  # staged: each clip's mel frames; its grid here: its token count
                import torch

                mel_frames = [int(n) for n in staged.grid_dim.reshape(-1).tolist()]
                counts = self.encoder.preprocessor._get_feat_extract_output_lengths(torch.tensor(mel_frames))
                return staged.embedding, [(int(n),) for n in counts.tolist()], {"audio_feature_lens": mel_frames}
            grids = [tuple(int(x) for x in row) for row in staged.grid_dim.tolist()]
            return staged.embedding, grids, _video_extras(staged)
        finally:
            await self.encoder.release_request(rid)


def _scrubbed(error: str) -> str:
    """SGLang's error without the input it repeats (a load error quotes the whole item: a
    video's bytes) or the temporary file it decoded from, at most 500 characters."""
    head, quoted, rest = error.partition(LOAD_ERROR)
    if quoted:  # "... Error while loading data <the item's repr>: <why>": keep the why
        end_of_item = max(rest.rfind("': "), rest.rfind('": '))
        error = f"{head}could not load the input: {rest[end_of_item + 3:] if end_of_item >= 0 else ''}"
    return re.sub(re.escape(tempfile.gettempdir()) + r"/\S+", "<temporary file>", error)[:500]


def _video_extras(staged) -> dict:
    """A staged video's position metadata as JSON lists, one entry per video."""
    extras = {}
    if (stamps := getattr(staged, "video_timestamps", None)) is not None:
        extras["video_timestamps"] = [[float(t) for t in video] for video in stamps]
    if (seconds := getattr(staged, "second_per_grid_ts", None)) is not None:
        extras["second_per_grid_ts"] = [float(s) for s in seconds]
    return extras


def _build_runtime(server_args):
    """SGLang's ``launch_local_runtime`` for one rank, except that torch.distributed's one-rank
    group uses a file store in a private folder: SGLang's would be a TCP store, which listens on
    every interface."""
    from sglang.srt.disaggregation.encoder import server as encoder_server
    from sglang.srt.disaggregation.encoder.runtime import EncoderScheduler, _resolve_encoder_batch_policy
    from sglang.srt.runtime_context import publish

    if server_args.tp_size != 1 or server_args.dp_size != 1:
        raise ValueError("SGLang's encoder in the encode worker runs one rank (--tp-size 1, --dp-size 1)")
    publish(server_args, role=ENCODER_ROLE)
    store = Path(tempfile.mkdtemp(prefix="epd-encoder-dist-")) / "store"
    encoder = encoder_server.MMEncoder(server_args, dist_init_method=f"file://{store}")
    max_batch, coalesce = _resolve_encoder_batch_policy(encoder.model_type, encoder_server.ENCODER_MAX_BATCH_SIZE,
                                                        encoder_server.ENCODER_MAX_BATCH_SIZE_EXPLICIT)
    return encoder, EncoderScheduler(encoder, [], max_batch_size=max_batch, coalesce_same_turn=coalesce)


def _qwen_geometry(processor, overrides: dict, name: str) -> tuple[int, int, int, int]:
    """(patch, merge, min_pixels, max_pixels) of a Qwen-style image processor, with the
    ``--mm-process-config`` image settings SGLang passes it; ValueError for any other kind."""
    patch, merge = getattr(processor, "patch_size", None), getattr(processor, "merge_size", None)
    size = dict(getattr(processor, "size", None) or {})
    low = overrides.get("min_pixels") or size.get("shortest_edge") or getattr(processor, "min_pixels", None)
    high = overrides.get("max_pixels") or size.get("longest_edge") or getattr(processor, "max_pixels", None)
    if not all(isinstance(v, int) and v > 0 for v in (patch, merge, low, high)):
        raise ValueError(f"{name}: the image processor {type(processor).__name__} has no Qwen-style geometry "
                         f"(patch_size, merge_size, min/max pixels); this encode worker cannot size its images "
                         f"before encoding them")
    return patch, merge, low, high


def _resize_rule(model_type: str, factor: int, low: int, high: int, max_pixels: int | None):
    """(height, width) -> the size SGLang's encoder resizes an image to for ``model_type``:
    MiniMax-M3-VL's model resizes it before its processor (which then keeps the size): the
    long side to at most 2016 px, or within ``--mm-process-config``'s image ``max_pixels`` when
    given; every other family's processor resizes it (Qwen's ``smart_resize`` within [low, high])."""
    if model_type == "minimax_m3_vl":
        from sglang.srt.multimodal.processors import minimax_m3_vl, qwen_vl

        if max_pixels is not None:
            return lambda h, w: qwen_vl.smart_resize(h, w, factor=factor, max_pixels=max_pixels)
        return lambda h, w: minimax_m3_vl._compute_aligned_size(h, w, factor, minimax_m3_vl.DEFAULT_IMAGE_LONG_SIDE)
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    return lambda h, w: smart_resize(h, w, factor=factor, min_pixels=low, max_pixels=high)


# SGLang's media preprocessing: the modules whose constants it reads (some set from the environment
# at import: SGLANG_IMAGE_MAX_PIXELS, SGLANG_RESIZE_RESAMPLE, VIDEO_MAX_PIXELS), and the settings it
# reads at call time
PREPROCESSING_MODULES = ("sglang.srt.multimodal.processors.qwen_vl", "sglang.srt.multimodal.processors.glm4v",
                         "sglang.srt.multimodal.processors.minimax_m3_vl")
PREPROCESSING_ENVS = ("SGLANG_IMAGE_MAX_PIXELS", "SGLANG_RESIZE_RESAMPLE", "SGLANG_FORCE_CPU_IMAGE_PREPROCESSING",
                      "SGLANG_ENCODER_IMAGE_PROCESSOR_USE_GPU", "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE")
# a config's entries that name where it was read from, not what it computes
PATH_KEYS = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})


def preprocessing_settings() -> dict:
    """Every setting SGLang's preprocessing of images, videos and audio takes besides the
    processor's own: the upper-case constants of its modules and its environment settings."""
    import importlib

    from sglang.srt.environ import envs

    found: dict = {name: str(getattr(envs, name).get()) for name in PREPROCESSING_ENVS}
    for name in PREPROCESSING_MODULES:
        module = importlib.import_module(name)
        found[name] = {key: value for key, value in vars(module).items()
                       if key.isupper() and isinstance(value, int | float | str | bool | type(None) | enum.Enum)}
    return found


def _config_without_paths(config) -> dict:
    """The model's config as it computes (its sub-configs included), without where it was read from."""
    def strip(value):  # noqa: ANN001, ANN202
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in PATH_KEYS}
        return value

    return strip(config.to_dict())
