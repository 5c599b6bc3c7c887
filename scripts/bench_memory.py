"""Resident memory of each worker over many requests of varied image sizes.

Starts an encode worker (SGLang's encoder) and SGLang's server as the language worker on the
seeded Qwen2.5-VL checkpoint (or ``--model-path``), sends ``--requests`` streamed chats one after
another, cycling image sizes (each image new: its embedding is not cached), and prints every
``--every`` requests the resident memory (RSS, the process and its children) of each worker. The
last line compares the growth after the first ``--settle`` requests with the target:

    bench_memory encode_growth_mib=<x> language_growth_mib=<y> target_mib=50 within_target=<bool>

    .venv/bin/python scripts/bench_memory.py                 # 1000 requests, about 15 minutes on 2 cores
    .venv/bin/python scripts/bench_memory.py --quick         # 160 requests
    .venv/bin/python scripts/bench_memory.py --quick --malloc-mmap-threshold 0   # glibc's own threshold
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import make_image  # noqa: E402

from harness.workers import SGLANG_LAUNCH, SGLANG_READY, WorkerProcess, tree_rss  # noqa: E402

SIZES = ((448, 448), (640, 480), (1024, 768))
TARGET_MIB = 50.0


def chat(url: str, index: int) -> None:
    """One streamed chat with a new image of the index's size (seeded by the index)."""
    width, height = SIZES[index % len(SIZES)]
    picture = io.BytesIO()
    make_image(width, height, seed=10_000 + index).save(picture, format="PNG")
    data = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
    body = {"model": "seeded", "max_tokens": 4, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data}},
                                                      {"type": "text", "text": "Describe it."}]}]}
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=300) as answer:
        if answer.status_code != 200:
            raise RuntimeError(f"request {index}: {answer.status_code} {answer.text[:300]}")
        for _ in answer.iter_lines():
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="a Qwen2.5-VL folder (default: the seeded one, width 3584)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--settle", type=int, default=100, help="requests before growth is counted")
    ap.add_argument("--every", type=int, default=50, help="requests between readings")
    ap.add_argument("--quick", action="store_true", help="160 requests, growth counted after 40")
    ap.add_argument("--malloc-mmap-threshold", default=None, metavar="BYTES",
                    help="both workers' flag (default theirs, 1 MiB; 0: glibc's moving threshold)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.settle, args.every = 160, 40, 20
    heap = () if args.malloc_mmap_threshold is None else ("--malloc-mmap-threshold", args.malloc_mmap_threshold)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_path or str(write_checkpoint(Path(tmp) / "seeded", 3584))
        encode = WorkerProcess("encode", "--model-path", folder, *heap, command=SGLANG_LAUNCH, timeout=300)
        try:
            language = WorkerProcess("language", "--model-path", folder, "--encoder-urls", encode.url,
                                     "--image-embedding-cache-bytes", "0", *heap, command=SGLANG_LAUNCH,
                                     ready=SGLANG_READY, timeout=300)
        except BaseException:
            encode.stop()
            raise
        try:
            readings: dict[int, tuple[float, float]] = {}
            started = time.monotonic()
            print("requests  encode_mib  language_mib  seconds", flush=True)
            for index in range(args.requests + 1):
                if index % args.every == 0 or index == args.settle:
                    readings[index] = (tree_rss(encode.proc.pid) / 2**20, tree_rss(language.proc.pid) / 2**20)
                    print(f"{index:8d}  {readings[index][0]:10.0f}  {readings[index][1]:12.0f}  "
                          f"{time.monotonic() - started:7.0f}", flush=True)
                if index < args.requests:
                    chat(language.url, index)
            last = max(readings)
            growth = [readings[last][side] - readings[args.settle][side] for side in (0, 1)]
            print(f"bench_memory encode_growth_mib={growth[0]:.0f} language_growth_mib={growth[1]:.0f} "
                  f"target_mib={TARGET_MIB:.0f} within_target={max(growth) < TARGET_MIB}")
        finally:
            language.stop()
            encode.stop()


if __name__ == "__main__":
    main()
