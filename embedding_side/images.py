"""Image inputs: local paths, file://, http(s):// and data: URIs; PNG, JPEG and WebP only.

What a client may name is a :class:`MediaPolicy` (the flags follow vLLM's):

* local paths and ``file://`` only inside ``--allowed-local-media-path`` directories (after
  following symlinks), only regular files, read up to the byte limit (a size from metadata is
  never trusted: devices and ``/proc`` files say 0). A refused path gets the same answer whether
  it exists or not;
* ``http(s)://`` only to ``--allowed-media-domains`` when given; otherwise to any host whose
  addresses are all public, unless ``--allow-private-media-urls``. Redirects are followed by
  hand, each target checked the same way; the connection goes to the address that was checked
  (the name is not resolved a second time); the whole fetch ends within ``--image-fetch-timeout``
  however slowly the server sends;
* at most ``--max-image-pixels`` pixels, read from the header before anything is decoded;
* decoding and preprocessing of all requests together within ``--decode-memory-bytes``
  (reserved from the header sizes, see :func:`embedding_side.encoders.decode_bytes`).

Every failure is an :class:`ImageInputError` whose message says what was wrong with which
input (and never echoes file contents or the full data URI).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import ipaddress
import os
import socket
import stat
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import certifi
import urllib3
from PIL import Image, UnidentifiedImageError

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_PIXELS = 40_000_000  # 4.8 times a 4K frame; a decoded RGB image of it is 120 MB
DEFAULT_DECODE_BYTES = 4 << 30  # about seven 4K frames decoded and preprocessed at once
DEFAULT_MAX_VIDEO_FRAMES = 36_000  # frames in a video's container: 20 minutes at 30 fps
# all the frames of a video: 4,000 of 1920x1080, about 25 s of decoding on one core here
DEFAULT_MAX_VIDEO_PIXELS = 1 << 33
DEFAULT_MAX_AUDIO_SECONDS = 30.0  # Qwen2-Audio's window (its encoder takes 3,000 mel frames)
MAX_REDIRECTS = 5
MAX_REFERENCE_CHARS = 8192  # a path or URL (a data: URI is bounded by its bytes)
MAX_SCHEME_CHARS = 32
# Pillow's own bomb guard stays as a second line behind ``max_pixels``.
Image.MAX_IMAGE_PIXELS = 20_000 * 20_000


class ImageInputError(ValueError):
    """An image (or video, or audio) reference that cannot be loaded; maps to HTTP 400."""


@dataclass(frozen=True)
class MediaPolicy:
    """What image references a request may name, and the bounds on reading them."""

    local_dirs: tuple[Path, ...] = ()  # resolved directories; none: local files are refused
    domains: tuple[str, ...] | None = None  # host names URLs may name; None: any public host
    allow_private: bool = False  # URLs to loopback, link-local and private addresses
    max_bytes: int = DEFAULT_MAX_BYTES
    fetch_timeout: float = DEFAULT_TIMEOUT_S
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = 16  # per request
    decode_bytes: int = DEFAULT_DECODE_BYTES  # host memory for decoding and preprocessing, all requests
    max_video_frames: int = DEFAULT_MAX_VIDEO_FRAMES  # per video, counted in its container
    max_video_pixels: int = DEFAULT_MAX_VIDEO_PIXELS  # per video: frames x width x height
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS  # per audio clip

    @classmethod
    def create(cls, local_dirs: list[str] | tuple[str, ...] = (), domains: list[str] | None = None,
               **limits: object) -> MediaPolicy:
        """A policy from flag values: directories resolved, domains lower-cased."""
        return cls(tuple(Path(os.path.realpath(d)) for d in local_dirs),
                   tuple(d.strip().lower().rstrip(".") for d in domains) if domains else None, **limits)


def describe(ref: str) -> str:
    """A short, safe name for an input in error messages."""
    return ref[:40] + "..." if is_data_uri(ref) else ref[:200]


def load_image(ref: str, policy: MediaPolicy) -> Image.Image:
    """Fetch and decode one image reference into an RGB Pillow image."""
    return decode_image(open_image(ref, policy), ref)


def open_image(ref: str, policy: MediaPolicy) -> Image.Image:
    """Fetch one image reference and read its header (format and size checked): nothing is
    decoded yet, so the caller can reserve memory for that from the size first."""
    return open_image_bytes(fetch_image(ref, policy), ref, policy)


def fetch_image(ref: str, policy: MediaPolicy) -> bytes:
    """One image reference's bytes, the reference checked first."""
    if not isinstance(ref, str) or not ref:
        raise ImageInputError("each image must be a non-empty string (path, file://, http(s):// or data: URI)")
    if "\x00" in ref:  # no path, URL or data: URI holds one; the OS would refuse it as a ValueError
        raise ImageInputError(f"{describe(ref)!r}: an image reference must not contain a NUL character")
    return fetch_media(ref, policy)


def open_image_bytes(data: bytes, ref: str, policy: MediaPolicy) -> Image.Image:
    """:func:`open_image` of bytes already fetched (:func:`fetch_image`)."""
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _undecodable(ref, exc) from None
    if img.format not in ALLOWED_FORMATS:
        raise ImageInputError(f"{describe(ref)}: format {img.format} not supported (use PNG, JPEG or WebP)")
    width, height = img.size
    if width * height > policy.max_pixels:
        raise ImageInputError(f"{describe(ref)}: {width}x{height} is {width * height} pixels, over the "
                              f"{policy.max_pixels}-pixel limit")
    return img


def decode_image(img: Image.Image, ref: str) -> Image.Image:
    """Decode an image from :func:`open_image` into RGB."""
    try:
        img.load()
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise _undecodable(ref, exc) from None


def _undecodable(ref: str, exc: BaseException) -> ImageInputError:
    return ImageInputError(f"{describe(ref)}: not a decodable PNG, JPEG or WebP image ({type(exc).__name__})")


def _scheme(ref: str) -> str:
    """``ref``'s URL scheme, lower case ("" for a path), read as ``urlsplit`` reads it but without
    it: ``urlsplit`` keeps its last 128 arguments and results, which for ``data:`` URIs of images
    kept up to 128 decoded-size copies of what clients sent."""
    if "://" not in ref and not is_data_uri(ref):
        return ""
    head, colon, _ = ref[:MAX_SCHEME_CHARS + 1].partition(":")
    return head.lower() if colon and head[:1].isascii() and head[:1].isalpha() and \
        all(c.isascii() and (c.isalnum() or c in "+-.") for c in head) else ""


def is_data_uri(ref: str) -> bool:
    """Whether ``ref`` is a ``data:`` URI (a scheme is case-insensitive: ``DATA:`` is one too)."""
    return ref[:5].lower() == "data:"


def is_remote(ref: object) -> bool:
    """Whether reading ``ref`` means fetching it from another host (http or https)."""
    return isinstance(ref, str) and _scheme(ref) in ("http", "https")


def fetch_media(ref: str, policy: MediaPolicy, kind: str = "image") -> bytes:
    """The bytes ``ref`` names, read under ``policy`` (``kind``: what the messages call it)."""
    scheme = _scheme(ref)
    if scheme == "data":
        return _data_uri(ref, policy.max_bytes, kind)
    if len(ref) > MAX_REFERENCE_CHARS:  # a path or URL: parsed (and cached by urllib) only when short
        raise ImageInputError(f"{describe(ref)}: a path or URL longer than {MAX_REFERENCE_CHARS} characters")
    if scheme in ("http", "https"):
        return _http(ref, policy)
    if scheme == "file":
        return _read_file(urllib.parse.unquote(urllib.parse.urlsplit(ref).path), ref, policy)
    if scheme:
        raise ImageInputError(f"{describe(ref)}: unsupported scheme {scheme!r} (use a path, file://, http(s):// or data:)")
    return _read_file(ref, ref, policy)


# ---- local files -----------------------------------------------------------------------------

def _read_file(path: str, ref: str, policy: MediaPolicy) -> bytes:
    resolved = Path(os.path.realpath(path))  # symlinks followed, whether it exists or not
    if not any(resolved.is_relative_to(root) for root in policy.local_dirs):
        # The same words whether the file exists or not.
        raise ImageInputError(f"{describe(ref)}: local files are only read inside --allowed-local-media-path "
                              f"({len(policy.local_dirs)} directories allowed)")
    try:
        # O_NONBLOCK: opening a FIFO with no writer must not block; O_NOFOLLOW: no symlink
        # swapped in after the check above.
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise ImageInputError(f"{describe(ref)}: cannot read file ({exc.strerror or type(exc).__name__})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ImageInputError(f"{describe(ref)}: not a regular file")
        return _read_bounded(lambda n: os.read(fd, n), ref, policy.max_bytes)
    finally:
        os.close(fd)


def _read_bounded(read, ref: str, max_bytes: int, deadline: float | None = None) -> bytes:
    """Read until EOF, failing as soon as more than ``max_bytes`` came (or, with ``deadline``, at
    the first read that ends after it: ``TimeoutError``)."""
    chunks, total = [], 0
    while chunk := read(min(1 << 20, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise ImageInputError(f"{describe(ref)}: larger than the {max_bytes}-byte limit")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
    return b"".join(chunks)


# ---- URLs ------------------------------------------------------------------------------------

def _check_url(url: str, policy: MediaPolicy) -> str:
    """The address to connect to for ``url``: the one checked to be public (the connection is
    pinned to it, so a DNS answer that changes after the check cannot redirect the fetch), or
    the host name itself where names are trusted (allowed domains, private URLs allowed)."""
    parts = urllib.parse.urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise ImageInputError(f"{describe(url)}: only http(s) URLs with a host are fetched")
    if policy.domains is not None:
        if host not in policy.domains:
            raise ImageInputError(f"{describe(url)}: host {host!r} is not in --allowed-media-domains")
        return host
    if policy.allow_private:
        return host
    try:
        infos = socket.getaddrinfo(host, _port(parts), proto=socket.IPPROTO_TCP)
    except (OSError, ValueError, UnicodeError):
        raise ImageInputError(f"{describe(url)}: host {host!r} does not resolve") from None
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if not address.is_global or address.is_multicast:
            raise ImageInputError(f"{describe(url)}: host {host!r} resolves to a non-public address; fetching it "
                                  f"needs --allow-private-media-urls or --allowed-media-domains")
    return infos[0][4][0]


def _port(parts: urllib.parse.SplitResult) -> int:
    return parts.port or (443 if parts.scheme.lower() == "https" else 80)


def _http(url: str, policy: MediaPolicy) -> bytes:
    """The body at ``url``, the whole fetch (connections, redirects, body) within
    ``policy.fetch_timeout``: a server that drips its bytes is cut off at that deadline."""
    deadline = time.monotonic() + policy.fetch_timeout
    try:
        for _ in range(MAX_REDIRECTS + 1):
            with _get(url, _check_url(url, policy), max(0.01, deadline - time.monotonic())) as resp:
                if resp.status in (301, 302, 303, 307, 308) and "location" in resp.headers:
                    url = urllib.parse.urljoin(url, resp.headers["location"])
                    continue
                if resp.status != 200:
                    raise ImageInputError(f"{describe(url)}: HTTP {resp.status}")
                # read1: whatever has come (a read of n bytes would wait for all n), the deadline
                # checked between reads; each read is bounded by the socket's timeout
                return _read_bounded(resp.read1, url, policy.max_bytes, deadline)
        raise ImageInputError(f"{describe(url)}: more than {MAX_REDIRECTS} redirects")
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        if time.monotonic() >= deadline or isinstance(exc, urllib3.exceptions.TimeoutError) and not isinstance(
                exc, urllib3.exceptions.NewConnectionError):  # (urllib3 files a refused connection under timeouts)
            raise ImageInputError(f"{describe(url)}: not fetched within {policy.fetch_timeout:g}s") from None
        raise ImageInputError(f"{describe(url)}: unreachable ({type(exc).__name__})") from None


@contextlib.contextmanager
def _get(url: str, connect_to: str, seconds: float) -> Iterator[urllib3.BaseHTTPResponse]:
    """GET ``url`` over a connection to ``connect_to`` (an address or the URL's own host): the
    Host header, TLS server name and certificate check still use the URL's host. No proxy, no
    redirect followed, nothing read yet; the connection is closed on leaving. ``seconds``
    bounds the connection and each read."""
    parts = urllib.parse.urlsplit(url)
    pool_args = {"host": connect_to, "port": _port(parts), "retries": False,
                 "timeout": urllib3.Timeout(connect=seconds, read=seconds)}
    if parts.scheme.lower() == "https":
        pool = urllib3.HTTPSConnectionPool(**pool_args, server_hostname=parts.hostname,
                                           assert_hostname=parts.hostname, cert_reqs="CERT_REQUIRED",
                                           ca_certs=certifi.where())
    else:
        pool = urllib3.HTTPConnectionPool(**pool_args)
    target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    with pool, pool.urlopen("GET", target, headers={"Host": parts.netloc.rpartition("@")[2]}, redirect=False,
                            preload_content=False, release_conn=True) as resp:
        yield resp


def _data_uri(ref: str, max_bytes: int, kind: str = "image") -> bytes:
    header, sep, payload = ref.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ImageInputError(f"{describe(ref)}: data URI must be data:{kind}/...;base64,<payload>")
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageInputError(f"{describe(ref)}: larger than the {max_bytes}-byte limit")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{describe(ref)}: invalid base64 payload") from None
