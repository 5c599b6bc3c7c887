"""Video inputs, in this process: a real MP4's header read (frame count and rate by SGLang's
decoder, size by PyAV), every limit an image has (allowed paths, bytes, pixels) plus a frame
limit, with a message naming what was wrong; an encoder that takes images only refuses videos
with a 400 that fails the room; the language side checks an encoder's video answer before it
places the rows."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from fake_encoder import FakeEncoder
from sglang_stack import write_clips

from connector import FailureKind
from embedding_side.images import ImageInputError, MediaPolicy
from embedding_side.videos import container, open_video
from harness.workers import InProcessWorker
from language_side.dispatch import EncoderDispatch, ImageRefused, video_layout
from language_side.embedding_cache import EmbeddingCache
from language_side.layout import LayoutError
from sglang_ext.mm_receiver import EmbeddingUnavailable, ResumableReceiver, media_sources

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
        (path, policy(root, max_video_pixels=8 * 392 * 280 - 1), "8 frames of 392x280 are 878080 pixels, over"),
        (path, policy(root, max_bytes=100), "larger than the 100-byte limit"),
        ("data:video/mp4,raw", MediaPolicy(), "must be data:video/...;base64"),
    ]
    png = tmp_path / "picture.mp4"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    cases.append((str(png), policy(str(tmp_path)), "not an MP4, WebM/Matroska or AVI video"))
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(Path(path).read_bytes()[:200])
    cases.append((str(truncated), policy(str(tmp_path)), "not a decodable video"))
    two = tmp_path / "two-streams.mp4"  # the decoder would pick the larger stream, not the one checked
    _two_streams(two)
    cases.append((str(two), policy(str(tmp_path)), "holds 2 video streams; one is taken"))
    for ref, limits, message in cases:
        with pytest.raises(ImageInputError, match=message.replace(".", r"\.").replace("(", r"\(")):
            open_video(ref, limits)


def _two_streams(path: Path) -> None:
    import av
    import numpy as np

    with av.open(str(path), "w", format="mp4") as media:
        streams = [media.add_stream("mpeg4", rate=2) for _ in range(2)]
        for stream, (width, height) in zip(streams, [(64, 48), (1280, 720)], strict=True):
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(4):
            for stream in streams:
                pixels = np.zeros((stream.height, stream.width, 3), np.uint8)
                media.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        for stream in streams:
            media.mux(stream.encode())


def test_containers_are_told_by_their_first_bytes() -> None:
    assert container(b"\x00\x00\x00\x18ftypisom") == "MP4"
    assert container(b"\x1a\x45\xdf\xa3\x01") == "WebM/Matroska"
    assert container(b"RIFF\x00\x00\x00\x00AVI LIST") == "AVI"
    assert container(b"GIF89a") is None


def test_an_encoder_of_images_only_refuses_a_video(clips) -> None:
    worker = InProcessWorker("encode", encoder=FakeEncoder())
    try:
        health = requests.get(f"{worker.url}/health", timeout=10).json()
        assert health["modalities"] == ["image"]
        for body, message in (({"videos": [clips["392x280x8"]]}, "takes images only"),
                              ({"videos": [clips["392x280x8"]], "images": ["/x.png"]}, "images, videos or audios: one kind"),
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
                              ({"grid_thw": [[4, 17, 24]]}, 408, 1), ({"grid_thw": [[-4, 18, 24]]}, -432, 1),
                              ({**answer, "video_timestamps": [[0.25]]}, 432, 1),
                              ({**answer, "video_timestamps": [["soon"] * 4]}, 432, 1), ({}, 432, 1)):
        with pytest.raises(LayoutError):
            video_layout(bad, rows, videos)


def test_per_item_options_and_nested_lists_are_refused_not_dropped() -> None:
    """An option the encoders would not be told (MiniMax's ``max_long_side_pixel``, a video's
    fps) is a 400, not silently ignored; nested lists are counted flat against the limit."""
    from sglang.srt.utils import ImageData, VideoData

    assert media_sources([ImageData(url="a.png", detail="auto"), {"url": "b.png", "type": "image_url"}]) == [
        "a.png", "b.png"]
    for data, kind in (([ImageData(url="a.png", max_long_side_pixel=448)], "image"),
                       ([{"url": "a.png", "max_dynamic_patch": 6}], "image"),
                       ([VideoData(url="v.mp4", preprocess_kwargs={"fps": 1.0})], "video")):
        with pytest.raises(EmbeddingUnavailable, match=f"per-{kind} options") as refused:
            media_sources(data, kind)
        assert refused.value.status_code == 400
    receiver = ResumableReceiver(None, None, limits={"image": 2, "video": 1})
    request = SimpleNamespace(rid="r", audio_data=None, image_data=[["a.png", "b.png", "c.png"]], video_data=None)
    with pytest.raises(EmbeddingUnavailable, match="3 images in one request, over the limit of 2"):
        asyncio.run(receiver.recv_mm_data(request, None, "prompt"))


def test_when_the_images_fail_the_videos_of_the_request_are_cancelled() -> None:
    """One request's images and videos go to the encoders at once: the first failure cancels
    the other half (its rooms end), and the request's answer is that failure."""
    cancelled = []

    class Dispatch:
        async def embed(self, rid, images, cache_salt=None):
            await asyncio.sleep(0.05)
            raise ImageRefused(FailureKind.BAD_REQUEST, "encoder refused the image")

        async def embed_media(self, rid, videos, modality, cache_salt=None):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(rid)
                raise

    receiver = ResumableReceiver(Dispatch(), None)
    request = SimpleNamespace(rid="both", audio_data=None, image_data=["a.png"], video_data=["v.mp4"])
    with pytest.raises(EmbeddingUnavailable, match="encoder refused the image"):
        # halfway to the videos' 60 s: what the request would wait for without the cancel
        asyncio.run(asyncio.wait_for(receiver.recv_mm_data(request, None, "prompt"), 30))
    assert cancelled == ["both"] and not receiver._embedding


def test_a_video_no_encoder_takes_is_a_400_before_any_is_asked() -> None:
    dispatch = EncoderDispatch(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], None, EmbeddingCache(0))
    for encoder in dispatch.encoders:
        encoder.modalities = ("image",)
    with pytest.raises(ImageRefused, match=r"none of this language server's encoders takes videos") as refused:
        asyncio.run(dispatch._part("rid", 0, ["v.mp4"], "video"))
    assert refused.value.kind.http_status == 400


@pytest.mark.parametrize(("media", "named"), [({"videos": ["v.mp4"]}, "the video"),
                                               ({"audios": ["a.wav"]}, "the audio clip"),
                                               ({"images": ["a.png"]}, "the image")])
def test_an_encoders_refusal_names_what_it_refused(media, named) -> None:
    """An encoder's 4xx about the input reaches the client as a refusal of that kind of input."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    async def refuse(_request: web.Request) -> web.Response:
        return web.json_response({"error": "frames do not decode"}, status=400)

    async def ask() -> None:
        app = web.Application()
        app.router.add_post("/encode", refuse)
        async with TestServer(app, host="127.0.0.1") as server:
            dispatch = EncoderDispatch([str(server.make_url("")).rstrip("/")], None, EmbeddingCache(0))
            dispatch._open_session()
            try:
                await dispatch._post_encode(dispatch.encoders[0], "rid-0", 7, media)
            finally:
                await dispatch.close()

    with pytest.raises(ImageRefused, match=f"refused {named} \\(400\\): .*frames do not decode") as refused:
        asyncio.run(ask())
    assert refused.value.kind.http_status == 400
