"""glibc's heap in a worker process: a fixed mmap threshold.

glibc serves an allocation above its mmap threshold with a mapping of its own, given back to
the system when freed; below it, from a heap that is only given back from its top. The
threshold starts at 128 KiB and rises to the size of each large block freed (up to 32 MiB), so
after the first images and embeddings (a few MB each) went through, later ones came from the
heaps, which fragment as sizes vary: a worker's resident memory grew by a few MB a request and
was never given back. A fixed threshold (set here, or by ``MALLOC_MMAP_THRESHOLD_``) stops the
rise: every buffer above it goes back to the system when freed.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)
ENV = "MALLOC_MMAP_THRESHOLD_"  # what glibc reads at a process's start
MAX_THRESHOLD = 32 << 20  # glibc's bound on 64-bit machines


def fix_mmap_threshold(nbytes: int) -> None:
    """Allocations above ``nbytes`` get mappings of their own from now on, in this process and in
    the processes it starts (the environment); 0 leaves glibc's moving threshold, and a threshold
    the environment sets already is kept."""
    if nbytes <= 0 or ENV in os.environ:
        return
    os.environ[ENV] = str(nbytes)  # SGLang's scheduler and detokenizer, spawned after this
    try:
        if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
            log.warning("mallopt(M_MMAP_THRESHOLD, %d) was refused: the heap keeps glibc's moving threshold", nbytes)
    except (OSError, AttributeError):  # not glibc: its allocator has its own rules
        pass


def give_back_free_pages() -> None:
    """Give the free pages inside every heap (each thread's arena included) back to the system:
    below the mmap threshold, freed blocks between live ones stay resident otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
