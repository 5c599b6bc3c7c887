"""Ours against upstream SGLang EPD, side by side in one run, on one checkpoint and the same images.

Two stacks, both up at once, each a language server fed by an encoder:

* ``sglang``: SGLang's own encoder in our encode worker, sending through the resumable connector
  to SGLang's language server (``python -m sglang.launch_server --disaggregation-mode encode`` and
  ``... language --encoder-urls``);
* ``upstream``: SGLang's ``--encoder-only`` server + ``--language-only --encoder-urls
  --encoder-transfer-backend zmq_to_scheduler`` (its ``mooncake`` backend allocates on ``cuda:``),
  started with this project's plugin turned off (``SGLANG_PLUGINS=none``).

Requests are **interleaved**: one request at a time, to each stack in turn (the first stack of a
round rotates), so a machine that gets busier or quieter during the run weighs on every stack
alike. Each stack is warmed up with three small requests. Per image size: the time to first
token of a streamed request (16 new tokens) over ``--repeats`` distinct images, median with
min..max, and our encoders' ``encode_ms`` (the encode worker's decode, preprocess and forward
pass); then per stack 8 concurrent 1920x1080 requests (distinct images) against 8 others one at a
time: throughput both ways (what SGLang's encoder batching gives), median and slowest TTFT.
A sampler reads the resident memory of each stack's encoder and language process trees every
0.2 s; a stack whose total passes ``--max-rss-gb`` is killed (that request fails) and started
again for the next one. Then, one stack at a time as before, unless ``--no-extras``: a 3-turn
chat on one 4K image sent as a ``data:`` URI each turn, and the gaps between tokens (ITL) of 8
decoding streams while nothing else arrives and while a 4K request is encoded, transferred and
prefilled. Prints a table per stack and the ratios against upstream; the last line is
``sglang_vs_upstream_ttft_448=<x>``.
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

from harness.workers import SGLANG_READY, WorkerProcess, tree_rss  # noqa: E402

SGLANG = (sys.executable, "-m", "sglang.launch_server")
SIZES = {"448x448": (448, 448), "1920x1080": (1920, 1080), "2560x1440": (2560, 1440), "3840x2160": (3840, 2160)}
NEW_TOKENS = 16
WARMUPS = 3  # small requests before anything is measured
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

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            now = {name: tree_rss(pid) for name, pid in self.roots.items()}
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


def stream(url: str | None, text: str, images: list[str], rid: str) -> dict:
    """One streamed ``/generate``: TTFT, total, ids (or the error; ``url`` None: the stack is down)."""
    if url is None:
        return {"error": "the stack is down"}
    start = time.perf_counter()
    first, ids, meta = None, [], {}
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
                meta = event.get("meta_info") or meta
                ids = event["output_ids"] if len(event["output_ids"]) >= len(ids) else ids + event["output_ids"]
    except requests.RequestException as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    if first is None:
        return {"error": "no token"}
    return {"ttft": first - start, "total": time.perf_counter() - start, "ids": ids,
            "encode_ms": meta.get("encode_ms")}


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def itl_under_prefill(url: str, kind: str, small_image: str, big_image: str, streams: int, quiet_s: float = 4.0,
                      abort_urls: list[str] | None = None) -> dict:
    """``streams`` streams decoding (448x448, ignore_eos); the gaps between their tokens over a
    quiet window, then from sending a 4K request until its first token (its encode, transfer
    and chunked prefill). Returns each window's p50/p99/max gap and the 4K request's TTFT. The
    streams end by ``/abort_request`` on ``abort_urls`` (the servers behind a router; ``url`` itself by default)."""
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
    for server in abort_urls or [url]:
        for i in range(streams):
            try:
                requests.post(f"{server}/abort_request", json={"rid": f"{kind}-itl{i}"}, timeout=30)
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


KINDS = ("sglang", "upstream")


def start_stack(kind: str, folder: str, language_args: list[str], pin: bool) -> tuple[WorkerProcess, WorkerProcess]:
    """``pin``: the encoder's processes on CPU 1, the language server's on CPU 0 (as if on two
    machines, a core each)."""
    on_cpu = (lambda cpu, command: ("taskset", "-c", str(cpu), *command)) if pin else (lambda cpu, command: command)
    if kind == "sglang":
        encode = WorkerProcess("encode", "--model-path", folder, timeout=300, command=on_cpu(1, SGLANG))
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
        self.down = ""
        self._start()

    def _start(self) -> None:
        self.encode, self.language = start_stack(self.kind, self.folder, self.language_args, self.pin)
        self.memory = Memory({"encoder": self.encode.proc.pid, "language": self.language.proc.pid}, self.limit)

    def up(self) -> str | None:
        """The language server's URL, the stack started again if a kill or a crash ended it; None
        once it could not be started again (``down`` says why)."""
        if self.down:
            return None
        if self.memory.killed_at or self.encode.proc.poll() is not None or self.language.proc.poll() is not None:
            self.stop()
            try:
                self._start()
            except RuntimeError as exc:
                self.down = f"could not be started again: {str(exc).splitlines()[0]}"
                return None
        return self.language.url

    def stop(self) -> None:
        self.memory.stop()
        for name, rss in self.memory.peak.items():
            self.peak[name] = max(self.peak[name], rss)
        self.killed_at = self.killed_at or self.memory.killed_at
        self.language.stop()
        self.encode.stop()


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def interleaved(stacks: dict[str, Stack], images: dict[str, str], sizes: list[str], repeats: int, log) -> dict:
    """Per size, ``repeats`` distinct images, each sent to every stack in turn (one request at a
    time; round ``i`` starts with stack ``i mod n``): TTFT and encode_ms per stack, with min..max."""
    kinds = list(stacks)
    rows: dict = {kind: {} for kind in kinds}
    for i in range(WARMUPS):
        for kind in kinds:
            warm = stream(stacks[kind].up(), chat_text([], "Hi."), [images[f"warmup{i}"]], f"{kind}-warmup{i}")
            log(f"[{kind}] warm-up {i}: " + (warm.get("error") or f"{warm['ttft']:.2f} s"))
    for name in sizes:
        runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
        for repeat in range(repeats):
            for kind in kinds[repeat % len(kinds):] + kinds[:repeat % len(kinds)]:
                runs[kind].append(stream(stacks[kind].up(), chat_text([], "Describe it."), [images[f"{name}.{repeat}"]],
                                         f"{kind}-{name}.{repeat}"))
        for kind in kinds:
            served = [r for r in runs[kind] if "error" not in r]
            failed = [r["error"] for r in runs[kind] if "error" in r]
            row = rows[kind][name] = {"served": len(served), "of": repeats, "error": failed[0] if failed else None,
                                      "ids": [r["ids"] for r in runs[kind]] if not failed else None}
            if served:
                row["ttft"] = spread([r["ttft"] for r in served])
                encode = [r["encode_ms"] for r in served if r.get("encode_ms") is not None]
                row["encode_ms"] = spread(encode) if encode else None
            log(f"[{kind}] {name}: {describe(row)}")
    return rows


def describe(row: dict) -> str:
    if "ttft" not in row:
        return f"failed: {row['error']}"
    t = row["ttft"]
    text = f"TTFT {t['median']:.2f} s ({t['min']:.2f}..{t['max']:.2f}, {row['served']}/{row['of']} served)"
    if row.get("encode_ms"):
        e = row["encode_ms"]
        text += f", encode {e['median']:.0f} ms ({e['min']:.0f}..{e['max']:.0f})"
    return text


def concurrency(stack: Stack, images: dict[str, str], concurrent: int, log) -> dict:
    """``concurrent`` distinct 1920x1080 requests at once, then as many others one at a time: wall time,
    throughput both ways, median and slowest TTFT at once."""
    def one(i: int, label: str) -> dict:
        return stream(stack.up(), chat_text([], "Describe it."), [images[f"hd{i}"]], f"{stack.kind}-{label}{i}")

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        together = list(pool.map(lambda i: one(i, "hd"), range(concurrent)))
    wall_together = time.perf_counter() - start
    start = time.perf_counter()
    alone = [one(concurrent + i, "hd") for i in range(concurrent)]  # other images: no cache hit
    wall_alone = time.perf_counter() - start
    served = [r for r in together if "error" not in r]
    row = {"served": len(served), "wall": wall_together, "wall_serial": wall_alone,
           "served_serial": sum("error" not in r for r in alone),
           "ttft_p50": statistics.median(r["ttft"] for r in served) if served else None,
           "ttft_max": max((r["ttft"] for r in served), default=None)}
    log(f"[{stack.kind}] {concurrent} x 1920x1080 at once: {row['served']} served in {wall_together:.2f} s; one at a "
        f"time: {row['served_serial']} in {wall_alone:.2f} s")
    return row


def extras(stack: Stack, images: dict[str, str], chat_image: str, concurrent: int, log) -> dict:
    """The chat turns and the ITL windows (module docstring), on one stack."""
    kind, rows = stack.kind, {"chat": [], "itl": None}
    turns: list[tuple[str, str]] = []
    for turn, question in enumerate(("Describe it.", "And the colours?", "Anything else?"), 1):
        row = stream(stack.up(), chat_text(turns, question), [chat_image], f"{kind}-chat{turn}")
        rows["chat"].append(row)
        log(f"[{kind}] chat turn {turn}: " + (row.get("error") or f"TTFT {row['ttft']:.2f} s"))
        if "error" in row:
            break
        turns.append((question, "ok"))
    url = stack.up()
    if url is None:
        return rows
    rows["itl"] = itl_under_prefill(url, kind, images["448x448.0"], images["itl4k"], concurrent)
    log(f"[{kind}] ITL of {concurrent} streams, quiet then while a 3840x2160 request arrives: {rows['itl']}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", help="a Qwen2.5-VL folder (default: the seeded one, hidden 3584, 1 layer)")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3, help="distinct images per size (default %(default)s)")
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--max-rss-gb", type=float, default=12.0,
                        help="a stack whose encoder + language memory passes this is killed (default %(default)s; "
                             "the three stacks share the machine)")
    parser.add_argument("--stacks", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--no-extras", action="store_true", help="skip the chat turns and the ITL windows")
    parser.add_argument("--language-args", default="", help="more flags for every language server, e.g. "
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
            for repeat in range(args.repeats):
                images[f"{name}.{repeat}"] = f"{tmp}/{name}.{repeat}.png"
                make_image(w, h, seed=300 + 10 * i + repeat).save(images[f"{name}.{repeat}"])
        for i in range(2 * args.concurrent):  # distinct images at once, then others one at a time
            images[f"hd{i}"] = f"{tmp}/hd{i}.jpg"
            make_image(1920, 1080, seed=100 + i).save(images[f"hd{i}"], quality=90)
        make_image(3840, 2160, seed=99).save(f"{tmp}/chat.png")
        images["itl4k"] = f"{tmp}/itl4k.png"  # not seen before: encoded, transferred and prefilled in full
        make_image(3840, 2160, seed=98).save(images["itl4k"])
        chat_image = "data:image/png;base64," + base64.b64encode(Path(f"{tmp}/chat.png").read_bytes()).decode()
        log(f"starting {', '.join(args.stacks)} on {folder}")
        with ThreadPoolExecutor(len(args.stacks)) as pool:
            started = {kind: pool.submit(Stack, kind, folder, args.max_rss_gb * 2**30, args.language_args.split(),
                                         args.pin_cores) for kind in args.stacks}
        stacks = {kind: future.result() for kind, future in started.items()}
        results: dict = {kind: {} for kind in stacks}
        try:
            sizes = interleaved(stacks, images, args.sizes, args.repeats, log)
            for kind, stack in stacks.items():
                results[kind] = {"sizes": sizes[kind], "concurrent": concurrency(stack, images, args.concurrent, log)}
            if not args.no_extras:
                for kind, stack in stacks.items():
                    results[kind] |= extras(stack, images, chat_image, args.concurrent, log)
        finally:
            for kind, stack in stacks.items():
                stack.stop()
                results[kind]["peak_rss"], results[kind]["killed_at"] = stack.peak, stack.killed_at
                results[kind]["down"] = stack.down
    report(results, args.sizes)


def report(results: dict, sizes: list[str]) -> None:
    print()
    for kind, r in results.items():
        print(f"== {kind}")
        for name in sizes:
            print(f"  {name:10} {describe(r['sizes'][name])}")
        c = r["concurrent"]
        print(f"  {c['served']} x 1920x1080 at once in {c['wall']:.2f} s, one at a time in "
              f"{c['wall_serial']:.2f} s: {c['wall_serial'] / c['wall']:.2f}x the throughput at once; TTFT p50 "
              f"{c['ttft_p50']} max {c['ttft_max']}")
        print(f"  peak RSS GiB {({k: round(v / 2**30, 2) for k, v in r['peak_rss'].items()})}"
              + (f"; killed at {r['killed_at'] / 2**30:.1f} GiB" if r["killed_at"] else "")
              + (f"; {r['down']}" if r["down"] else ""))
        if r.get("chat"):
            print(f"  chat TTFT per turn {[round(t['ttft'], 2) if 'ttft' in t else 'failed' for t in r['chat']]}")
        itl = r.get("itl") or {}
        if itl.get("quiet", {}).get("p99") and itl.get("prefill", {}).get("p99"):
            print(f"  ITL p99 {itl['quiet']['p99'] * 1e3:.0f} ms quiet, {itl['prefill']['p99'] * 1e3:.0f} ms while a "
                  f"3840x2160 request arrives ({itl['big']}): {kind}_itl_p99_ratio="
                  f"{itl['prefill']['p99'] / itl['quiet']['p99']:.2f}")
    if "upstream" not in results:
        return
    up = results["upstream"]["sizes"]
    for kind in [k for k in results if k != "upstream"]:
        for name in sizes:
            a, b = results[kind]["sizes"][name], up[name]
            if "ttft" in a and "ttft" in b:
                same = "same ids" if a["ids"] == b["ids"] else "ids differ"
                print(f"{kind}_vs_upstream_ttft_{name}={a['ttft']['median'] / b['ttft']['median']:.2f} ({same})")
            elif "ttft" in a:
                print(f"{kind}_vs_upstream_ttft_{name}=served only by {kind} (upstream: {b['error']})")
    first = sizes[0]
    a, b = results.get("sglang", {}).get("sizes", {}).get(first, {}), up[first]
    if "ttft" in a and "ttft" in b:
        print(f"sglang_vs_upstream_ttft_{first.split('x')[0]}={a['ttft']['median'] / b['ttft']['median']:.2f}")


if __name__ == "__main__":
    main()
