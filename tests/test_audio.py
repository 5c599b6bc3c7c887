"""Audio inputs, in this process: a WAV's header read without decoding a sample, the limits
(allowed paths, bytes, seconds) with a message naming what was wrong, the CPU stand-in for
torchaudio's resample (the length SGLang counts on), and the language side's check of an
encoder's audio answer."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest
from sglang_stack import write_audio_clips

from embedding_side.audio import audio_format, open_audio
from embedding_side.images import ImageInputError, MediaPolicy
from embedding_side.positions import sequence_positions
from language_side.dispatch import audio_layout
from language_side.layout import LayoutError

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    return write_audio_clips(tmp_path_factory.mktemp("audio"), {"2s-44k": (2.0, 44100), "31s": (31.0, 16000)})


def test_the_header_gives_length_rate_and_channels(clips) -> None:
    clip = open_audio(clips["2s-44k"], MediaPolicy.create([str(Path(clips["2s-44k"]).parent)]))
    assert (clip.frames, clip.sample_rate, clip.channels, clip.seconds) == (88200, 44100, 1, 2.0)


def test_limits_and_bad_input_are_refused_with_what_was_wrong(clips, tmp_path) -> None:
    root = str(Path(clips["31s"]).parent)
    fake = tmp_path / "fake.wav"
    fake.write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk" + bytes(64))
    cases = [(clips["31s"], MediaPolicy.create([root]), "31.0 s, over the 30 s limit (--max-audio-seconds)"),
             (clips["2s-44k"], MediaPolicy.create([str(tmp_path)]), "only read inside --allowed-local-media-path"),
             (clips["2s-44k"], MediaPolicy.create([root], max_bytes=1000), "larger than the 1000-byte limit"),
             (clips["2s-44k"].replace(".wav", ".mp4"), MediaPolicy.create([root]), "cannot read file"),
             ("data:audio/wav,raw", MediaPolicy(), "must be data:audio/...;base64"),
             (str(fake), MediaPolicy.create([str(tmp_path)]), "not a readable audio file")]
    for ref, policy, message in cases:
        with pytest.raises(ImageInputError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
            open_audio(ref, policy)
    assert [audio_format(head) for head in (b"RIFF\x00\x00\x00\x00WAVE", b"fLaC\x00", b"OggS\x00", b"ID3\x03")] == [
        "WAV", "FLAC", "Ogg", None]


def ogg_with_last_granule(path: Path, granule: int) -> str:
    """A 2 s Ogg Vorbis whose last page says ``granule`` samples (its CRC made right again)."""
    import soundfile

    buffer = io.BytesIO()
    noise = np.random.default_rng(0).standard_normal(32000).astype(np.float32) * 0.1
    soundfile.write(buffer, noise, 16000, format="OGG")
    data = buffer.getvalue()
    last = data.rfind(b"OggS")
    page = bytearray(data[last:])
    page[6:14], page[22:26] = struct.pack("<Q", granule), bytes(4)
    page[22:26] = struct.pack("<I", ogg_crc(bytes(page)))
    path.write_bytes(data[:last] + bytes(page))
    return str(path)


def ogg_crc(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) if crc & 0x80000000 else crc << 1
        crc &= 0xFFFFFFFF
    return crc


def test_an_ogg_whose_header_gives_no_length_is_refused_for_that(tmp_path) -> None:
    policy = MediaPolicy.create([str(tmp_path)])
    assert open_audio(ogg_with_last_granule(tmp_path / "two.ogg", 32000), policy).seconds == 2.0
    with pytest.raises(ImageInputError, match=r"its header gives no length \(a chained or streamed Ogg"):
        open_audio(ogg_with_last_granule(tmp_path / "unknown.ogg", 2**63 - 1), policy)
    with pytest.raises(ImageInputError, match=r"36000\.0 s, over the 30 s limit"):  # 10 h claimed
        open_audio(ogg_with_last_granule(tmp_path / "ten-hours.ogg", 36000 * 16000), policy)


def test_the_resample_stand_in_gives_torchaudios_length() -> None:
    """ceil(n x new / old) samples, what the encoder's token count is computed from."""
    import torch

    from sglang_ext.cpu.shim import resample

    for frames, old, new in ((88200, 44100, 16000), (72986, 22050, 16000), (16000, 8000, 16000), (5, 44100, 16000)):
        assert resample(torch.zeros(1, frames), old, new).shape[-1] == -(-frames * new // old)


def test_the_language_side_checks_an_audio_answer_before_placing_its_rows() -> None:
    answer = {"grid_thw": [[25], [182]], "audio_feature_lens": [100, 730]}
    assert audio_layout(answer, 207, 2) == ([(25,), (182,)], {"audio_feature_lens": [100, 730]})
    for bad, rows, clips in ((answer, 206, 2), (answer, 207, 1), ({"grid_thw": [[25]]}, 25, 1),
                             ({"grid_thw": [[0]], "audio_feature_lens": [1]}, 0, 1),
                             ({"grid_thw": [[25, 1]], "audio_feature_lens": [100]}, 25, 1)):
        with pytest.raises(LayoutError):
            audio_layout(bad, rows, clips)
    fill, mrope, delta = sequence_positions(3, 7)
    assert fill.tolist() == [7, 7, 7] and mrope.tolist() == [[1, 2, 3]] * 3 and delta == 0
