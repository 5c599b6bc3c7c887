"""Video inputs: the sources and byte, time and pixel limits of images (:class:`MediaPolicy`), in an
MP4/QuickTime, WebM/Matroska or AVI container with one video stream (the decoder picks the "best"
of several, which need not be the one checked). The frame size comes from the container's codec
parameters (PyAV: no frame converted, checked against ``--max-image-pixels`` first), the frame
count and rate from the decoder SGLang's encoder uses (``sglang.srt.utils.video_decoder``:
torchcodec where it imports, else decord), so that they are the ones it samples from.

Decoding a sampled frame decodes every frame from the keyframe before it, so the work a clip can
cost is bounded by all its frames: at most ``--max-video-frames`` of them, and at most
``--max-video-pixels`` pixels in all (frames x width x height).

What is read before anything is decoded (frame count, frame rate, frame size) is what the encoder
needs to know the embedding's token count and the memory its decoding takes; the frames themselves
are sampled, decoded and resized by SGLang's encoder from the same bytes.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from embedding_side.images import ImageInputError, MediaPolicy, describe, fetch_media


@dataclass(frozen=True)
class VideoClip:
    """One video, fetched and its header read; ``data`` is the container's bytes."""

    ref: str
    data: bytes
    frames: int
    fps: float
    height: int
    width: int


@dataclass(frozen=True)
class VideoSampling:
    """What an encoder makes of a clip, known from its header: the frames it samples, the size
    they are resized to, and the embedding's token count."""

    frames: int
    height: int
    width: int
    tokens: int


def container(data: bytes) -> str | None:
    """The container format of ``data`` from its first bytes, or None for any other."""
    if data[4:8] == b"ftyp":
        return "MP4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM/Matroska"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "AVI"
    return None


def open_video(ref: str, policy: MediaPolicy) -> VideoClip:
    """Fetch one video reference and read its header (container, frame count, rate and size
    checked); no frame is decoded."""
    if not isinstance(ref, str) or not ref or "\x00" in ref:
        raise ImageInputError("each video must be a non-empty string (path, file://, http(s):// or data: URI) "
                              "without NUL characters")
    data = fetch_media(ref, policy, kind="video")
    if container(data) is None:
        raise ImageInputError(f"{describe(ref)}: not an MP4, WebM/Matroska or AVI video")
    height, width = _frame_size(ref, data)
    if width * height > policy.max_pixels:
        raise ImageInputError(f"{describe(ref)}: frames of {width}x{height} are {width * height} pixels, over the "
                              f"{policy.max_pixels}-pixel limit")
    from sglang.srt.utils.video_decoder import VideoDecoderWrapper

    try:
        with VideoDecoderWrapper(data, device="cpu") as reader:
            frames, fps = len(reader), float(reader.avg_fps)
    except (ImportError, MemoryError):
        raise
    except Exception as exc:  # torchcodec raises RuntimeError, decord its own kind
        raise _undecodable(ref, exc) from None
    if frames <= 0 or not fps > 0:
        raise ImageInputError(f"{describe(ref)}: the video has {frames} frames at {fps:g} fps")
    if frames > policy.max_video_frames:
        raise ImageInputError(f"{describe(ref)}: {frames} frames, over the {policy.max_video_frames}-frame limit "
                              f"(--max-video-frames)")
    if frames * width * height > policy.max_video_pixels:
        raise ImageInputError(f"{describe(ref)}: {frames} frames of {width}x{height} are "
                              f"{frames * width * height} pixels, over the {policy.max_video_pixels}-pixel limit "
                              f"(--max-video-pixels)")
    return VideoClip(ref, data, frames, fps, height, width)


def _frame_size(ref: str, data: bytes) -> tuple[int, int]:
    """(height, width) of the first video stream, from the container's codec parameters."""
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as media:
            if len(media.streams.video) != 1:
                raise ImageInputError(f"{describe(ref)}: the container holds {len(media.streams.video)} video "
                                      f"streams; one is taken")
            codec = media.streams.video[0].codec_context
            height, width = int(codec.height), int(codec.width)
    except av.FFmpegError as exc:
        raise _undecodable(ref, exc) from None
    if min(height, width) <= 0:
        raise ImageInputError(f"{describe(ref)}: the video stream has no frame size")
    return height, width


def _undecodable(ref: str, exc: BaseException) -> ImageInputError:
    return ImageInputError(f"{describe(ref)}: not a decodable video ({type(exc).__name__})")


def decode_bytes(clip: VideoClip, sampling: VideoSampling) -> int:
    """Host memory that decoding and preprocessing ``clip`` takes at its peak, estimated from its
    header: each sampled frame decoded (3 bytes a pixel) and converted for the resize (float32),
    then, per pixel of the resized frames, what an image takes (:func:`embedding_side.encoders.decode_bytes`)."""
    return sampling.frames * (16 * clip.width * clip.height + 72 * sampling.height * sampling.width)
