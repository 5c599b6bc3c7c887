"""SGLang's ``cache_salt`` keeps tenants apart in the embedding caches as it does in SGLang's radix
cache: an entry written under one salt (or none) is never read under another, in process here
(a dictionary for Mooncake Store); tests/test_global_cache.py does it through the language servers'
native and OpenAI APIs over the real store."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from test_embedding_store import EVENTUALLY_S, store_backed_worker
from test_faults import wait_for
from transfer_large_image import make_image

from embedding_side.http_api import EncodeIn
from sglang_ext.mm_receiver import EmbeddingUnavailable, ResumableReceiver
from worker_infra.embedding_store import MAX_CACHE_SALT_CHARS, salted

pytestmark = pytest.mark.fast


def test_a_salt_gives_a_fingerprint_of_its_own_and_no_salt_the_encoders() -> None:
    assert salted("f" * 32, None) == salted("f" * 32, "") == "f" * 32
    tenants = {salted("f" * 32, salt) for salt in ("a", "b", "ab", "a " * 3)}
    assert len(tenants) == 4 and "f" * 32 not in tenants
    assert all(fingerprint.startswith("f" * 32 + ".") for fingerprint in tenants)
    assert salted("e" * 32, "a") != salted("f" * 32, "a")  # another encoder: another key still


def test_the_encode_api_takes_a_bounded_salt() -> None:
    assert EncodeIn(rid="r", bootstrap_room=1, images=["x"], cache_salt="tenant").cache_salt == "tenant"
    with pytest.raises(ValidationError):
        EncodeIn(rid="r", bootstrap_room=1, images=["x"], cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1))


def test_the_language_server_refuses_an_overlong_salt_before_any_encoder_is_asked() -> None:
    """A 400 from the language server itself (no dispatch exists here to be called)."""
    receiver = ResumableReceiver(None, None)
    request = SimpleNamespace(rid="r", audio_data=None, image_data=["a.png"], video_data=None,
                              cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1))
    with pytest.raises(EmbeddingUnavailable, match=f"cache_salt of {MAX_CACHE_SALT_CHARS + 1} characters, "
                                                   f"over the limit of {MAX_CACHE_SALT_CHARS}") as refused:
        asyncio.run(receiver.recv_mm_data(request, None, "prompt"))
    assert refused.value.status_code == 400


def test_an_entry_written_under_one_salt_is_never_reused_under_another(raw_language, raw_pool, tmp_path) -> None:
    """The encode worker's reuse of the cluster's entries: an image encoded with no salt, then by
    tenant a, then by tenant b, is encoded three times (three entries); tenant a's second request
    reuses its own entry."""
    worker, client, encoded = store_backed_worker(raw_language, raw_pool, tmp_path)
    image = str(tmp_path / "a.png")
    make_image(448, 448, seed=3).save(image)
    try:
        for room, (salt, entries) in enumerate([(None, 1), ("tenant-a", 2), ("tenant-b", 3)], start=1):
            assert encoded(room, [image], cache_salt=salt)["reused"] == 0, salt
            wait_for(lambda entries=entries: len(client.entries) == entries, EVENTUALLY_S, "the entry written")
        assert encoded(4, [image], cache_salt="tenant-a")["reused"] == 1
        assert worker.encoder.passes == [1, 1, 1]
        assert len({key.rsplit("/", 1)[1] for key in client.entries}) == 3  # one fingerprint per salt
    finally:
        worker.close()
