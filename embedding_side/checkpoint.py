"""The encode worker's checkpoint on disk: each live room's source embedding and its progress."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from connector import AUX_INTS, CheckpointError, Embedding, SenderRoomCheckpoint, checkpoint

ROLE = "encode"


def save(folder: str | Path, geometry: dict, rooms: list[SenderRoomCheckpoint]) -> int:
    entries, tensors = [], {}
    for i, saved in enumerate(rooms):
        entries.append({"room": saved.room, "sent_tokens": saved.sent_tokens, "total_tokens": saved.data.num_tokens,
                        "destinations": saved.destinations})
        tensors.update(checkpoint.embedding_tensors(str(i), saved.data, saved.data.num_tokens))
        tensors[f"{i}.aux"] = saved.data.aux
    return checkpoint.save(folder, ROLE, {**geometry, "rooms": entries}, tensors)


def load(folder: str | Path, geometry: dict) -> list[SenderRoomCheckpoint]:
    """Verified rooms of a checkpoint, or :class:`CheckpointError` (nothing half-loaded)."""
    rooms = checkpoint.load_entries(folder, ROLE, geometry, "rooms", lambda i, e, t: _room(i, e, t, geometry))
    if len({saved.room for saved in rooms}) != len(rooms):
        raise CheckpointError(f"checkpoint in {folder} lists a room twice")
    return rooms


def _room(i: int, entry: dict, tensors: dict[str, np.ndarray], geometry: dict) -> SenderRoomCheckpoint:
    room, sent, total = int(entry["room"]), int(entry["sent_tokens"]), int(entry["total_tokens"])
    destinations = int(entry["destinations"])
    if not 0 <= sent < total or destinations < 0:
        raise ValueError(f"room {room}: sent_tokens {sent} outside [0, {total}) or {destinations} destinations")
    data = Embedding.empty(total, geometry["hidden_size"], geometry["dtype"])
    checkpoint.fill_embedding(tensors, str(i), data, total)
    aux = tensors[f"{i}.aux"]
    if aux.shape != (AUX_INTS,) or aux.dtype != np.int32:
        raise ValueError(f"tensor {i}.aux is {aux.shape} {aux.dtype}, expected ({AUX_INTS},) int32")
    data.aux[:] = aux
    return SenderRoomCheckpoint(room, sent, data, destinations)
