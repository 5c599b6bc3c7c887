"""Video inputs, in this process: a real MP4's header read (frame count and rate by SGLang's
decoder, size by PyAV), every limit an image has (allowed paths, bytes, pixels) plus a frame
limit, with a message naming what was wrong; an encoder that takes images only refuses videos
with a 400 that fails the room; the language side checks an encoder's video answer before it
places the rows."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import requests
from sglang_stack import write_clips
from workers import InProcessWorker

from embedding_side.images import ImageInputError, MediaPolicy
from embedding_side.videos import container, open_video
from language_side.dispatch import video_layout
from language_side.prompt import PromptError

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, str]:
    return write_clips(tmp_path_factory.mktemp("clips"))


def policy(root: str, **limits) -> MediaPolicy:
    return MediaPolicy.create([root], **limits)


def test_the_header_gives_frames_rate_and_size(clips) -> None:
    path = clips["448x252x120"]
    clip = open_video(path, policy(str(Path(path).parent)))
    assert (clip.frames, clip.fps, clip.width, clip.height) == (120, 30.0, 448, 252)
    assert clip.data == Path(path).read_bytes()
    uri = "data:video/mp4;base64," + base64.b64encode(clip.data).decode()
    assert open_video(uri, MediaPolicy()).frames == 120


def test_limits_and_bad_input_are_refused_with_what_was_wrong(clips, tmp_path) -> None:
    path = clips["392x280x8"]
    root = str(Path(path).parent)
    cases = [
        (path, policy(str(tmp_path)), "only read inside --allowed-local-media-path"),
        (path, policy(root, max_video_frames=7), "8 frames, over the 7-frame limit"),
        (path, policy(root, max_pixels=392 * 279), "frames of 392x280 are 109760 pixels, over the"),
        (path, policy(root, max_bytes=100), "larger than the 100-byte limit"),
        ("data:video/mp4,raw", MediaPolicy(), "must be data:video/...;base64"),
    ]
    png = tmp_path / "picture.mp4"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    cases.append((str(png), policy(str(tmp_path)), "not an MP4, WebM/Matroska or AVI video"))
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(Path(path).read_bytes()[:200])
    cases.append((str(truncated), policy(str(tmp_path)), "not a decodable video"))
    for ref, limits, message in cases:
        with pytest.raises(ImageInputError, match=message.replace(".", r"\.").replace("(", r"\(")):
            open_video(ref, limits)


def test_containers_are_told_by_their_first_bytes() -> None:
    assert container(b"\x00\x00\x00\x18ftypisom") == "MP4"
    assert container(b"\x1a\x45\xdf\xa3\x01") == "WebM/Matroska"
    assert container(b"RIFF\x00\x00\x00\x00AVI LIST") == "AVI"
    assert container(b"GIF89a") is None


def test_an_encoder_of_images_only_refuses_a_video(clips) -> None:
    worker = InProcessWorker("encode", "--encoder", "fake")
    try:
        health = requests.get(f"{worker.url}/health", timeout=10).json()
        assert health["modalities"] == ["image"]
        for body, message in (({"videos": [clips["392x280x8"]]}, "takes images only"),
                              ({"videos": [clips["392x280x8"]], "images": ["/x.png"]}, "images or videos, not both"),
                              ({"videos": [7]}, "videos must be strings")):
            answer = requests.post(f"{worker.url}/encode", json={"rid": "v", "bootstrap_room": 5, **body}, timeout=10)
            assert answer.status_code == 400 and message in answer.text, answer.text
    finally:
        worker.stop()


def test_the_language_side_checks_a_video_answer_before_placing_its_rows() -> None:
    answer = {"grid_thw": [[4, 18, 24]], "video_timestamps": [[0.25, 1.25, 2.25, 3.25]]}
    assert video_layout(answer, 432, 1) == ([(4, 18, 24)], {"video_timestamps": [[0.25, 1.25, 2.25, 3.25]]})
    assert video_layout({"grid_thw": [[4, 20, 28]], "second_per_grid_ts": [1]}, 560, 1)[1] == {
        "second_per_grid_ts": [1.0]}
    for bad, rows, videos in ((answer, 431, 1), (answer, 432, 2), ({"grid_thw": [[4, 18]]}, 432, 1),
                              ({**answer, "video_timestamps": [[0.25]]}, 432, 1),
                              ({**answer, "video_timestamps": [["soon"] * 4]}, 432, 1), ({}, 432, 1)):
        with pytest.raises(PromptError):
            video_layout(bad, rows, videos)
