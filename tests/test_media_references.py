"""A media reference's scheme is case-insensitive, as URL schemes are: ``DATA:...;BASE64,`` is the
same image as ``data:...;base64,`` for the encode worker and for the language server's cache."""

from __future__ import annotations

import base64
import io

import pytest
from transfer_large_image import make_image

from embedding_side.images import MediaPolicy, fetch_image, is_remote
from language_side.embedding_cache import image_digest

pytestmark = pytest.mark.fast


def png_payload() -> str:
    buffer = io.BytesIO()
    make_image(32, 24, seed=5).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("prefix", ["DATA:image/png;BASE64,", "Data:image/png;Base64,", "data:IMAGE/PNG;base64,"])
def test_a_data_uri_in_any_case_is_the_same_image(prefix: str) -> None:
    payload = png_payload()
    lower = f"data:image/png;base64,{payload}"
    assert fetch_image(prefix + payload, MediaPolicy()) == fetch_image(lower, MediaPolicy())
    assert image_digest(prefix + payload) == image_digest(lower) is not None


def test_a_url_scheme_in_any_case_is_that_scheme() -> None:
    assert is_remote("HTTPS://img.example/a.png") and is_remote("Http://img.example/a.png")
    assert not is_remote("/data/HTTP:/a.png")
