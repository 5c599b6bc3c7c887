"""Image loading and M-RoPE positions, in-process."""

from __future__ import annotations

import base64
import http.server
import io
import os
import socket
import threading
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transfer_large_image import make_image

from embedding_side.images import ImageInputError, MediaPolicy, _scheme, is_remote, load_image
from embedding_side.positions import IMAGE_PAD_ID, image_positions

pytestmark = pytest.mark.fast

EVENTUALLY_S = 30.0  # a wait's deadline: what it catches is "never" (or "for ever")


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    """A real HTTP server on loopback serving a PNG, a big file and a slow endpoint."""
    root = tmp_path_factory.mktemp("www")
    (root / "ok.png").write_bytes(png_bytes(make_image(64, 48, 1)))
    (root / "big.png").write_bytes(b"x" * 5000)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path.startswith("/redirect"):  # /redirect?to=<url>
                self.send_response(302)
                self.send_header("Location", self.path.split("to=", 1)[1])
                self.end_headers()
                return
            super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


# Local files under /tmp (where pytest puts them) and loopback URLs (the test server).
TRUSTED = MediaPolicy.create(["/tmp"], allow_private=True)


def test_every_supported_source_and_format_loads(tmp_path: Path, image_server: str) -> None:
    img = make_image(64, 48, 1)
    policy = MediaPolicy.create([str(tmp_path)], allow_private=True)
    for fmt, ext in (("PNG", "png"), ("JPEG", "jpg"), ("WEBP", "webp")):
        path = tmp_path / f"a.{ext}"
        path.write_bytes(png_bytes(img, fmt))
        assert load_image(str(path), policy).size == (64, 48)
        assert load_image(path.as_uri(), policy).size == (64, 48)
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()
    assert np.array_equal(np.asarray(load_image(uri, MediaPolicy())), np.asarray(img))
    assert load_image(f"{image_server}/ok.png", policy).size == (64, 48)
    assert load_image(f"{image_server}/redirect?to=/ok.png", policy).size == (64, 48)


@pytest.mark.parametrize("ref, words", [
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a decodable"),
    ("data:image/png;base64,@@@@", "invalid base64"),
    ("data:image/png,rawbytes", "must be data:image"),
    ("ftp://example.org/a.png", "unsupported scheme 'ftp'"),
    ("/nonexistent/picture.png", "cannot read file"),
    ("http://127.0.0.1:1/a.png", "unreachable"),
    ("", "non-empty string"),
    ("/tmp/" + "a" * 9000 + ".png", "a path or URL longer than 8192 characters"),
])
def test_bad_inputs_say_what_is_wrong(ref: str, words: str) -> None:
    with pytest.raises(ImageInputError, match=words) as info:
        load_image(ref, MediaPolicy.create(["/"], allow_private=True))
    assert len(str(info.value)) < 300  # never echoes a whole payload


def test_no_data_uri_is_kept_once_its_request_is_done() -> None:
    """urllib's ``urlsplit`` keeps its last 128 arguments and results: an image sent as a data: URI
    must not go through it (128 of them were kept, twice each, in the encode worker)."""
    uri = "data:image/png;base64," + base64.b64encode(png_bytes(make_image(64, 48, 2))).decode()
    urllib.parse.urlsplit.cache_clear()
    assert load_image(uri, MediaPolicy()).size == (64, 48)
    assert is_remote(uri) is False and urllib.parse.urlsplit.cache_info().currsize == 0
    for ref in ("HTTPS://example.org/a.png", "file:///tmp/a.png", "data:image/png;base64,AAAA", "ftp://x/y",
                "1http://x/y", "ht tp://x/y", "/tmp/a.png", "relative/a.png", "c:/x", "héllo://x/y"):
        assert _scheme(ref) == (urllib.parse.urlsplit(ref).scheme.lower() if "://" in ref or ref.startswith(
            "data:") else ""), ref


def test_limits_on_size_and_format(tmp_path: Path, image_server: str) -> None:
    small = MediaPolicy.create([str(tmp_path)], allow_private=True, max_bytes=4096)
    with pytest.raises(ImageInputError, match="4096-byte limit"):
        load_image(f"{image_server}/big.png", small)
    (tmp_path / "big.png").write_bytes(b"x" * 5000)
    with pytest.raises(ImageInputError, match="4096-byte limit"):
        load_image(str(tmp_path / "big.png"), small)
    with pytest.raises(ImageInputError, match="HTTP 404"):
        load_image(f"{image_server}/missing.png", TRUSTED)
    gif = tmp_path / "a.gif"
    make_image(8, 8, 0).save(gif, "GIF")
    with pytest.raises(ImageInputError, match="format GIF not supported"):
        load_image(str(gif), TRUSTED)


def test_mrope_positions_of_two_images() -> None:
    fill, mrope, delta = image_positions([(1, 4, 6), (1, 2, 2)])  # 2x3 merged tokens, then 1x1
    assert (fill == IMAGE_PAD_ID).all() and mrope.shape == (3, 7)
    assert mrope[:, :6].T.tolist() == [[1, 1, 1], [1, 1, 2], [1, 1, 3], [1, 2, 1], [1, 2, 2], [1, 2, 3]]
    # image 1 ends at position 3, <|vision_end|> is 4, the next <|vision_start|> 5, so pads start at 6
    assert mrope[:, 6].tolist() == [6, 6, 6]
    assert delta == (6 + 2) - (6 + 2 + 1 + 2)


# ---- hostile media ---------------------------------------------------------

def test_local_files_only_inside_the_allowed_directories_and_refusals_do_not_tell_existence(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    make_image(16, 16, 0).save(allowed / "ok.png")
    (allowed / "out.png").symlink_to("/etc/hostname")  # a symlink out of the directory
    policy = MediaPolicy.create([str(allowed)])
    assert load_image(str(allowed / "ok.png"), policy).size == (16, 16)
    answers = []
    for ref in ("/etc/shadow", "/proc/self/environ", "/nonexistent/x.png", str(allowed / "out.png"),
                f"file://{allowed}/../../../etc/passwd", str(allowed / ".." / "elsewhere.png")):
        with pytest.raises(ImageInputError, match="only read inside --allowed-local-media-path") as info:
            load_image(ref, policy)
        answers.append(str(info.value).replace(ref[:200], "REF"))
    assert len(set(answers)) == 1, answers  # the same words whether the file exists or not
    with pytest.raises(ImageInputError, match="only read inside"):
        load_image(str(allowed / "ok.png"), MediaPolicy())  # no directory allowed: no local file


def test_devices_and_fifos_are_refused_at_once_and_nothing_unbounded_is_read(tmp_path: Path) -> None:
    everything = MediaPolicy.create(["/"])
    for ref in ("/dev/zero", "file:///dev/urandom", str(tmp_path)):
        with pytest.raises(ImageInputError, match="not a regular file"):
            load_image(ref, everything)
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)  # no writer: opening it for a blocking read would wait for ever
    refused: list[BaseException] = []

    def load() -> None:
        try:
            load_image(str(fifo), everything)
        except BaseException as exc:  # noqa: BLE001 - checked below
            refused.append(exc)

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    loading.join(EVENTUALLY_S)
    blocked = loading.is_alive()
    if blocked:  # a writer lets the blocked open go
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        loading.join(EVENTUALLY_S)
    assert not blocked, "the fifo was opened for reading: it waited for a writer"
    assert len(refused) == 1 and isinstance(refused[0], ImageInputError) and "not a regular file" in str(refused[0])


def test_a_pixel_bomb_is_refused_from_its_header(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.png"
    Image.new("1", (10_000, 10_000)).save(bomb, optimize=True)  # 100 Mpx in a few kB
    assert bomb.stat().st_size < 200_000
    with pytest.raises(ImageInputError, match="10000x10000 is 100000000 pixels, over the 40000000-pixel limit"):
        load_image(str(bomb), TRUSTED)
    with pytest.raises(ImageInputError, match="over the 100-pixel limit"):
        load_image(str(bomb), MediaPolicy.create(["/tmp"], max_pixels=100))


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/a.png", "http://localhost:9/a.png", "http://[::1]:9/a.png",
                                 "http://169.254.169.254/latest/meta-data", "http://10.1.2.3/a.png",
                                 "http://192.168.0.1/a.png", "http://0.0.0.0:9/a.png"])
def test_urls_to_private_addresses_are_refused_by_default(url: str) -> None:
    with pytest.raises(ImageInputError, match="resolves to a non-public address; fetching it needs"):
        load_image(url, MediaPolicy())


def test_a_fetch_goes_to_the_address_that_was_checked_not_a_second_dns_answer(image_server: str,
                                                                              monkeypatch) -> None:
    """DNS rebinding: the first answer is public, a second one would be loopback (where the
    test server listens). The name is resolved once and the connection goes to the first."""
    port = int(image_server.rsplit(":", 1)[1])
    real = socket.getaddrinfo
    answers = iter(["1.1.1.1", "127.0.0.1"])
    lookups = []

    def rebinding_dns(host, *args, **kwargs):
        if host != "images.example":
            return real(host, *args, **kwargs)
        lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_dns)
    with pytest.raises(ImageInputError):  # 1.1.1.1 does not serve the test's image (nor is reachable here)
        load_image(f"http://images.example:{port}/ok.png", MediaPolicy(fetch_timeout=1))
    assert lookups == ["images.example"]


def test_domains_limit_fetches_and_every_redirect_is_checked_again(image_server: str) -> None:
    port = image_server.rsplit(":", 1)[1]
    local = MediaPolicy.create([], ["localhost"])
    assert load_image(f"http://localhost:{port}/ok.png", local).size == (64, 48)
    with pytest.raises(ImageInputError, match="host '127.0.0.1' is not in --allowed-media-domains"):
        load_image(f"{image_server}/ok.png", local)
    with pytest.raises(ImageInputError, match="host '127.0.0.1' is not in --allowed-media-domains"):
        load_image(f"http://localhost:{port}/redirect?to={image_server}/ok.png", local)
    with pytest.raises(ImageInputError, match="only http.s. URLs with a host are fetched"):
        load_image(f"http://localhost:{port}/redirect?to=file:///etc/passwd", local)
    with pytest.raises(ImageInputError, match="more than 5 redirects"):
        load_image(f"http://localhost:{port}/redirect?to=/redirect?to=/redirect?to=/redirect?to=/redirect?to="
                   f"/redirect?to=/ok.png", local)
