"""Resumable embedding transfer between an encode worker and a language worker.

The public contract lives in a few modules:

* :mod:`connector.poll` -- ``KVPoll`` and the per-room progress state machine.
* :mod:`connector.messages` -- the ZMQ wire format (fork-compatible frames).
* :mod:`connector.allocator` / :mod:`connector.buffers` -- block pools.
* :mod:`connector.transport` -- the byte mover interface; :mod:`connector.mooncake_transport`
  is the Mooncake Transfer Engine backend.
* :mod:`connector.sender` (encode side) and :mod:`connector.receiver` (language side).
* :mod:`connector.failures` -- why a room failed (``FailureKind``), as HTTP status and on the wire.
"""

from connector.poll import KVPoll

__all__ = ["KVPoll"]
