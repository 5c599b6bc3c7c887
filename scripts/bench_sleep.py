"""Sleep+wake with preserve_state for 1, 8 and 32 in-flight 4K-image requests, next to a plain
memory copy of the bytes kept, measured side by side in one run.

For each count and repetition, on real worker processes (fake encoder, so the run is about
state, not encoding):

* encode side: N 4K requests encoded and waiting for their language side; ``POST /sleep``
  then ``/wake_up`` on the encode worker (it keeps each room's 72 MiB of source data);
* language side: N requests mid-transfer through a language pool under pressure (64 blocks,
  1024-token default allocation, so rooms take many rounds and spill); ``/sleep`` on the
  language worker once half the encodes returned, then ``/wake_up``. It keeps what landed
  (kept MiB); a sleep that caught too little to compare is left out of the ratio.

Every request then finishes and its digest is checked. The baseline copies the same number
of bytes once with numpy into fresh memory, right after each measurement. Prints a table
and, last, ``ratio_sleep_wake_vs_memcpy_32=<x>`` (the slower side, median).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transfer_large_image import make_image  # noqa: E402
from workers import WorkerProcess  # noqa: E402

BLOCKS_PER_4K = 83  # 10,549 tokens in 128-token blocks
MIN_COMPARABLE = 8 << 20  # below this a memcpy takes microseconds and the ratio says nothing


def timed_post(url: str, **params) -> tuple[float, dict]:
    t0 = time.perf_counter()
    resp = requests.post(url, params=params, timeout=600)
    resp.raise_for_status()
    return time.perf_counter() - t0, resp.json()


def memcpy_seconds(nbytes: int) -> float:
    src = np.ones(max(nbytes, 1), np.uint8)
    t0 = time.perf_counter()
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    most = max(counts)

    tmp = tempfile.TemporaryDirectory(prefix="bench-sleep-")
    image = str(Path(tmp.name) / "4k.png")
    make_image(3840, 2160, seed=4).save(image)
    print("starting workers ...", file=sys.stderr, flush=True)
    encode = WorkerProcess("encode", "--encoder", "fake", "--embedding-cache-buffer-size",
                           str(most * BLOCKS_PER_4K + 8))
    language = WorkerProcess("language", "--embedding-cache-buffer-size", "64",
                             "--embedding-default-allocate-buffer-size", "1024")
    rooms = itertools.count(1)
    rows: list[dict] = []

    def gen(room: int) -> requests.Response:
        return requests.post(f"{language.url}/generate", timeout=600, json={
            "rid": f"r{room}", "bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port,
            "bootstrap_room": room})

    def enc(room: int) -> dict:
        resp = requests.post(f"{encode.url}/encode", json={"rid": f"r{room}", "bootstrap_room": room,
                                                           "images": [image]}, timeout=600)
        resp.raise_for_status()
        return resp.json()

    def check(encoded: list[dict], generated: list) -> None:
        for e, g in zip(encoded, generated, strict=True):
            body = g.result().json()
            if body.get("sha256") != e["sha256"]:
                raise SystemExit(f"digest mismatch after sleep: {body}")

    try:
        with ThreadPoolExecutor(2 * most + 2) as pool:
            for rep, n in itertools.product(range(args.reps), counts):
                print(f"repetition {rep + 1}/{args.reps}, {n} requests", file=sys.stderr, flush=True)
                # encode side: rooms hold their source data, the language side has not asked yet
                batch = [next(rooms) for _ in range(n)]
                encoded = list(pool.map(enc, batch))
                t_sleep, slept = timed_post(f"{encode.url}/sleep", level=1, preserve_state="true")
                t_wake, _ = timed_post(f"{encode.url}/wake_up")
                rows.append({"side": "encode", "n": n, "kept_bytes": slept["kept_bytes"], "sleep_s": t_sleep,
                             "wake_s": t_wake, "memcpy_s": memcpy_seconds(slept["kept_bytes"])})
                check(encoded, [pool.submit(gen, r) for r in batch])
                # language side: sleep while the transfers of the batch are under way
                batch = [next(rooms) for _ in range(n)]
                generated = [pool.submit(gen, r) for r in batch]
                encodes = [pool.submit(enc, r) for r in batch]
                encodes[len(batch) // 2].result()
                t_sleep, slept = timed_post(f"{language.url}/sleep", level=1, preserve_state="true")
                t_wake, _ = timed_post(f"{language.url}/wake_up")
                rows.append({"side": "language", "n": n, "kept_bytes": slept["kept_bytes"], "sleep_s": t_sleep,
                             "wake_s": t_wake, "memcpy_s": memcpy_seconds(slept["kept_bytes"]),
                             "kept_requests": slept["kept_requests"]})
                check([e.result() for e in encodes], generated)
    finally:
        language.stop()
        encode.stop()
        tmp.cleanup()

    print(f"\nsleep+wake with preserve_state vs one memcpy of the kept bytes, {args.reps} repetitions, medians")
    print(f"{'side':<9} {'requests':>8} {'kept MiB':>9} {'sleep ms':>9} {'wake ms':>9} {'memcpy ms':>10} {'ratio':>7}")
    summary = {}
    for side, n in itertools.product(("encode", "language"), counts):
        sel = [r for r in rows if r["side"] == side and r["n"] == n]
        ratios = [(r["sleep_s"] + r["wake_s"]) / r["memcpy_s"] for r in sel if r["kept_bytes"] >= MIN_COMPARABLE]
        ratios = ratios or [float("nan")]
        med = {k: statistics.median(r[k] for r in sel) for k in ("kept_bytes", "sleep_s", "wake_s", "memcpy_s")}
        summary[f"{side}_{n}"] = {**med, "ratio": statistics.median(ratios)}
        print(f"{side:<9} {n:>8} {med['kept_bytes'] / 2**20:>9.0f} {med['sleep_s'] * 1e3:>9.0f} "
              f"{med['wake_s'] * 1e3:>9.0f} {med['memcpy_s'] * 1e3:>10.1f} {statistics.median(ratios):>7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    if most in counts:
        worst = max((summary[f"{side}_{most}"]["ratio"] for side in ("encode", "language")),
                    key=lambda x: -1 if x != x else x)  # NaN (nothing comparable) never wins
        print(f"ratio_sleep_wake_vs_memcpy_{most}={worst:.2f}")


if __name__ == "__main__":
    main()
