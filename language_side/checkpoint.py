"""The language worker's checkpoint on disk: its queued and half-received requests (each one's
rid, encoder, room, and for a transfer under way its route, progress and the rows that landed).
SGLang's own generations are checkpointed beside it by :mod:`sglang_ext.generations`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from connector import Embedding, RankRoute, ReceiverCheckpoint, checkpoint

ROLE = "language"


@dataclasses.dataclass
class SavedRequest:
    """One request as it stood at sleep: queued (``transfer is None``) or mid-transfer."""

    rid: str
    bootstrap_addr: str
    room: int
    transfer: ReceiverCheckpoint | None


def save(folder: str | Path, geometry: dict, requests: list[SavedRequest], zmq_port: int) -> int:
    """``zmq_port``: where this worker's connector listens. A worker restarted on the checkpoint
    listens there again, so encoders see its rooms' owner come back at the same endpoint."""
    entries, tensors = [], {}
    for i, req in enumerate(requests):
        entry = {"rid": req.rid, "bootstrap_addr": req.bootstrap_addr, "room": req.room, "transfer": None}
        t = req.transfer
        if t is not None:
            entry["transfer"] = {"landed": t.landed, "total_tokens": t.total_tokens, "resume_rounds": t.resume_rounds,
                                 "rank_ip": t.route.rank_ip, "rank_port": t.route.rank_port,
                                 "incarnation": t.route.incarnation}
            if t.aux is not None:
                tensors[f"{i}.aux"] = t.aux
            if t.landed:
                assert t.data is not None
                tensors.update(checkpoint.embedding_tensors(str(i), t.data, t.landed))
        entries.append(entry)
    return checkpoint.save(folder, ROLE, {**geometry, "requests": entries, "zmq_port": zmq_port}, tensors)


def stored_zmq_port(folder: str | Path) -> int:
    """The connector port of the worker that wrote the checkpoint (0 when unknown)."""
    port = checkpoint.peek(folder, ROLE, "zmq_port")
    return port if isinstance(port, int) and 0 < port < 65536 else 0


def load(folder: str | Path, geometry: dict) -> list[SavedRequest]:
    """Verified requests of a checkpoint, or :class:`CheckpointError` (nothing half-loaded)."""
    meta, tensors = checkpoint.load(folder, ROLE, geometry)
    return checkpoint.parse_entries(folder, meta, tensors, "requests", lambda i, e, t: _request(i, e, t, geometry))


def _request(i: int, entry: dict, tensors: dict[str, np.ndarray], geometry: dict) -> SavedRequest:
    t = entry["transfer"]
    transfer = None
    if t is not None:
        landed, total = int(t["landed"]), t["total_tokens"]
        data = None
        if landed:
            data = Embedding.empty(int(total), geometry["hidden_size"], geometry["dtype"])
            checkpoint.fill_embedding(tensors, str(i), data, landed)
        aux = tensors.get(f"{i}.aux")
        transfer = ReceiverCheckpoint(int(entry["room"]), str(entry["bootstrap_addr"]),
                                      RankRoute(str(t["rank_ip"]), int(t["rank_port"]), t.get("incarnation")), landed,
                                      None if total is None else int(total), aux, int(t["resume_rounds"]), data)
    return SavedRequest(str(entry["rid"]), str(entry["bootstrap_addr"]), int(entry["room"]), transfer)
