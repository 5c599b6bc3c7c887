"""Does receiving a large image's embedding stall SGLang's decoding?

An encode worker (SGLang's encoder) and SGLang's language server on the
seeded checkpoint of the 7B's width (hidden 3584, one layer: a 3840x2160 image is 10,549 rows,
75.6 MB). ``--streams`` greedy text streams decode; once they run steadily, 3840x2160 images
(a new one each time, the embedding cache off) are sent one after another as one-token
requests, each after a pause. Each image's receive window starts after its ``encode_ms`` (the
encoder's forward pass excluded: on a shared CPU it competes for the cores whatever the
connector does) and ends when the language server has assembled the embedding and copied it
out of the pool with its digest (``transfer_ms`` + ``copy_ms``; the prefill, which follows,
excluded). The inter-token gaps of the streams that overlap a receive window are compared with
the gaps of the same streams in the pause just before that image was sent (its control: the
same batch at nearly the same context length, since a decoding step's cost grows with its
context): the last line is ``stall_p99_ratio=<p99 in windows / p99 in their controls>`` (issue
36's target: at most 1.2).

``--isolate-scheduler`` gives SGLang's scheduler process CPU 0 alone and every other process
(the encoder, SGLang's main process where the receive runs, this client) the other CPUs, each
process with one compute thread, so that what remains in the ratio is what blocks the
scheduler, not what shares its core. The encode worker stands for another host there: it runs
at CPU priority ``--encoder-nice`` (10), so on the CPU it shares with SGLang's main process
(the receive, and the threads that carry each token to the client) it takes what they leave;
``--encoder-nice 0`` measures the two hosts' work on one CPU at equal priority.

    .venv/bin/python scripts/bench_stall.py [--streams 8] [--images 8] [--isolate-scheduler [--encoder-nice 10]] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import make_image  # noqa: E402

from harness.workers import SGLANG_LAUNCH, SGLANG_READY, WorkerProcess, free_port, start_together  # noqa: E402

PROMPT = "<|im_start|>user\n{images}Stream {i}: count slowly.<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def start(folder: str, one_thread: bool, timeout: float = 300.0) -> tuple[WorkerProcess, WorkerProcess]:
    """``one_thread``: one compute thread per process (the scheduler alone on a core would
    otherwise run two spinning threads there)."""
    encode_port = free_port()
    env = {"OMP_NUM_THREADS": "1"} if one_thread else {}
    encode, language = start_together(
        lambda: WorkerProcess("encode", "--model-path", folder, port=encode_port,
                              command=SGLANG_LAUNCH, timeout=timeout, env=env),
        lambda: WorkerProcess("language", "--model-path", folder, "--encoder-urls", f"http://127.0.0.1:{encode_port}",
                              "--skip-server-warmup", "--max-total-tokens", "65536", "--image-embedding-cache-bytes",
                              "0", command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=timeout, env=env))
    return encode, language


def isolate_scheduler(encode: WorkerProcess, language: WorkerProcess, encoder_nice: int) -> str:
    """SGLang's scheduler process on CPU 0 alone, every other process of the run on the rest;
    the encode worker's threads at CPU priority ``encoder_nice``."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--isolate-scheduler needs at least 2 CPUs")
    rest = cpus[1:]
    os.sched_setaffinity(0, rest)
    placed = []
    for worker in (encode, language):
        root = psutil.Process(worker.proc.pid)
        for process in [root, *root.children(recursive=True)]:
            alone = "scheduler" in " ".join(process.cmdline() + [process.name()])
            for thread in process.threads():  # affinity and priority are per thread; set every existing one
                os.sched_setaffinity(thread.id, [cpus[0]] if alone else rest)
                if worker is encode:
                    os.setpriority(os.PRIO_PROCESS, thread.id, encoder_nice)
            placed.append(f"{process.name()}:{process.pid}->{'cpu0' if alone else 'rest'}"
                          + (f",nice {encoder_nice}" if worker is encode else ""))
    if not any(p.endswith("cpu0") for p in placed):
        raise SystemExit(f"no scheduler process found among {placed}")
    return ", ".join(placed)


def stream(url: str, i: int, tokens: int, arrivals: list[float], started: threading.Event) -> None:
    """One greedy text stream; the arrival time of each of its token events into ``arrivals``."""
    body = {"text": PROMPT.format(images="", i=i), "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith(b"data: {"):
                arrivals.append(time.monotonic())
                if len(arrivals) == 10:
                    started.set()


def receive_window(url: str, path: str) -> tuple[float, float]:
    """Send one image as a one-token request; its receive window in this process's clock."""
    sent = time.monotonic()
    answer = requests.post(f"{url}/generate", timeout=600, json={
        "text": PROMPT.format(images=IMAGE, i="image"), "image_data": [path],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    answer.raise_for_status()
    meta = answer.json()["meta_info"]
    return (sent + (meta["queue_ms"] + meta["encode_ms"]) / 1e3,
            sent + (meta["queue_ms"] + meta["transfer_ms"] + meta["copy_ms"]) / 1e3)


def gaps_in(arrivals: list[float], windows: list[tuple[float, float]]) -> list[float]:
    """Gaps between a stream's tokens, in ms, that overlap a window (a stall inside it shows as
    a long gap, which may end after it)."""
    t = np.asarray(arrivals)
    start, end = t[:-1], t[1:]
    keep = np.zeros(len(end), bool)
    for lo, hi in windows:
        keep |= (end > lo) & (start < hi)
    return ((end - start)[keep] * 1e3).tolist()


def percentiles(gaps: list[float]) -> dict:
    return {"gaps": len(gaps), "p50_ms": round(float(np.percentile(gaps, 50)), 1),
            "p99_ms": round(float(np.percentile(gaps, 99)), 1)}


def measure(args: argparse.Namespace, folder: str, paths: list[str]) -> dict:
    """One run: the workers started, the streams and the images; the row of gaps."""
    encode, language = start(folder, one_thread=args.isolate_scheduler)
    cpus = os.sched_getaffinity(0)  # isolate_scheduler narrows this process's: the next run needs them all
    try:
        warm = str(Path(paths[0]).with_name("warm.png"))
        make_image(448, 448, seed=7).save(warm)
        receive_window(language.url, warm)  # first passes of both sides
        if args.isolate_scheduler:
            print(f"affinity: {isolate_scheduler(encode, language, args.encoder_nice)}", file=sys.stderr, flush=True)
        # enough tokens to outlast the warm-up and every image (a step is ~0.015-0.1 s here)
        tokens = int(40 + (args.quiet_s + (30 + args.control_s) * args.images) / 0.015)
        arrivals: list[list[float]] = [[] for _ in range(args.streams)]
        started = [threading.Event() for _ in range(args.streams)]
        threads = [threading.Thread(target=stream, args=(language.url, i, tokens, arrivals[i], started[i]), daemon=True)
                   for i in range(args.streams)]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(300), "a stream did not start"
        time.sleep(args.quiet_s)
        controls, windows = [], []
        for path in paths:
            # the previous image's answer (its prefill's last step) is 0.2 s behind the control
            time.sleep(args.control_s + 0.2)
            controls.append((time.monotonic() - args.control_s, time.monotonic()))
            windows.append(receive_window(language.url, path))
        requests.post(f"{language.url}/abort_request", json={"abort_all": True, "rid": ""}, timeout=30)
        for thread in threads:
            thread.join(60)
    finally:
        os.sched_setaffinity(0, cpus)
        language.stop()
        encode.stop()
    control = [g for a in arrivals for g in gaps_in(a, controls)]
    stalled = [g for a in arrivals for g in gaps_in(a, windows)]
    if not stalled or not control:
        raise SystemExit("no token gap overlapped a receive window or its control: more streams or images")
    return {"streams": args.streams, "images": args.images, "size": args.size, "isolated": args.isolate_scheduler,
            "encoder_nice": args.encoder_nice if args.isolate_scheduler else 0,
            "windows_ms": [round((hi - lo) * 1e3, 1) for lo, hi in windows],
            "control": percentiles(control), "window": percentiles(stalled)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--images", type=int, default=8, help="3840x2160 images sent one after another")
    ap.add_argument("--quiet-s", type=float, default=4.0, help="seconds of decoding before the first image")
    ap.add_argument("--control-s", type=float, default=1.0,
                    help="seconds of decoding measured just before each image is sent (its control)")
    ap.add_argument("--size", default="3840x2160")
    ap.add_argument("--isolate-scheduler", action="store_true",
                    help="the scheduler process alone on CPU 0, everything else on the other CPUs")
    ap.add_argument("--encoder-nice", type=int, default=10, choices=range(0, 20), metavar="0-19",
                    help="with --isolate-scheduler: the encode worker's CPU priority (it stands for another host)")
    ap.add_argument("--model-path", help="Qwen2.5-VL folder (default: the seeded one, hidden 3584, one layer)")
    ap.add_argument("--json")
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    tmp = tempfile.TemporaryDirectory(prefix="bench-stall-")
    print("writing the seeded checkpoint (unless --model-path) and the images ...", file=sys.stderr, flush=True)
    folder = args.model_path or str(write_checkpoint(Path(tmp.name) / "model", 3584))
    paths = []
    for k in range(args.images):
        paths.append(str(Path(tmp.name) / f"img{k}.png"))
        make_image(width, height, seed=500 + k).save(paths[-1])
    row = measure(args, folder, paths)
    print(f"{'gaps':>8} {'count':>6} {'p50 ms':>8} {'p99 ms':>8}")
    for name, gaps in (("control", row["control"]), ("receive", row["window"])):
        print(f"{name:>8} {gaps['gaps']:>6} {gaps['p50_ms']:>8} {gaps['p99_ms']:>8}")
    print(f"receive windows (ms): {row['windows_ms']}")
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))
    print(f"stall_p50_ratio={row['window']['p50_ms'] / row['control']['p50_ms']:.2f}")
    print(f"stall_p99_ratio={row['window']['p99_ms'] / row['control']['p99_ms']:.2f}")


if __name__ == "__main__":
    main()
