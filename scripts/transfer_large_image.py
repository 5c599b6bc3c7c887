"""Push large images through an encode and a language worker, as a router would.

Each request goes to both workers at once with the same bootstrap room: the encode worker
encodes and sends, the language worker receives (resuming as often as needed) and reports
the digest. Prints tokens, bytes, resume rounds, times and whether the digests match; exits
non-zero on any mismatch or error. Starts both workers itself unless given their URLs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.workers import WorkerProcess, embedding_width  # noqa: E402

DEFAULT_SET = [("448x448", [(448, 448)]), ("1024x1024", [(1024, 1024)]), ("2048x2048", [(2048, 2048)]),
               ("3840x2160", [(3840, 2160)]), ("4x1920x1080", [(1920, 1080)] * 4)]


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """Deterministic, detailed test image: gradients, ripples and seeded noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 127 + 100 * np.sin(x / (17 + seed % 7)) * np.cos(y / 23)
    g = 255 * x / max(width - 1, 1)
    b = 255 * y / max(height - 1, 1)
    rgb = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def run_request(encode_url: str, language_url: str, bootstrap_port: int, rid: str, room: int,
                images: list[str], timeout: float, encode_first: bool = False, gap: float = 0.0) -> dict:
    """Send one request to both workers, as a router would: ``/generate`` then ``/encode`` (or the
    other way round), ``gap`` seconds apart. Both answer once the language side has the embedding."""
    generate = {"rid": rid, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    encode = {"rid": rid, "bootstrap_room": room, "images": images}
    calls = [(f"{language_url}/generate", generate), (f"{encode_url}/encode", encode)]
    if encode_first:
        calls.reverse()
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_post, calls[0][0], calls[0][1], timeout)
        time.sleep(gap)
        second = pool.submit(_post, calls[1][0], calls[1][1], timeout)
        (enc, enc_at), (lang_resp, lang_at) = ((first.result(), second.result()) if encode_first
                                              else (second.result(), first.result()))
    result = {"rid": rid, "room": room, "encode_status": enc.status_code, "language_status": lang_resp.status_code,
              "total_ms": round((max(enc_at, lang_at) - t0) * 1e3, 1), "encode_done_at": enc_at,
              "language_done_at": lang_at}
    if lang_resp.status_code == 200:
        result["language_sha256"] = lang_resp.json()["sha256"]
    if enc.status_code != 200 or lang_resp.status_code != 200:
        result["encode_error"] = _error(enc)
        result["language_error"] = _error(lang_resp)
        result["error"] = result["encode_error"] or result["language_error"]
        result["match"] = False
        return result
    e, lg = enc.json(), lang_resp.json()
    result.update(tokens=e["num_tokens"], bytes=e["num_tokens"] * e["hidden_size"] * 2,
                  resume_rounds=lg["resume_rounds"], transfer_ms=lg["transfer_ms"], sha256=e["sha256"],
                  match=e["sha256"] == lg["sha256"] and e["num_tokens"] == lg["num_tokens"])
    return result


class _NoAnswer:
    """What a worker that dropped the connection (killed, say) answered: status 0."""

    status_code = 0

    def __init__(self, exc: Exception) -> None:
        self.text = f"{type(exc).__name__}: {exc}"

    def json(self) -> dict:
        return {"error": self.text}


def _post(url: str, body: dict, timeout: float) -> tuple[requests.Response | _NoAnswer, float]:
    """The answer and ``time.monotonic()`` when it came."""
    try:
        resp = requests.post(url, json=body, timeout=timeout)
    except requests.RequestException as exc:
        resp = _NoAnswer(exc)
    return resp, time.monotonic()


def _error(resp: requests.Response | _NoAnswer) -> str:
    if resp.status_code == 200:
        return ""
    try:
        return str(resp.json().get("error", "?"))
    except ValueError:
        return resp.text[:300]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("images", nargs="*", help="image paths (each one request); default: a generated set up to 4K")
    ap.add_argument("--encode-url", help="a running encode worker (else one is started)")
    ap.add_argument("--language-url", help="a running language worker (else one is started)")
    ap.add_argument("--model-path", help="the started encode worker's checkpoint (default: the seeded Qwen2.5-VL, "
                                         "width 3584, written to a temp folder)")
    ap.add_argument("--worker-arg", action="append", default=[], help="extra flag for both started workers")
    ap.add_argument("--repeat", type=int, default=1, help="send the set this many times")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write the per-request results here")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="epd-images-")
    if args.images:
        requests_set = [(Path(p).name, [str(Path(p).resolve())]) for p in args.images]
    else:
        requests_set = []
        for n, (name, sizes) in enumerate(DEFAULT_SET):
            paths = []
            for i, (w, h) in enumerate(sizes):
                path = Path(tmp.name) / f"{name}-{i}.png"
                make_image(w, h, seed=10 * n + i).save(path)
                paths.append(str(path))
            requests_set.append((name, paths))

    started: list[WorkerProcess] = []
    try:
        if args.encode_url and args.language_url:
            encode_url, language_url = args.encode_url.rstrip("/"), args.language_url.rstrip("/")
            bootstrap_port = requests.get(f"{encode_url}/health", timeout=10).json()["bootstrap_port"]
        else:
            from make_checkpoint import write_checkpoint

            folder = args.model_path
            if folder is None:
                print("writing the seeded checkpoint ...", file=sys.stderr, flush=True)
                folder = str(write_checkpoint(Path(tmp.name) / "seeded", 3584))
            print("starting encode and language workers ...", file=sys.stderr, flush=True)
            image_dirs = sorted({str(Path(p).parent) for _, paths in requests_set for p in paths})
            enc = WorkerProcess("encode", "--model-path", folder, *args.worker_arg,
                                *(arg for d in image_dirs for arg in ("--allowed-local-media-path", d)))
            started.append(enc)
            lang = WorkerProcess("language", "--hidden-size", str(embedding_width(folder)), *args.worker_arg)
            started.append(lang)
            print(enc.ready_line + lang.ready_line, end="", file=sys.stderr, flush=True)
            encode_url, language_url, bootstrap_port = enc.url, lang.url, enc.bootstrap_port
        jobs = requests_set * args.repeat
        results = []
        # transfer ms: from the language side's init to the assembled embedding (it includes the
        # wait for the encoder); total ms: from sending the request until both workers answered.
        print(f"{'request':<14} {'images':>6} {'tokens':>7} {'MiB':>7} {'resumes':>7} {'transfer ms':>11} "
              f"{'total ms':>9}  digest", flush=True)
        # Progress on a terminal is one line rewritten in place; in a log it would garble the table.
        progress = sys.stderr.isatty()
        for i, (name, paths) in enumerate(jobs):
            if progress:
                print(f"\r[{i}/{len(jobs)}] {name} ...", end="", file=sys.stderr, flush=True)
            res = run_request(encode_url, language_url, bootstrap_port, f"{name}-{i}", random.getrandbits(40),
                              paths, args.timeout)
            res.update(name=name, images=len(paths))
            results.append(res)
            if progress:
                print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
            if "error" in res:
                print(f"{name:<14} {len(paths):>6}  ERROR {res['encode_status']}/{res['language_status']}: {res['error']}",
                      flush=True)
            else:
                print(f"{name:<14} {len(paths):>6} {res['tokens']:>7} {res['bytes'] / 2**20:>7.1f} "
                      f"{res['resume_rounds']:>7} {res['transfer_ms']:>11.0f} {res['total_ms']:>9.0f}  "
                      f"{'match' if res['match'] else 'MISMATCH'}", flush=True)
        print(f"[{len(jobs)}/{len(jobs)}] done", file=sys.stderr)
    finally:
        for worker in reversed(started):
            worker.stop()
        tmp.cleanup()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = [r for r in results if not r["match"]]
    resumed = sum(r.get("resume_rounds", 0) for r in results)
    print(f"{len(results) - len(bad)}/{len(results)} requests matched, {resumed} resume rounds in all")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
