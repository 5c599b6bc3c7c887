"""Audio inputs: the sources and byte and time limits of images (:class:`MediaPolicy`), in a WAV,
FLAC or Ogg file (what libsndfile reads, the library SGLang's encoder decodes audio with where
torchcodec is missing), its header read by ``soundfile.info``: no sample is decoded before the
clip's length is known to be within ``--max-audio-seconds``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from embedding_side.images import ImageInputError, MediaPolicy, describe, fetch_media

MAX_CHANNELS = 8
UNKNOWN_FRAMES = 2**63 - 1  # what libsndfile reports when an Ogg's last page gives no length


@dataclass(frozen=True)
class AudioClip:
    """One audio file, fetched and its header read; ``data`` is the file's bytes."""

    ref: str
    data: bytes
    frames: int  # samples per channel
    sample_rate: int
    channels: int

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


def audio_format(data: bytes) -> str | None:
    """The file format of ``data`` from its first bytes, or None for any other."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "Ogg"
    return None


def open_audio(ref: str, policy: MediaPolicy) -> AudioClip:
    """Fetch one audio reference and read its header (format, length, rate, channels checked)."""
    if not isinstance(ref, str) or not ref or "\x00" in ref:
        raise ImageInputError("each audio must be a non-empty string (path, file://, http(s):// or data: URI) "
                              "without NUL characters")
    data = fetch_media(ref, policy, kind="audio")
    if audio_format(data) is None:
        raise ImageInputError(f"{describe(ref)}: not a WAV, FLAC or Ogg audio file")
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, ValueError) as exc:
        raise ImageInputError(f"{describe(ref)}: not a readable audio file ({type(exc).__name__})") from None
    frames, rate, channels = int(info.frames), int(info.samplerate), int(info.channels)
    if frames <= 0 or rate <= 0 or not 0 < channels <= MAX_CHANNELS:
        raise ImageInputError(f"{describe(ref)}: {frames} samples at {rate} Hz in {channels} channels")
    if frames >= UNKNOWN_FRAMES:
        raise ImageInputError(f"{describe(ref)}: its header gives no length (a chained or streamed Ogg, or a "
                              f"broken end), so it cannot be held to the {policy.max_audio_seconds:g} s limit "
                              f"(--max-audio-seconds)")
    if frames > policy.max_audio_seconds * rate:
        raise ImageInputError(f"{describe(ref)}: {frames / rate:.1f} s, over the {policy.max_audio_seconds:g} s "
                              f"limit (--max-audio-seconds)")
    return AudioClip(ref, data, frames, rate, channels)


def decode_bytes(clip: AudioClip) -> int:
    """Host memory that decoding and preprocessing ``clip`` takes at its peak: its samples as
    float64 (soundfile) and a float32 mono copy, resampled, and the mel features of its window
    (128 bins x 3000 frames, a few copies)."""
    return clip.frames * (clip.channels * 8 + 8) + (16 << 20)
