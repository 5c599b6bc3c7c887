"""Ours against upstream SGLang EPD, side by side in one run, on one checkpoint and the same images.

* ours: this project's encode worker + SGLang's own language server fed by the resumable
  connector (``python -m sglang.launch_server --disaggregation-mode language --encoder-urls``);
* upstream: SGLang's ``--encoder-only`` server + ``--language-only --encoder-urls
  --encoder-transfer-backend zmq_to_scheduler`` (its ``mooncake`` backend allocates on ``cuda:``),
  started with this project's plugin turned off (``SGLANG_PLUGINS=none``).

One stack at a time (this machine has 2 cores), each warmed up with three small requests. For
each image size: the time to first token and the total of a streamed request (16 new tokens;
448x448: the median over 5 distinct images, the others one image);
then 8 concurrent 1920x1080 requests (distinct images: median and slowest TTFT, wall time);
then a 3-turn chat on one 4K image sent as a ``data:`` URI each turn (TTFT per turn: a repeated
image should be a cache hit); then 8 streams decoding, and the gaps between their tokens (ITL)
while nothing else arrives and while a 4K request is encoded, transferred and prefilled (in
SGLang's chunks: ``--language-args`` passes e.g. ``--chunked-prefill-size`` and
``--enable-mixed-chunk`` to both language servers). A sampler reads the resident memory of each stack's encoder and
language process trees every 0.2 s; a stack whose total passes ``--max-rss-gb`` is killed (that
request fails) and started again for the next one. Prints a table per stack, then the ratios ours/upstream and which sizes each
could serve; the last line is ``ours_vs_upstream_ttft_448=<x>``.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import requests  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import make_image  # noqa: E402
from workers import SGLANG_READY, WorkerProcess  # noqa: E402

SGLANG = (sys.executable, "-m", "sglang.launch_server")
SIZES = {"448x448": (448, 448), "1920x1080": (1920, 1080), "2560x1440": (2560, 1440), "3840x2160": (3840, 2160)}
NEW_TOKENS = 16
WARMUPS = 3  # small requests before anything is measured
REPEATS = {"448x448": 5}  # distinct images per size, the median reported (one for the sizes that take seconds)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def chat_text(turns: list[tuple[str, str]], question: str) -> str:
    """Qwen's chat layout: the image in the first user turn, then the turns so far."""
    text = ""
    for i, (asked, answered) in enumerate(turns + [(question, "")]):
        text += f"<|im_start|>user\n{IMAGE if i == 0 else ''}{asked}<|im_end|>\n<|im_start|>assistant\n"
        if answered or i < len(turns):
            text += f"{answered}<|im_end|>\n"
    return text


class Memory:
    """Peak resident memory of process trees, sampled; kills them all past ``limit`` bytes."""

    def __init__(self, roots: dict[str, int], limit: float) -> None:
        self.roots, self.limit = roots, limit
        self.peak = {name: 0 for name in roots}
        self.killed_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree_rss(self, pid: int) -> int:
        try:
            root = psutil.Process(pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            now = {name: self._tree_rss(pid) for name, pid in self.roots.items()}
            for name, rss in now.items():
                self.peak[name] = max(self.peak[name], rss)
            if sum(now.values()) > self.limit and not self.killed_at:
                self.killed_at = sum(now.values())
                for pid in self.roots.values():
                    try:
                        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
                            p.kill()
                    except psutil.Error:
                        pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def stream(url: str, text: str, images: list[str], rid: str) -> dict:
    """One streamed ``/generate``: TTFT, total, ids (or the error)."""
    start = time.perf_counter()
    first, ids = None, []
    try:
        with requests.post(f"{url}/generate", stream=True, timeout=900, json={
                "rid": rid, "text": text, "image_data": images, "stream": True,
                "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}) as answer:
            if answer.status_code != 200:
                return {"error": f"{answer.status_code} {answer.text[:200]}"}
            for line in answer.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": str(event["error"])[:200]}
                if first is None and event.get("output_ids"):
                    first = time.perf_counter()
                ids = event["output_ids"] if len(event["output_ids"]) >= len(ids) else ids + event["output_ids"]
    except requests.RequestException as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if first is None:
        return {"error": "no token"}
    return {"ttft": first - start, "total": time.perf_counter() - start, "ids": ids}


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def itl_under_prefill(url: str, kind: str, small_image: str, big_image: str, streams: int, quiet_s: float = 4.0) -> dict:
    """``streams`` streams decoding (448x448, ignore_eos); the gaps between their tokens over a
    quiet window, then from sending a 4K request until its first token (its encode, transfer
    and chunked prefill). Returns each window's p50/p99/max gap and the 4K request's TTFT."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    done = threading.Event()

    def decode(i: int) -> None:
        try:
            with requests.post(f"{url}/generate", stream=True, timeout=900, json={
                    "rid": f"{kind}-itl{i}", "text": chat_text([], "Describe it."), "image_data": [small_image],
                    "stream": True, "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                                        "ignore_eos": True}}) as answer:
                for line in answer.iter_lines():
                    if line.startswith(b"data: {"):
                        arrivals[i].append(time.perf_counter())
                    if done.is_set():
                        return
        except requests.RequestException:
            return

    threads = [threading.Thread(target=decode, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 600
    while min(len(a) for a in arrivals) < 5 and time.perf_counter() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    quiet_from = time.perf_counter()
    time.sleep(quiet_s)
    big_from = time.perf_counter()
    big = stream(url, chat_text([], "Describe it."), [big_image], f"{kind}-itl-4k")
    big_to = time.perf_counter()
    done.set()
    for i in range(streams):
        try:
            requests.post(f"{url}/abort_request", json={"rid": f"{kind}-itl{i}"}, timeout=30)
        except requests.RequestException:  # the server is gone (the memory limit ended it): its streams too
            break
    for t in threads:
        t.join(60)

    def window(start: float, end: float) -> dict:
        gaps = [b - a for times in arrivals for a, b in zip(times[:-1], times[1:], strict=True) if start < b <= end]
        return {"gaps": len(gaps), "p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99),
                "max": max(gaps, default=None)}

    return {"quiet": window(quiet_from, big_from), "prefill": window(big_from, big_to),
            "big": big.get("error") or f"TTFT {big['ttft']:.2f} s"}


def start_stack(kind: str, folder: str, language_args: list[str], pin: bool) -> tuple[WorkerProcess, WorkerProcess]:
    """``pin``: the encoder's processes on CPU 1, the language server's on CPU 0 (as if on two
    machines, a core each)."""
    on_cpu = (lambda cpu, command: ("taskset", "-c", str(cpu), *command)) if pin else (lambda cpu, command: command)
    if kind == "ours":
        encode = WorkerProcess("encode", "--model-path", folder, timeout=300,
                               command=on_cpu(1, (sys.executable, "-m", "sglang_ext.launch_server")))
        language = WorkerProcess("language", "--model-path", folder, "--encoder-urls", encode.url,
                                 "--max-total-tokens", "65536", "--skip-server-warmup", *language_args,
                                 command=on_cpu(0, SGLANG), ready=SGLANG_READY, timeout=300)
        return encode, language
    env = {"SGLANG_PLUGINS": "none"}
    # WorkerProcess adds --disaggregation-mode MODE; SGLang's own EPD flags come after it and win
    encode = WorkerProcess("null", "--encoder-only", "--model-path", folder, "--skip-server-warmup",
                           command=on_cpu(1, SGLANG), ready="Uvicorn running on", env=env, timeout=300)
    language = WorkerProcess("null", "--language-only", "--model-path", folder, "--encoder-urls", encode.url,
                             "--encoder-transfer-backend", "zmq_to_scheduler", "--max-total-tokens", "65536",
                             "--skip-server-warmup", *language_args, command=on_cpu(0, SGLANG), ready=SGLANG_READY,
                             env=env, timeout=300)
    return encode, language


class Stack:
    """One stack's two servers and the memory sampler over them; started again after a kill."""

    def __init__(self, kind: str, folder: str, limit: float, language_args: list[str], pin: bool) -> None:
        self.kind, self.folder, self.limit, self.language_args, self.pin = kind, folder, limit, language_args, pin
        self.peak: dict[str, int] = {"encoder": 0, "language": 0}
        self.killed_at = 0.0
        self._start()

    def _start(self) -> None:
        self.encode, self.language = start_stack(self.kind, self.folder, self.language_args, self.pin)
        self.memory = Memory({"encoder": self.encode.proc.pid, "language": self.language.proc.pid}, self.limit)

    def up(self) -> str:
        """The language server's URL, the stack started again if a kill or a crash ended it."""
        if self.memory.killed_at or self.encode.proc.poll() is not None or self.language.proc.poll() is not None:
            self.stop()
            self._start()
        return self.language.url

    def stop(self) -> None:
        self.memory.stop()
        for name, rss in self.memory.peak.items():
            self.peak[name] = max(self.peak[name], rss)
        self.killed_at = self.killed_at or self.memory.killed_at
        self.language.stop()
        self.encode.stop()


def measure(kind: str, folder: str, images: dict[str, str], chat_image: str, sizes: list[str], concurrent: int,
            limit: float, language_args: list[str], pin: bool, log) -> dict:
    stack = Stack(kind, folder, limit, language_args, pin)
    rows: dict = {"sizes": {}, "concurrent": None, "chat": [], "itl": None}
    try:
        for i in range(WARMUPS):
            warm = stream(stack.up(), chat_text([], "Hi."), [images[f"warmup{i}"]], f"{kind}-warmup{i}")
            log(f"[{kind}] warm-up {i}: " + (warm.get("error") or f"{warm['ttft']:.2f} s"))
        for name in sizes:
            runs = [stream(stack.up(), chat_text([], "Describe it."), [images[f"{name}.{i}" if i else name]],
                           f"{kind}-{name}.{i}") for i in range(REPEATS.get(name, 1))]
            row = rows["sizes"][name] = next((r for r in runs if "error" in r), None) or {
                "ttft": statistics.median(r["ttft"] for r in runs), "total": statistics.median(r["total"] for r in runs),
                "ids": runs[0]["ids"]}
            log(f"[{kind}] {name}: " + (row.get("error") or f"TTFT {row['ttft']:.2f} s, total {row['total']:.2f} s"
                                        + (f" (median of {len(runs)} images)" if len(runs) > 1 else "")))
        url = stack.up()
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrent) as pool:
            results = list(pool.map(lambda i: stream(url, chat_text([], "Describe it."), [images[f"hd{i}"]],
                                                     f"{kind}-hd{i}"), range(concurrent)))
        served = [r for r in results if "error" not in r]
        rows["concurrent"] = {"served": len(served), "wall": time.perf_counter() - start,
                              "ttft_p50": statistics.median(r["ttft"] for r in served) if served else None,
                              "ttft_max": max((r["ttft"] for r in served), default=None)}
        log(f"[{kind}] {concurrent} x 1920x1080: {rows['concurrent']}")
        turns: list[tuple[str, str]] = []
        for turn, question in enumerate(("Describe it.", "And the colours?", "Anything else?"), 1):
            row = stream(stack.up(), chat_text(turns, question), [chat_image], f"{kind}-chat{turn}")
            rows["chat"].append(row)
            log(f"[{kind}] chat turn {turn}: " + (row.get("error") or f"TTFT {row['ttft']:.2f} s"))
            if "error" in row:
                break
            turns.append((question, "ok"))
        rows["itl"] = itl_under_prefill(stack.up(), kind, images["448x448"], images["itl4k"], concurrent)
        log(f"[{kind}] ITL of {concurrent} streams, quiet then while a 3840x2160 request arrives: {rows['itl']}")
    finally:
        stack.stop()
    rows["peak_rss"], rows["killed_at"] = stack.peak, stack.killed_at
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a Qwen2.5-VL folder (default: the seeded one, hidden 3584, 1 layer)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--max-rss-gb", type=float, default=16.0,
                        help="a stack whose encoder + language memory passes this is killed (default %(default)s)")
    parser.add_argument("--only", choices=["ours", "upstream"], help="measure one stack")
    parser.add_argument("--language-args", default="", help="more flags for both language servers, e.g. "
                        "'--chunked-prefill-size 512 --enable-mixed-chunk'")
    parser.add_argument("--pin-cores", action="store_true", help="each stack's encoder on CPU 1 and its language "
                        "server on CPU 0 (taskset), as two machines would keep them apart")
    args = parser.parse_args()
    log = lambda line: print(line, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_path or str(write_checkpoint(Path(tmp) / "seeded", 3584))
        images = {}
        for i in range(WARMUPS):
            images[f"warmup{i}"] = f"{tmp}/warmup{i}.png"
            make_image(224, 224, seed=7 + i).save(images[f"warmup{i}"])
        for i, (name, (w, h)) in enumerate(SIZES.items()):
            images[name] = f"{tmp}/{name}.png"
            make_image(w, h, seed=10 + i).save(images[name])
            for repeat in range(1, REPEATS.get(name, 1)):
                images[f"{name}.{repeat}"] = f"{tmp}/{name}.{repeat}.png"
                make_image(w, h, seed=300 + 10 * i + repeat).save(images[f"{name}.{repeat}"])
        for i in range(args.concurrent):
            images[f"hd{i}"] = f"{tmp}/hd{i}.jpg"
            make_image(1920, 1080, seed=100 + i).save(images[f"hd{i}"], quality=90)
        make_image(3840, 2160, seed=99).save(f"{tmp}/chat.png")
        images["itl4k"] = f"{tmp}/itl4k.png"  # not seen before: encoded, transferred and prefilled in full
        make_image(3840, 2160, seed=98).save(images["itl4k"])
        chat_image = "data:image/png;base64," + base64.b64encode(Path(f"{tmp}/chat.png").read_bytes()).decode()
        results = {kind: measure(kind, folder, images, chat_image, args.sizes, args.concurrent, args.max_rss_gb * 2**30,
                                 args.language_args.split(), args.pin_cores, log) for kind in ("ours", "upstream") if args.only in (None, kind)}
    report(results, args.sizes)


def report(results: dict, sizes: list[str]) -> None:
    def cell(row: dict | None, key: str) -> str:
        if not row:
            return "-"
        return "failed" if "error" in row else f"{row[key]:.2f}"

    print(f"\n{'':22}" + "".join(f"{k + ' TTFT s':>16}{k + ' total s':>17}" for k in results))
    for name in sizes:
        print(f"{name:22}" + "".join(f"{cell(r['sizes'].get(name), 'ttft'):>16}{cell(r['sizes'].get(name), 'total'):>17}"
                                      for r in results.values()))
    for kind, r in results.items():
        c = r["concurrent"] or {}
        print(f"{kind}: concurrent 1920x1080 served {c.get('served')} in {c.get('wall', 0):.2f} s, TTFT p50 "
              f"{c.get('ttft_p50')} max {c.get('ttft_max')}; chat TTFT per turn "
              f"{[round(t['ttft'], 2) if 'ttft' in t else 'failed' for t in r['chat']]}; peak RSS GiB "
              f"{ {k: round(v / 2**30, 2) for k, v in r['peak_rss'].items()} }"
              + (f"; killed at {r['killed_at'] / 2**30:.1f} GiB" if r["killed_at"] else ""))
        print(f"{kind}: served sizes {[n for n in sizes if 'ttft' in (r['sizes'].get(n) or {})]}")
        itl = r["itl"] or {}
        if itl.get("quiet", {}).get("p99") and itl.get("prefill", {}).get("p99"):
            print(f"{kind}: ITL p99 {itl['quiet']['p99'] * 1e3:.0f} ms quiet, {itl['prefill']['p99'] * 1e3:.0f} ms while "
                  f"a 3840x2160 request arrives ({itl['big']}): {kind}_itl_p99_ratio="
                  f"{itl['prefill']['p99'] / itl['quiet']['p99']:.2f}")
    if set(results) == {"ours", "upstream"}:
        ours, up = results["ours"], results["upstream"]
        for name in sizes:
            a, b = ours["sizes"].get(name) or {}, up["sizes"].get(name) or {}
            if "ttft" in a and "ttft" in b:
                same = "same ids" if a["ids"] == b["ids"] else "ids differ"
                print(f"ours_vs_upstream_ttft_{name}={a['ttft'] / b['ttft']:.2f} ({same})")
        chat = [t.get("ttft") for t in ours["chat"]]
        if len(chat) >= 2 and all(chat[:2]):
            print(f"ours_turn1_vs_turn2_ttft={chat[0] / chat[1]:.1f}")
        first = sizes[0]
        a, b = ours["sizes"].get(first) or {}, up["sizes"].get(first) or {}
        if "ttft" in a and "ttft" in b:
            print(f"ours_vs_upstream_ttft_{first.split('x')[0]}={a['ttft'] / b['ttft']:.2f}")


if __name__ == "__main__":
    main()
