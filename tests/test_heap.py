"""A fixed mmap threshold (``worker_infra/heap.py``, ``--malloc-mmap-threshold``): in a fresh
process, as a worker sets it at its start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from harness.workers import ROOT

# glibc's threshold would rise to 4 MiB once a 4 MiB block was freed, and a 1.5 MiB buffer would
# then come from the heap; fixed at 1 MiB, it gets a mapping of its own (given back when freed).
# (Only a fresh process shows it: a heap with free space serves any size from that space first.)
PROBE = """
import ctypes, json, os, sys
from worker_infra import heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
heap.fix_mmap_threshold(int(sys.argv[1]))
libc.free(libc.malloc(4 << 20))
mapped = libc.mallinfo2().hblks
buffer = libc.malloc(3 << 19)
print(json.dumps({"mapped": libc.mallinfo2().hblks - mapped, "env": os.environ.get(heap.ENV)}))
"""


def probe(threshold: int, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(threshold)], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_fixed_mmap_threshold_gives_every_large_buffer_its_own_mapping() -> None:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | {"PYTHONPATH": str(ROOT)}
    assert probe(1 << 20, env) == {"mapped": 1, "env": str(1 << 20)}  # and what it spawns inherits it
    assert probe(0, env) == {"mapped": 0, "env": None}  # glibc's moving threshold: from the heap
    # the environment's own choice is kept
    assert probe(1 << 20, env | {"MALLOC_MMAP_THRESHOLD_": "8388608"}) == {"mapped": 0, "env": "8388608"}


# A thread's arena left with 128 MiB of free 64 KiB blocks under one live block: nothing can be
# given back from the top, so the pages stay resident until give_back_free_pages.
TRIM_PROBE = """
import ctypes, json, os, sys, threading
from worker_infra import heap

libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page / 2**20

def churn():
    blocks = [libc.malloc(64 << 10) for _ in range(2048)]
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:
        libc.free(b)

worker = threading.Thread(target=churn)
worker.start()
worker.join()
before = resident_mib()
heap.give_back_free_pages()
print(json.dumps({"before": before, "after": resident_mib()}))
"""


def test_free_pages_inside_the_heaps_go_back_to_the_system() -> None:
    done = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    resident = json.loads(done.stdout)
    assert resident["before"] - resident["after"] > 100, resident  # of the 128 MiB freed
