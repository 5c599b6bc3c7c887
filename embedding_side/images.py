"""Image inputs: local paths, file://, http(s):// and data: URIs; PNG, JPEG and WebP only.

Every failure is an :class:`ImageInputError` whose message says what was wrong with which
input (and never echoes file contents or the full data URI).
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from pathlib import Path

import requests
from PIL import Image, UnidentifiedImageError

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")
DEFAULT_MAX_BYTES = 64 << 20
DEFAULT_TIMEOUT_S = 10.0
# A decompression bomb guard well above 4K (8.3 Mpx) but far below what would exhaust memory.
Image.MAX_IMAGE_PIXELS = 20_000 * 20_000


class ImageInputError(ValueError):
    """An image reference that cannot be loaded; maps to HTTP 400."""


def describe(ref: str) -> str:
    """A short, safe name for an input in error messages."""
    return ref[:40] + "..." if ref.startswith("data:") else ref[:200]


def load_image(ref: str, max_bytes: int = DEFAULT_MAX_BYTES, timeout: float = DEFAULT_TIMEOUT_S) -> Image.Image:
    """Fetch and decode one image reference into an RGB Pillow image."""
    if not isinstance(ref, str) or not ref:
        raise ImageInputError("each image must be a non-empty string (path, file://, http(s):// or data: URI)")
    data = _fetch(ref, max_bytes, timeout)
    try:
        img = Image.open(io.BytesIO(data))
        if img.format not in ALLOWED_FORMATS:
            raise ImageInputError(f"{describe(ref)}: format {img.format} not supported (use PNG, JPEG or WebP)")
        img.load()
    except ImageInputError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageInputError(f"{describe(ref)}: not a decodable PNG, JPEG or WebP image ({type(exc).__name__})") from None
    return img.convert("RGB")


def _fetch(ref: str, max_bytes: int, timeout: float) -> bytes:
    scheme = urllib.parse.urlsplit(ref).scheme.lower() if "://" in ref or ref.startswith("data:") else ""
    if scheme == "data":
        return _data_uri(ref, max_bytes)
    if scheme in ("http", "https"):
        return _http(ref, max_bytes, timeout)
    if scheme == "file":
        return _read_file(Path(urllib.parse.unquote(urllib.parse.urlsplit(ref).path)), ref, max_bytes)
    if scheme:
        raise ImageInputError(f"{describe(ref)}: unsupported scheme {scheme!r} (use a path, file://, http(s):// or data:)")
    return _read_file(Path(ref), ref, max_bytes)


def _read_file(path: Path, ref: str, max_bytes: int) -> bytes:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ImageInputError(f"{describe(ref)}: {size} bytes exceeds the {max_bytes}-byte limit")
        return path.read_bytes()
    except ImageInputError:
        raise
    except OSError as exc:
        raise ImageInputError(f"{describe(ref)}: cannot read file ({exc.strerror or type(exc).__name__})") from None


def _http(url: str, max_bytes: int, timeout: float) -> bytes:
    try:
        with requests.get(url, stream=True, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise ImageInputError(f"{describe(url)}: HTTP {resp.status_code}")
            chunks, total = [], 0
            for chunk in resp.iter_content(1 << 16):
                total += len(chunk)
                if total > max_bytes:
                    raise ImageInputError(f"{describe(url)}: larger than the {max_bytes}-byte limit")
                chunks.append(chunk)
            return b"".join(chunks)
    except requests.Timeout:
        raise ImageInputError(f"{describe(url)}: no answer within {timeout:g}s") from None
    except requests.RequestException as exc:
        raise ImageInputError(f"{describe(url)}: unreachable ({type(exc).__name__})") from None


def _data_uri(ref: str, max_bytes: int) -> bytes:
    header, sep, payload = ref.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageInputError(f"{describe(ref)}: data URI must be data:image/...;base64,<payload>")
    if len(payload) * 3 // 4 > max_bytes:
        raise ImageInputError(f"{describe(ref)}: larger than the {max_bytes}-byte limit")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError(f"{describe(ref)}: invalid base64 payload") from None
