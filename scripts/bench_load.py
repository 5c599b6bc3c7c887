"""Throughput and latency of an encode/language pair under concurrent load.

Starts an encode worker (SGLang's encoder on the seeded Qwen2.5-VL checkpoint, width 3584, one
layer, unless ``--model-path``: a small tower, so the numbers are mostly the connector's) and a
transfer-only language worker with the default pools, then, for each concurrency level ``c``, keeps ``c``
request pairs in flight until ``max(c, --min-requests)`` have been sent. Each pair is a
router's: ``/encode`` and ``/generate`` for one image of a random size (448x448 to 3840x2160),
the two calls in random order. One more row runs the highest level against a second language
worker with a small pool (``--small-pool`` blocks, fewer than one default allocation per
request in flight), where flow control, not the pool, decides the pace.

Per row: requests completed (both 200, digests equal), images/s and GB/s of embeddings
delivered over the row's wall time, and the p50/p99 of the pair's latency (from the first
call sent to the last answer). Writes the rows as JSON with ``--json``. The last line is
``load_<c>_completed=<n>/<c>`` for the highest level on the default pools.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transfer_large_image import make_image, run_request  # noqa: E402

from harness.workers import WorkerProcess, embedding_width  # noqa: E402

SIZES = [(448, 448), (1000, 300), (1024, 768), (1920, 1080), (2048, 2048), (3840, 2160)]


def run_level(encode: WorkerProcess, language: WorkerProcess, images: list[str], concurrency: int, total: int,
              seed: int, timeout: float) -> dict:
    """``total`` request pairs, at most ``concurrency`` in flight; one row of the table."""
    rng = random.Random(seed)
    jobs = [(rng.choice(images), rng.random() < 0.5, rng.getrandbits(40)) for _ in range(total)]
    done = []
    lock = threading.Lock()

    def one(i: int) -> dict:
        path, encode_first, room = jobs[i]
        res = run_request(encode.url, language.url, encode.bootstrap_port, f"bench-{seed}-{i}", room, [path], timeout,
                          encode_first=encode_first)
        with lock:
            done.append(res)
            if sys.stderr.isatty():
                print(f"\r  c={concurrency}: {len(done)}/{total}", end="", file=sys.stderr, flush=True)
        return res

    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(total)))
    wall = time.monotonic() - start
    if sys.stderr.isatty():
        print("\r" + " " * 30 + "\r", end="", file=sys.stderr)
    ok = [r for r in results if r["match"]]
    latencies = np.array([r["total_ms"] for r in ok]) if ok else np.array([np.nan])
    errors = sorted({f"{r['encode_status']}/{r['language_status']}" for r in results if not r["match"]})
    return {"concurrency": concurrency, "requests": total, "completed": len(ok),
            "images_per_s": round(len(ok) / wall, 2), "gb_per_s": round(sum(r["bytes"] for r in ok) / wall / 1e9, 3),
            "p50_ms": round(float(np.percentile(latencies, 50)), 1),
            "p99_ms": round(float(np.percentile(latencies, 99)), 1), "wall_s": round(wall, 2), "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,16,64", help="levels, comma-separated (default %(default)s)")
    ap.add_argument("--min-requests", type=int, default=16, help="requests per level at least (default %(default)s)")
    ap.add_argument("--small-pool", type=int, default=96,
                    help="blocks of the second language worker's pool, 0 for no such row (default %(default)s)")
    ap.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZES),
                    help="image sizes to draw from (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="per call, seconds (default %(default)s)")
    ap.add_argument("--model-path", help="the encoder's checkpoint (default: the seeded Qwen2.5-VL, width 3584, "
                                         "written to a temp folder)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]

    tmp = tempfile.TemporaryDirectory(prefix="epd-bench-load-")
    images = []
    for i, (w, h) in enumerate(sizes):
        images.append(str(Path(tmp.name) / f"{w}x{h}.png"))
        make_image(w, h, seed=500 + i).save(images[-1])
    started: list[WorkerProcess] = []
    rows = []
    try:
        folder = args.model_path
        if folder is None:
            from make_checkpoint import write_checkpoint

            print("writing the seeded checkpoint ...", file=sys.stderr, flush=True)
            folder = str(write_checkpoint(Path(tmp.name) / "seeded", 3584))
        print("starting the workers ...", file=sys.stderr, flush=True)
        width = ("--hidden-size", str(embedding_width(folder)))
        encode = WorkerProcess("encode", "--model-path", folder)
        language = WorkerProcess("language", *width)
        started += [encode, language]
        runs = [(language, "default", c) for c in levels]
        if args.small_pool:
            small = WorkerProcess("language", *width, "--embedding-cache-buffer-size", str(args.small_pool))
            started.append(small)
            runs.append((small, f"{args.small_pool} blocks", max(levels)))
        print(f"{'language pool':<14} {'conc':>4} {'done':>9} {'images/s':>8} {'GB/s':>6} {'p50 ms':>8} {'p99 ms':>8}"
              f" {'wall s':>7}  errors", flush=True)
        for n, (lang, pool_name, c) in enumerate(runs):
            print(f"level {n + 1}/{len(runs)}: concurrency {c}, {pool_name} pool ...", file=sys.stderr, flush=True)
            row = {"language_pool": pool_name, **run_level(encode, lang, images, c, max(c, args.min_requests),
                                                           seed=n, timeout=args.timeout)}
            rows.append(row)
            print(f"{pool_name:<14} {c:>4} {row['completed']:>4}/{row['requests']:<4} {row['images_per_s']:>8.2f} "
                  f"{row['gb_per_s']:>6.3f} {row['p50_ms']:>8.0f} {row['p99_ms']:>8.0f} {row['wall_s']:>7.1f}  "
                  f"{' '.join(row['errors']) or '-'}", flush=True)
    finally:
        for worker in reversed(started):
            worker.stop()
        tmp.cleanup()
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": args.sizes, "rows": rows}, indent=1))
    top = next(r for r in rows if r["language_pool"] == "default" and r["concurrency"] == max(levels))
    print(f"load_{top['concurrency']}_completed={top['completed']}/{top['requests']}")
    return 0 if all(r["completed"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
