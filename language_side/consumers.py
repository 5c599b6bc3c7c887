"""What happens to a finished embedding. The default reports its digest; an LM prefill
would implement the same interface and return generated text."""

from __future__ import annotations

from typing import Protocol

from connector.buffers import Embedding


class Consumer(Protocol):
    def consume(self, rid: str, embedding: Embedding) -> dict:
        """Use the embedding (valid only during the call) and return fields for the reply."""


class DigestConsumer:
    def consume(self, rid: str, embedding: Embedding) -> dict:
        return {"sha256": embedding.sha256()}
