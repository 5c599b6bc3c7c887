"""What happens to a finished embedding: its digest only (transfer-only serving), or a copy
for the language engine."""

from __future__ import annotations

from typing import Protocol

from connector import Embedding, rows_sha256


class Consumer(Protocol):
    def consume(self, rid: str, embedding: Embedding) -> dict:
        """Use the embedding (valid only during the call) and return fields for the reply."""


class DigestConsumer:
    def consume(self, rid: str, embedding: Embedding) -> dict:
        return {"sha256": embedding.sha256()}


class EmbeddingCopy:
    """For SGLang's server: the embedding's rows and positions copied out of the pool, so its
    blocks come back as soon as it has landed rather than after the prefill."""

    def consume(self, rid: str, embedding: Embedding) -> dict:
        rows = embedding.embeddings.copy()
        # The digest of the copy, not of the pool: bytes that land in these blocks late (a write
        # Mooncake gave up on, docs/failure_bounds.md) then fail the end-to-end check instead of
        # reaching SGLang unchecked.
        return {"sha256": rows_sha256(rows), "embedding": rows, "mrope_positions": embedding.mrope_positions.copy()}
