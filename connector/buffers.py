"""Registered block pools for embeddings and their side data.

A pool holds ``num_blocks`` blocks of ``block_size`` tokens in four buffers, allocated once
and registered once (order matters on the wire: the fork's ``MultimodalDataBuffers``):

===  ================  =========  ===============================
idx  buffer            dtype      bytes per block (item_len)
===  ================  =========  ===============================
0    embeddings        model's    block_size * hidden * itemsize
1    fill_ids          int32      block_size * 4
2    mrope_positions   int32      3 * block_size * 4
3    aux               int32      16 * 4
===  ================  =========  ===============================

Block ``b`` of buffer ``i`` lives at ``base_ptrs[i] + b * item_lens[i]``. In a partly filled
block of ``n`` tokens every buffer holds its first ``item_len * n / block_size`` bytes; M-RoPE
positions of such a block are laid out ``[3, n]``. ``aux[0]`` is the request's total tokens,
``aux[1]`` the M-RoPE delta; it travels with the first block of the first round only.

Where CUDA is present the embedding buffer is page-locked (``cudaHostRegister``), so that the
encoder's copy from the GPU into its blocks and a copy from received blocks to the GPU run at
DMA speed (an H200: 1.4 ms for 75.6 MB pinned, 11.3 ms pageable); on a machine without CUDA
it is plain memory.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

AUX_INTS = 16
DTYPE_SIZES = {"bfloat16": 2, "float16": 2, "float32": 4}


def rows_sha256(rows: np.ndarray) -> str:
    """The end-to-end digest of an embedding's rows (its bytes, row-major): both sides compare it."""
    return hashlib.sha256(memoryview(np.ascontiguousarray(rows))).hexdigest()


@dataclass
class Embedding:
    """One request's embedding, contiguous and in token order.

    ``embeddings`` holds the raw bytes of a row-major ``[num_tokens, hidden]`` tensor of
    ``dtype`` (numpy has no bfloat16, so rows are kept as bytes).
    """

    embeddings: np.ndarray  # uint8 [num_tokens, hidden * itemsize]
    fill_ids: np.ndarray  # int32 [num_tokens]
    mrope_positions: np.ndarray  # int32 [3, num_tokens]
    aux: np.ndarray  # int32 [16]
    hidden_size: int
    dtype: str
    # Set when the arrays are views into a pool: returns the blocks behind them. Call
    # release() once the embedding has been consumed; it is a no-op for owned arrays.
    release_fn: Callable[[], None] | None = None

    def release(self) -> None:
        fn, self.release_fn = self.release_fn, None
        if fn is not None:
            fn()

    @classmethod
    def empty(cls, num_tokens: int, hidden_size: int, dtype: str) -> Embedding:
        return cls(np.empty((num_tokens, hidden_size * DTYPE_SIZES[dtype]), np.uint8),
                   np.empty(num_tokens, np.int32), np.empty((3, num_tokens), np.int32),
                   np.zeros(AUX_INTS, np.int32), hidden_size, dtype)

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]

    def sha256(self) -> str:
        """Digest of the embedding bytes, row-major ``[num_tokens, hidden]``."""
        return rows_sha256(self.embeddings)

    def digests(self) -> dict[str, str]:
        """Digests of every part, for end-to-end checks."""
        parts = {"fill_ids": self.fill_ids, "mrope_positions": self.mrope_positions, "aux": self.aux}
        out = {name: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for name, a in parts.items()}
        out["embeddings"] = self.sha256()
        return out


class BufferPool:
    """The four block buffers of one worker; see the module docstring for the layout."""

    def __init__(self, num_blocks: int, block_size: int, hidden_size: int, dtype: str = "bfloat16",
                 prefault: bool = True, pinned: bool | None = None) -> None:
        """``prefault=False`` returns at once; call :meth:`prefault_in_background` then (wake-up).
        ``pinned``: page-lock the embedding buffer for CUDA; None: where CUDA is present."""
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_SIZES)}, got {dtype!r}")
        if min(num_blocks, block_size, hidden_size) <= 0:
            raise ValueError("num_blocks, block_size and hidden_size must be positive")
        self.num_blocks, self.block_size, self.hidden_size, self.dtype = num_blocks, block_size, hidden_size, dtype
        self.row_bytes = hidden_size * DTYPE_SIZES[dtype]
        self.embeddings = np.empty((num_blocks, block_size * self.row_bytes), np.uint8)
        self.fill_ids = np.empty((num_blocks, block_size), np.int32)
        self.mrope = np.empty((num_blocks, 3 * block_size), np.int32)
        self.aux = np.empty((num_blocks, AUX_INTS), np.int32)
        for buf in self.buffers[1:]:  # small: zero them
            buf.fill(0)
        self.pinned = cuda_present() if pinned is None else pinned
        if self.pinned and not cuda_present():
            raise ValueError("a pinned pool needs CUDA (torch with a visible GPU); none is present")
        if prefault:  # fault every page in now, not during the first transfers
            if not _populate(self.embeddings):
                self.embeddings.fill(0)
            self._pin()

    def prefault_in_background(self) -> None:
        """Fault the embedding pages in (and pin them) on a thread, leaving their contents alone,
        so a wake-up does not wait for the kernel to hand over the whole pool (transfers may
        already run: neither the fault-in nor pinning writes a byte; where the kernel cannot
        fault them in, the first writes do)."""
        threading.Thread(target=lambda: (_populate(self.embeddings), self._pin()), name="pool-prefault",
                         daemon=True).start()

    def _pin(self) -> None:
        if self.pinned:
            _pin(self.embeddings)

    @property
    def buffers(self) -> tuple[np.ndarray, ...]:
        return self.embeddings, self.fill_ids, self.mrope, self.aux

    @property
    def base_ptrs(self) -> tuple[int, ...]:
        return tuple(b.ctypes.data for b in self.buffers)

    @property
    def item_lens(self) -> tuple[int, ...]:
        return tuple(b.strides[0] for b in self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @staticmethod
    def bytes_for(num_blocks: int, block_size: int, hidden_size: int, dtype: str) -> int:
        per_block = block_size * (hidden_size * DTYPE_SIZES[dtype] + 4 + 12) + AUX_INTS * 4
        return num_blocks * per_block

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def write(self, block_ids: list[int], emb: Embedding) -> None:
        """Scatter a whole embedding into ``block_ids`` (encode side), aux into the first block."""
        self._check(block_ids, emb.num_tokens, emb)
        self._copy(block_ids, emb, 0, emb.num_tokens, to_pool=True)
        self.aux[block_ids[0]] = emb.aux

    def read_into(self, block_ids: list[int], out: Embedding, start: int, num_tokens: int) -> None:
        """Copy ``num_tokens`` from ``block_ids`` into ``out`` at token ``start`` (one copy)."""
        if self.blocks_for(num_tokens) != len(block_ids) or start + num_tokens > out.num_tokens:
            raise ValueError(f"{len(block_ids)} blocks cannot hold tokens [{start}, {start + num_tokens}) of {out.num_tokens}")
        self._copy(block_ids, out, start, num_tokens, to_pool=False)

    def view(self, block_ids: list[int], num_tokens: int) -> Embedding | None:
        """A zero-copy embedding over ``block_ids`` when they are one run of consecutive ids.

        Embeddings and fill ids are views into the pool; M-RoPE positions are re-laid out
        ``[3, n]`` (12 bytes a token) and copied. ``None`` when the blocks are not one run.
        """
        if self.blocks_for(num_tokens) != len(block_ids) or len(_runs(block_ids, num_tokens, self.block_size)) != 1:
            return None
        first, nb = block_ids[0], len(block_ids)
        emb = Embedding(self.embeddings[first:first + nb].reshape(-1)[: num_tokens * self.row_bytes].reshape(num_tokens, -1),
                        self.fill_ids[first:first + nb].reshape(-1)[:num_tokens],
                        np.empty((3, num_tokens), np.int32), np.zeros(AUX_INTS, np.int32), self.hidden_size, self.dtype)
        full, rem = divmod(num_tokens, self.block_size)
        mrope = self.mrope[first:first + nb]
        if full:
            emb.mrope_positions[:, : full * self.block_size] = mrope[:full].reshape(full, 3, -1).transpose(1, 0, 2).reshape(3, -1)
        if rem:
            emb.mrope_positions[:, full * self.block_size:] = mrope[full, : 3 * rem].reshape(3, rem)
        return emb

    def _copy(self, block_ids: list[int], emb: Embedding, start: int, num_tokens: int, to_pool: bool) -> None:
        """Copy between blocks and ``emb[start:start + num_tokens]``, one slice copy per run of
        consecutive block ids (memcpy speed; fancy indexing is several times slower)."""
        b = self.block_size
        for first_block, first_tok, n_tok in _runs(block_ids, num_tokens, b):
            full, rem = divmod(n_tok, b)
            nb = full + (rem > 0)
            tok = slice(start + first_tok, start + first_tok + n_tok)
            pool_emb = self.embeddings[first_block:first_block + nb].reshape(-1)[: n_tok * self.row_bytes]
            pool_fill = self.fill_ids[first_block:first_block + nb].reshape(-1)[:n_tok]
            if to_pool:
                pool_emb[:] = emb.embeddings[tok].reshape(-1)
                pool_fill[:] = emb.fill_ids[tok]
            else:
                emb.embeddings[tok] = pool_emb.reshape(n_tok, -1)
                emb.fill_ids[tok] = pool_fill
            # M-RoPE is [3, block_size] per full block and [3, n] in a partial one.
            mrope = self.mrope[first_block:first_block + nb]
            full_tok = slice(tok.start, tok.start + full * b)
            tail_tok = slice(full_tok.stop, tok.stop)
            if to_pool:
                if full:
                    mrope[:full] = emb.mrope_positions[:, full_tok].reshape(3, full, b).transpose(1, 0, 2).reshape(full, -1)
                if rem:
                    mrope[full, : 3 * rem] = emb.mrope_positions[:, tail_tok].reshape(-1)
            else:
                if full:
                    emb.mrope_positions[:, full_tok] = mrope[:full].reshape(full, 3, b).transpose(1, 0, 2).reshape(3, -1)
                if rem:
                    emb.mrope_positions[:, tail_tok] = mrope[full, : 3 * rem].reshape(3, rem)

    def _check(self, block_ids: list[int], num_tokens: int, emb: Embedding) -> None:
        if emb.hidden_size != self.hidden_size or emb.dtype != self.dtype:
            raise ValueError(f"embedding is {emb.hidden_size}x{emb.dtype}, pool is {self.hidden_size}x{self.dtype}")
        if self.blocks_for(num_tokens) != len(block_ids):
            raise ValueError(f"{num_tokens} tokens need {self.blocks_for(num_tokens)} blocks, got {len(block_ids)}")


def _runs(block_ids: list[int], num_tokens: int, block_size: int) -> list[tuple[int, int, int]]:
    """``(first block id, first token, tokens)`` for each run of consecutive block ids."""
    ids = np.asarray(block_ids, np.int64)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(ids) != 1) + 1))
    ends = np.concatenate((starts[1:], [len(ids)]))
    return [(int(ids[s]), int(s) * block_size, min(int(e) * block_size, num_tokens) - int(s) * block_size)
            for s, e in zip(starts, ends, strict=True)]


GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's (ROCm's torch answers torch.cuda)


def cuda_present() -> bool:
    """Whether this process can page-lock memory for CUDA: torch installed and a GPU visible. A
    machine without a GPU driver answers without importing torch (2 s of CPU for a process that
    has no other use for it: the transfer-only receiver, the fake encoder)."""
    if "torch" not in sys.modules and not any(os.path.exists(path) for path in GPU_DRIVER_FILES):
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _pin(buf: np.ndarray) -> None:
    """Page-lock ``buf`` for CUDA until it is freed (unregistered just before its memory goes)."""
    import torch

    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(buf.ctypes.data, buf.nbytes, 0)
    if error != cudart.cudaError.success:
        raise RuntimeError(f"cudaHostRegister of {buf.nbytes} bytes failed: {cudart.cudaGetErrorString(error)}")
    # numpy calls an array's weakref callbacks before it frees the array's memory
    weakref.finalize(buf, cudart.cudaHostUnregister, buf.ctypes.data)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without touching their contents
_libc = ctypes.CDLL(None, use_errno=True)


def _populate(buf: np.ndarray) -> bool:
    """Fault every page of ``buf`` in; False where the kernel cannot (the caller may fill instead)."""
    start = buf.ctypes.data & ~4095
    length = buf.ctypes.data + buf.nbytes - start
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0
