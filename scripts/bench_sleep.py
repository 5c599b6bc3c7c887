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
of bytes once with numpy into fresh memory, right after each measurement.

Generations (``--parts generations``; seeded checkpoints, text prompts of about 500 tokens):
N streaming generations decode on three language workers: ``keep`` (``--sleep-kv keep``, state
in host memory only), ``keep+disk`` (the same with a ``--checkpoint-dir`` in memory-backed
``/dev/shm`` where there is one: the wake-up removes the checkpoint) and ``recompute+disk``
(``--sleep-kv recompute``); ``/sleep?level=1`` then ``/wake_up`` while they run. Two model shapes (``--kv-shape``):
``seeded``, the tests' one-layer model (2 KiB of KV per token), and ``7b``, a narrow model
with Qwen2.5-VL-7B's KV geometry (28 layers x 4 KV heads x head_dim 128, bf16: 56 KiB per
token, so the KV bytes are a 7B's and the fixed costs of a sleep weigh what they would there).
Reported per shape and mode: the KV bytes kept in memory, the checkpoint's bytes and write
time, the whole sleep (without the checkpoint write; it includes waiting for the decoder layer
under way) and wake-up as a client sees them, the engine's own part of both (KV out and back,
weights), each against a memcpy of the KV bytes into memory already faulted in (the strict
baseline: bandwidth alone), and each stream's wait from sending the wake-up to its next token
against its inter-token latency before the sleep.

Prints the tables; the generations' ends with ``keep_sleep_wake_vs_memcpy_<shape>_8=<x>`` per
shape (``keep``'s whole sleep + wake-up over HTTP / memcpy, median), the transfers' (last, when both
run) with ``ratio_sleep_wake_vs_memcpy_32=<x>`` (the slower side, median).
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


def memcpy_warm_seconds(nbytes: int) -> float:
    """The fastest of three copies into memory already faulted in: the bandwidth alone (the
    KV's way to the host and back faults no new page in on a CPU, so page faults would flatter
    the engine)."""
    src = np.ones(max(nbytes, 1), np.uint8)
    dst = np.zeros_like(src)
    dst.fill(1)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", default="1,8,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--parts", default="transfers,generations", help="transfers, generations or both")
    ap.add_argument("--kv-shape", default="seeded,7b", help="the generations' model(s): seeded (one layer, 2 KiB of KV "
                    "per token), 7b (Qwen2.5-VL-7B's 28 layers x 4 KV heads x 128, 56 KiB per token), or both")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    parts = set(args.parts.split(","))
    if "generations" in parts:
        generations = bench_generations(counts, args.reps, args.kv_shape.split(","))
        if args.json:
            Path(args.json).with_suffix(".generations.json").write_text(json.dumps(generations, indent=1))
    if "transfers" in parts:
        bench_transfers(counts, args.reps, args.json)


def bench_transfers(counts: list[int], reps: int, json_path: str | None) -> None:
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
            for rep, n in itertools.product(range(reps), counts):
                print(f"repetition {rep + 1}/{reps}, {n} requests", file=sys.stderr, flush=True)
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

    print(f"\nsleep+wake with preserve_state vs one memcpy of the kept bytes, {reps} repetitions, medians")
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
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    if most in counts:
        worst = max((summary[f"{side}_{most}"]["ratio"] for side in ("encode", "language")),
                    key=lambda x: -1 if x != x else x)  # NaN (nothing comparable) never wins
        print(f"ratio_sleep_wake_vs_memcpy_{most}={worst:.2f}")


KV_SHAPES = {"seeded": (3584, 1), "7b": (512, 28)}  # (hidden size, layers); head_dim 128, 4 KV heads, bf16
MODES = ("keep", "keep+disk", "recompute+disk")  # --sleep-kv, and whether a --checkpoint-dir is written


def bench_generations(counts: list[int], reps: int, shapes: list[str]) -> list[dict]:
    from make_checkpoint import write_checkpoint

    unknown = set(shapes) - set(KV_SHAPES)
    if unknown:
        raise SystemExit(f"--kv-shape: unknown {sorted(unknown)}; choose from {sorted(KV_SHAPES)}")
    tmp = tempfile.TemporaryDirectory(prefix="bench-sleep-gen-")
    shm = Path("/dev/shm")
    disk = tempfile.TemporaryDirectory(prefix="bench-sleep-ckpt-", dir=shm if shm.is_dir() else None)
    rows: list[dict] = []
    rids = itertools.count()
    for shape in shapes:
        hidden, layers = KV_SHAPES[shape]
        print(f"writing the {shape} checkpoint ({layers} layer(s), width {hidden}) ...", file=sys.stderr, flush=True)
        folder = str(write_checkpoint(Path(tmp.name) / shape, hidden, layers=layers))
        for mode in MODES:
            kv, on_disk = mode.split("+") if "+" in mode else (mode, "")
            print(f"starting a language worker for {mode} ...", file=sys.stderr, flush=True)
            to_disk = ("--checkpoint-dir", str(Path(disk.name) / shape / kv)) if on_disk else ()
            worker = WorkerProcess("language", "--model-path", folder, "--hidden-size", str(hidden), "--sleep-kv", kv,
                                   "--max-total-tokens", str(max(counts) * 2100), *to_disk)
            try:
                for rep, n in itertools.product(range(reps), counts):
                    print(f"{shape} {mode}: repetition {rep + 1}/{reps}, {n} generations", file=sys.stderr,
                          flush=True)
                    rows.append({"shape": shape, "mode": mode, "n": n, **sleep_while_generating(worker, n, rids)})
            finally:
                worker.stop()
    disk.cleanup()
    tmp.cleanup()
    print(f"\nsleep+wake with N running generations, {reps} repetitions, medians; ratio = (sleep + wake) / memcpy "
          f"of the KV bytes; the sleep leaves out the checkpoint write (its own columns)")
    print(f"{'shape':<7} {'mode':<14} {'N':>3} {'KV MiB':>7} {'ckpt MiB':>9} {'ckpt ms':>8} {'sleep ms':>9} "
          f"{'step wait':>9} {'wake ms':>8} {'engine ms':>9} {'memcpy ms':>10} {'ratio':>6} {'engine ratio':>12} "
          f"{'wake→next ms':>12} {'ITL ms':>7} {'next/ITL':>9}")
    ratios: dict[tuple[str, str, int], float] = {}
    for shape, mode, n in itertools.product(shapes, MODES, counts):
        sel = [r for r in rows if (r["shape"], r["mode"], r["n"]) == (shape, mode, n)]
        med = {k: statistics.median(r[k] for r in sel) for k in sel[0] if k not in ("shape", "mode", "n")}
        ratio = (med["sleep_s"] + med["wake_s"]) / med["memcpy_s"] if med["kv_bytes"] else float("nan")
        engine_ratio = med["engine_s"] / med["memcpy_s"] if med["kv_bytes"] else float("nan")
        ratios[shape, mode, n] = ratio
        print(f"{shape:<7} {mode:<14} {n:>3} {med['kv_bytes'] / 2**20:>7.1f} {med['checkpoint_bytes'] / 2**20:>9.1f} "
              f"{med['checkpoint_s'] * 1e3:>8.0f} {med['sleep_s'] * 1e3:>9.1f} {med['step_wait_s'] * 1e3:>9.1f} "
              f"{med['wake_s'] * 1e3:>8.1f} {med['engine_s'] * 1e3:>9.2f} {med['memcpy_s'] * 1e3:>10.2f} "
              f"{ratio:>6.2f} {engine_ratio:>12.2f} {med['next_token_s'] * 1e3:>12.1f} "
              f"{med['itl_s'] * 1e3:>7.1f} {med['next_token_s'] / med['itl_s']:>9.2f}")
    n = 8 if 8 in counts else max(counts)
    for shape in shapes:
        print(f"keep_sleep_wake_vs_memcpy_{shape}_{n}={ratios[shape, 'keep', n]:.2f}")
    return rows


def sleep_while_generating(worker: WorkerProcess, n: int, rids) -> dict:
    """N streams decoding; a sleep and a wake-up; every stream aborted afterwards. Times in
    seconds; the sleep's time leaves out the checkpoint write (reported apart); the next
    token's from sending the wake-up (so it includes the wake-up)."""
    arrivals: dict[str, list[float]] = {}
    names = [f"g{next(rids)}" for _ in range(n)]

    def stream(rid: str) -> None:
        body = {"rid": rid, "text": f"{rid} " + "word " * 100, "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "temperature": 0.7, "seed": 1}}
        with requests.post(f"{worker.url}/generate", json=body, stream=True, timeout=600) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if line.startswith(b"data: {"):
                    arrivals[rid].append(time.perf_counter())

    with ThreadPoolExecutor(n) as pool:
        for rid in names:
            arrivals[rid] = []
        streams = [pool.submit(stream, rid) for rid in names]
        deadline = time.monotonic() + 600
        while min(len(a) for a in arrivals.values()) < 8:
            if time.monotonic() > deadline or any(s.done() for s in streams):
                raise SystemExit("the generations did not start: " + "; ".join(str(s.exception()) for s in streams
                                                                                 if s.done()))
            time.sleep(0.01)
        before = {rid: list(a) for rid, a in arrivals.items()}
        t_sleep, slept = timed_post(f"{worker.url}/sleep", level=1, preserve_state="true")
        time.sleep(0.05)  # the last tokens sent before the sleep have arrived; nothing comes while asleep
        asleep = {rid: len(a) for rid, a in arrivals.items()}
        wake_sent = time.perf_counter()
        t_wake, woke = timed_post(f"{worker.url}/wake_up")
        while any(len(a) <= asleep[rid] for rid, a in arrivals.items()):
            time.sleep(0.001)
        for rid in names:
            requests.post(f"{worker.url}/abort_request", json={"rid": rid}, timeout=60)
        for s in streams:
            s.result()
    if slept["kept_generations"] != n:
        raise SystemExit(f"the sleep kept {slept['kept_generations']} generations, expected {n}")
    itl = statistics.median(b - a for times in before.values() for a, b in itertools.pairwise(times[2:]))
    next_token = statistics.median(a[asleep[rid]] - wake_sent for rid, a in arrivals.items())
    checkpoint_s = slept.get("checkpoint_ms", 0.0) / 1e3
    return {"kv_bytes": slept["kv_bytes"], "checkpoint_bytes": slept.get("checkpoint_bytes", 0),
            "checkpoint_s": checkpoint_s, "sleep_s": t_sleep - checkpoint_s, "wake_s": t_wake,
            "step_wait_s": slept["step_wait_ms"] / 1e3, "engine_s": (slept["engine_ms"] + woke["engine_ms"]) / 1e3,
            "memcpy_s": memcpy_warm_seconds(slept["kv_bytes"]), "next_token_s": next_token, "itl_s": itl}


if __name__ == "__main__":
    main()
