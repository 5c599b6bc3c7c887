"""Worker checkpoints on disk: safetensors for arrays, JSON for the rest, one checksum over both.

Files in the checkpoint folder, per role (``encode`` or ``language``):
``{role}.safetensors``, ``{role}.json`` and ``{role}.sha256`` (sha256 of the JSON bytes
followed by the safetensors bytes). They are written to temporary names and renamed, the
checksum last, so a crash leaves the old checkpoint, a damaged one (refused: checksum) or none.
The safetensors file is written array by array, hashed on the way (a gigabyte of KV is never
joined into one more buffer); ``safetensors`` itself reads it back. Loading verifies the
checksum, the format and the worker's geometry before returning anything; on any mismatch it
raises :class:`CheckpointError` and the caller has loaded nothing. Nothing is pickled.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import numpy as np
from safetensors.numpy import load as load_tensors

from connector.buffers import Embedding

log = logging.getLogger(__name__)

FORMAT = "epd-resume-checkpoint/1"
T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says why."""


def _paths(folder: Path, role: str) -> tuple[Path, Path, Path]:
    return folder / f"{role}.json", folder / f"{role}.safetensors", folder / f"{role}.sha256"


def exists(folder: str | Path, role: str) -> bool:
    return any(p.exists() for p in _paths(Path(folder), role))


def peek(folder: str | Path, role: str, key: str) -> object:
    """One field of a checkpoint's JSON, unverified (None when missing or unreadable): for a hint
    a worker needs before it loads the checkpoint, never for its data."""
    try:
        meta = json.loads(_paths(Path(folder), role)[0].read_bytes())
        return meta.get(key) if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


_SAFETENSORS_DTYPES = {np.dtype(t): name for t, name in [
    (np.bool_, "BOOL"), (np.uint8, "U8"), (np.int8, "I8"), (np.uint16, "U16"), (np.int16, "I16"), (np.uint32, "U32"),
    (np.int32, "I32"), (np.uint64, "U64"), (np.int64, "I64"), (np.float16, "F16"), (np.float32, "F32"),
    (np.float64, "F64")]}


def save(folder: str | Path, role: str, meta: dict, tensors: dict[str, np.ndarray]) -> int:
    """Write a checkpoint; returns its size in bytes. All three files go to temporary names
    first and are renamed only once all are on disk (the checksum last): a failure on the way
    (disk full, an array safetensors has no dtype for) leaves the previous checkpoint whole."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    body = json.dumps({"format": FORMAT, "role": role, **meta}, sort_keys=True).encode()
    # widest elements first, as safetensors lays them out: every array starts aligned
    tensors = dict(sorted(tensors.items(), key=lambda item: (-item[1].dtype.itemsize, item[0])))
    header = _safetensors_header(tensors)
    arrays = (memoryview(np.require(a, requirements="C").reshape(-1).view(np.uint8)) for a in tensors.values())
    hasher = hashlib.sha256(body)
    paths = _paths(folder, role)
    temporary = [path.with_suffix(path.suffix + ".tmp") for path in paths]
    try:
        size = _write(temporary[0], [body]) + _write(temporary[1], itertools.chain([header], arrays), hasher)
        _write(temporary[2], [hasher.hexdigest().encode()])
    except BaseException:
        for tmp in temporary:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in zip(temporary, paths, strict=True):
        tmp.replace(path)
    return size


def _write(path: Path, chunks: Iterable[bytes | memoryview], hasher: hashlib._Hash | None = None) -> int:
    """``chunks`` to ``path``, on disk (fsync); the bytes written (fed to ``hasher`` on the way)."""
    written = 0
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
            if hasher is not None:
                hasher.update(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return written


def _safetensors_header(tensors: dict[str, np.ndarray]) -> bytes:
    """The start of a safetensors file holding ``tensors`` in their order: the JSON header's
    length, then the header (dtype, shape and byte range per array, padded to 8 bytes); the
    arrays' bytes follow."""
    header, offset = {}, 0
    for name, array in tensors.items():
        if array.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: no safetensors dtype for {array.dtype}")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _digest(body: bytes, blob: bytes) -> bytes:
    """sha256 of the JSON bytes then the tensor bytes (fed in turn: no joined copy of the blob)."""
    h = hashlib.sha256(body)
    h.update(blob)
    return h.hexdigest().encode()


def save_or_explain(folder: str | Path, write: Callable[[], int]) -> tuple[int | None, str]:
    """Run a checkpoint ``write``; an ``OSError`` (disk full, bad folder) becomes a message.

    The worker still holds everything in host memory, so sleep goes on: only a restart
    would lose the requests. Returns the bytes written (None on error) and the message.
    """
    try:
        return write(), ""
    except OSError as exc:
        why = f"checkpoint not written to {folder}: {exc}"
        log.error("%s; the requests are kept in host memory only", why)
        return None, why


def load(folder: str | Path, role: str, expect: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """Read and verify a checkpoint; ``expect`` holds meta fields that must match exactly."""
    json_path, tensor_path, sum_path = _paths(Path(folder), role)
    try:
        body, blob, digest = json_path.read_bytes(), tensor_path.read_bytes(), sum_path.read_bytes().strip()
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint in {folder} is incomplete: {Path(exc.filename).name} is missing") from None
    if _digest(body, blob) != digest:
        raise CheckpointError(f"checkpoint in {folder} is corrupt or truncated (checksum mismatch)")
    try:
        meta = json.loads(body)
        tensors = load_tensors(blob)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint in {folder} cannot be parsed: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint in {folder} is not a JSON object")
    if meta.get("format") != FORMAT or meta.get("role") != role:
        raise CheckpointError(f"checkpoint in {folder} is {meta.get('format')!r} for role {meta.get('role')!r}, "
                              f"expected {FORMAT!r} for {role!r}")
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(f"checkpoint in {folder} was written with {key}={meta.get(key)!r}; "
                                  f"this worker has {key}={value!r}")
    return meta, tensors


def load_entries(folder: str | Path, role: str, expect: dict, key: str,
                 parse: Callable[[int, dict, dict[str, np.ndarray]], T]) -> list[T]:
    """Load a checkpoint whose JSON lists its entries under ``key`` (see :func:`parse_entries`)."""
    meta, tensors = load(folder, role, expect)
    return parse_entries(folder, meta, tensors, key, parse)


def parse_entries(folder: str | Path, meta: dict, tensors: dict[str, np.ndarray], key: str,
                  parse: Callable[[int, dict, dict[str, np.ndarray]], T]) -> list[T]:
    """The entries listed under ``key``: ``parse(i, entry, tensors)`` builds one and raises
    ``KeyError``/``TypeError``/``ValueError`` on a malformed one, which becomes a
    :class:`CheckpointError` for the whole checkpoint."""
    try:
        return [parse(i, entry, tensors) for i, entry in enumerate(meta[key])]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint in {folder} has a malformed entry in {key!r}: {exc!r}") from None


def remove(folder: str | Path, role: str) -> None:
    for path in _paths(Path(folder), role):
        if path.exists():  # False, not an error, when the folder itself could not be made
            path.unlink()


def embedding_tensors(prefix: str, emb: Embedding, upto: int) -> dict[str, np.ndarray]:
    """The first ``upto`` tokens of ``emb`` as named arrays (``{prefix}.embeddings`` and so on)."""
    return {f"{prefix}.embeddings": emb.embeddings[:upto], f"{prefix}.fill_ids": emb.fill_ids[:upto],
            f"{prefix}.mrope_positions": emb.mrope_positions[:, :upto]}


def fill_embedding(tensors: dict[str, np.ndarray], prefix: str, emb: Embedding, upto: int) -> None:
    """Copy the arrays :func:`embedding_tensors` named into the first ``upto`` tokens of ``emb``.

    Raises ``ValueError`` when one is missing or has another shape or dtype.
    """
    for name, target in embedding_tensors(prefix, emb, upto).items():
        array = tensors.get(name)
        if array is None:
            raise ValueError(f"tensor {name} is missing")
        if array.shape != target.shape or array.dtype != target.dtype:
            raise ValueError(f"tensor {name} is {array.shape} {array.dtype}, expected {target.shape} {target.dtype}")
        target[...] = array
