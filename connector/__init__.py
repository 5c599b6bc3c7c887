"""Resumable embedding transfer between an encode worker and a language worker.

This module is the connector's contract: the workers import what they use of it from here and
from nowhere else in the package (the modules behind it are the connector's own). Names resolve
on first use, so a process that needs one of them (SGLang's, loading the plugin) imports only its
module.

* rooms: ``EmbeddingSenderManager`` / ``EmbeddingSender`` (encode side), ``EmbeddingReceiverManager``
  / ``EmbeddingReceiver`` (language side), their progress as ``KVPoll``, why one failed as
  ``FailureKind`` / ``TransferFailure`` (HTTP status, wire reason);
* memory: ``BlockAllocator`` over a ``BufferPool`` of ``pool_blocks`` blocks, ``Embedding`` (rows and
  their digest, ``rows_sha256``), ``ByteBudget`` (host memory granted in arrival order);
* set-up: ``ConnectorConfig`` (its ``SETTINGS``, each a ``Setting``: flag, environment variable,
  default), ``worker_transport`` (the transfer engine a worker registers its pool with),
  ``BootstrapServer`` / ``RankRoute`` (where a room's peer is), ``health_status``;
* sleep and restart: ``checkpoint`` (the files), ``CheckpointError``, ``SenderRoomCheckpoint``,
  ``ReceiverCheckpoint``; ``checked_move`` (a state machine's one way to change state).

The wire format (fork-compatible ZMQ frames) is :mod:`connector.messages`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "AUX_INTS": "buffers", "DTYPE_SIZES": "buffers", "BufferPool": "buffers", "Embedding": "buffers",
    "rows_sha256": "buffers",
    "BlockAllocator": "allocator", "pool_blocks": "allocator",
    "BootstrapServer": "bootstrap", "BootstrapPortInUse": "bootstrap", "RankRoute": "bootstrap",
    "CheckpointError": "checkpoint",
    "SETTINGS": "config", "ConnectorConfig": "config", "Setting": "config",
    "FailureKind": "failures", "TransferFailure": "failures",
    "health_status": "peer_health",
    "KVPoll": "poll",
    "EmbeddingReceiver": "receiver", "EmbeddingReceiverManager": "receiver", "ReceiverCheckpoint": "receiver",
    "EmbeddingSender": "sender", "EmbeddingSenderManager": "sender", "SenderRoomCheckpoint": "sender",
    "ByteBudget": "staging",
    "checked_move": "transitions",
}
__all__ = [*_EXPORTS, "checkpoint", "worker_transport"]

if TYPE_CHECKING:
    from connector.config import ConnectorConfig
    from connector.transport import Transport


def __getattr__(name: str):  # noqa: ANN202 - one of the names above
    if name not in _EXPORTS:
        raise AttributeError(f"module 'connector' has no attribute {name!r}")
    return getattr(importlib.import_module(f"connector.{_EXPORTS[name]}"), name)


def worker_transport(config: ConnectorConfig) -> Transport:
    """The transfer engine a worker registers its pool with: Mooncake's, on the configured
    protocol and device."""
    from connector.mooncake_transport import MooncakeTransport

    return MooncakeTransport.for_worker(config)
