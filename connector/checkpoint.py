"""Worker checkpoints on disk: safetensors for arrays, JSON for the rest, one checksum over both.

Files in the checkpoint folder, per role (``encode`` or ``language``):
``{role}.safetensors``, ``{role}.json`` and ``{role}.sha256`` (sha256 of the JSON bytes
followed by the safetensors bytes). They are written to temporary names and renamed, the
checksum last, so a crash leaves either the old checkpoint or none. Loading verifies the
checksum, the format and the worker's geometry before returning anything; on any mismatch it
raises :class:`CheckpointError` and the caller has loaded nothing. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

FORMAT = "epd-resume-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why."""


def _paths(folder: Path, role: str) -> tuple[Path, Path, Path]:
    return folder / f"{role}.json", folder / f"{role}.safetensors", folder / f"{role}.sha256"


def exists(folder: str | Path, role: str) -> bool:
    return any(p.exists() for p in _paths(Path(folder), role))


def save(folder: str | Path, role: str, meta: dict, tensors: dict[str, np.ndarray]) -> int:
    """Write a checkpoint; returns its size in bytes."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"format": FORMAT, "role": role, **meta}, sort_keys=True).encode()
    blob = save_tensors({k: np.ascontiguousarray(v) for k, v in tensors.items()})
    digest = hashlib.sha256(body + blob).hexdigest().encode()
    for path, data in zip(_paths(folder, role), (body, blob, digest), strict=True):
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    return len(body) + len(blob)


def load(folder: str | Path, role: str, expect: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """Read and verify a checkpoint; ``expect`` holds meta fields that must match exactly."""
    json_path, tensor_path, sum_path = _paths(Path(folder), role)
    try:
        body, blob, digest = json_path.read_bytes(), tensor_path.read_bytes(), sum_path.read_bytes().strip()
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint in {folder} is incomplete: {Path(exc.filename).name} is missing") from None
    if hashlib.sha256(body + blob).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint in {folder} is corrupt or truncated (checksum mismatch)")
    try:
        meta = json.loads(body)
        tensors = load_tensors(blob)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint in {folder} cannot be parsed: {exc}") from None
    if meta.get("format") != FORMAT or meta.get("role") != role:
        raise CheckpointError(f"checkpoint in {folder} is {meta.get('format')!r} for role {meta.get('role')!r}, "
                              f"expected {FORMAT!r} for {role!r}")
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(f"checkpoint in {folder} was written with {key}={meta.get(key)!r}; "
                                  f"this worker has {key}={value!r}")
    return meta, tensors


def remove(folder: str | Path, role: str) -> None:
    for path in _paths(Path(folder), role):
        path.unlink(missing_ok=True)
