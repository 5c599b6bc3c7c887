"""Small requests beside big ones on SGLang's language server, with two encoders.

Starts two encode workers and SGLang's server in our language mode
(``python -m sglang.launch_server --disaggregation-mode language``) on the seeded checkpoint
(written to a temp folder unless ``--model-path``), on 127.0.0.1, and talks to it as OpenAI chat
clients do (the ``openai`` package, streaming; each image a ``data:`` URI of a PNG of its own,
so no embedding or radix cache hit). The time to first token (TTFT) is when the first chunk
of the stream arrives (SGLang sends it with the first generated token).

1. Lone baselines: after one warm-up request per size, 448x448, 1920x1080 and 3840x2160
   chats one at a time; the median TTFT per size.
2. The 22 small chats at once, alone: what the small ones' own concurrency costs.
3. The mix: 1 x 3840x2160, 3 x 1920x1080 and 22 x 448x448 chats sent together (the big one
   first). Per size the median TTFT and its ratio to the lone one, against the targets (448x448
   at most 3x, 3840x2160 at most 1.5x).
4. A 30,000-token text prompt sent while 8 text streams decode: the streams' inter-token gaps
   (p50/p99/max) before it and while it is prefilled, and its own TTFT.
5. 200 sequential chats (448x448, each image new): the resident memory of every process
   (both encoders, SGLang's server, scheduler and detokenizer) at the start and the end.

``--quick`` runs smaller numbers (8 small chats in the mix beside 1 x 1920x1080 and 1 x
3840x2160, a 12,000-token prompt beside 4 streams, 40 sequential chats). Every process it
started is stopped on the way out, also on Ctrl-C or a failure. Progress goes to stderr, the
results to stdout; the last lines are ``small_ttft_ratio=<x>`` and ``4k_ttft_ratio=<x>``.
Flags for SGLang's server are added with ``--language-arg`` (e.g. ``--language-arg=--chunked-prefill-size=1024``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import make_image  # noqa: E402

from harness.workers import SGLANG_READY, WorkerProcess  # noqa: E402

SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")
SIZES = {"448x448": (448, 448), "1920x1080": (1920, 1080), "3840x2160": (3840, 2160)}
SMALL, HD, BIG = SIZES
TARGETS = {SMALL: 3.0, BIG: 1.5}  # mix TTFT / lone TTFT, medians


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Scale:
    mix: dict[str, int]  # size -> chats in the mix
    lone: dict[str, int]  # size -> lone chats measured (after one warm-up each)
    long_prompt_tokens: int
    streams: int
    sequential: int
    max_tokens: int = 8  # tokens per chat answer


FULL = Scale({BIG: 1, HD: 3, SMALL: 22}, {SMALL: 3, HD: 1, BIG: 2}, 30_000, 8, 200)
QUICK = Scale({BIG: 1, HD: 1, SMALL: 8}, {SMALL: 2, HD: 1, BIG: 1}, 12_000, 4, 40)


class Images:
    """PNG ``data:`` URIs, a new image for every request (seeded), made on a thread in the order
    they will be asked for."""

    def __init__(self, order: list[str]) -> None:
        self._made: dict[str, list[str]] = {size: [] for size in SIZES}
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._make_all, args=(order,), name="make-images", daemon=True)
        self._thread.start()

    def _make_all(self, order: list[str]) -> None:
        for seed, size in enumerate(order, 1):
            buffer = io.BytesIO()
            make_image(*SIZES[size], seed=seed).save(buffer, format="PNG")
            uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
            with self._ready:
                self._made[size].append(uri)
                self._ready.notify_all()

    def wait_all(self) -> None:
        """Until every image is made: none is made on this process's CPU while a chat is timed."""
        self._thread.join()

    def take(self, size: str) -> str:
        with self._ready:
            if not self._ready.wait_for(lambda: self._made[size], timeout=600):
                raise RuntimeError(f"no {size} image was made within 600 s")
            return self._made[size].pop(0)


@dataclass
class Answer:
    size: str
    sent: float
    first: float | None = None
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (arrival, gap since the previous chunk)
    end: float | None = None
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.first - self.sent


def chat(client, size: str, content, max_tokens: int, keep_gaps: bool = False, stop: threading.Event | None = None,
         ) -> Answer:
    """One streaming chat; ``stop`` ends it early (the stream is closed: SGLang aborts it)."""
    answer = Answer(size, time.monotonic())
    try:
        stream = client.chat.completions.create(model="seeded", max_tokens=max_tokens, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": content}],
                                                extra_body={"ignore_eos": True})
        last = None
        with stream:
            for _ in stream:
                now = time.monotonic()
                if answer.first is None:
                    answer.first = now
                elif keep_gaps:
                    answer.gaps.append((now, now - last))
                last = now
                if stop is not None and stop.is_set():
                    break
        answer.end = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported with the results
        answer.error = f"{type(exc).__name__}: {exc}"[:300]
    return answer


def image_chat(client, images: Images, size: str, max_tokens: int) -> Answer:
    content = [{"type": "image_url", "image_url": {"url": images.take(size)}},
               {"type": "text", "text": "Describe it."}]
    return chat(client, size, content, max_tokens)


def checked(answers: list[Answer]) -> list[Answer]:
    failed = [a for a in answers if a.error or a.first is None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(answers)} chats failed: {failed[0].error or 'no token'}")
    return answers


def median_ttft(answers: list[Answer], size: str) -> float:
    return statistics.median(a.ttft for a in answers if a.size == size)


def at_once(client, images: Images, counts: dict[str, int], max_tokens: int) -> list[Answer]:
    """All chats sent together (the biggest first), each on its own thread; images taken first."""
    order = [size for size in (BIG, HD, SMALL) for _ in range(counts.get(size, 0))]
    contents = [[{"type": "image_url", "image_url": {"url": images.take(size)}},
                 {"type": "text", "text": "Describe it."}] for size in order]
    with ThreadPoolExecutor(len(order)) as pool:
        futures = [pool.submit(chat, client, size, content, max_tokens) for size, content in zip(order, contents, strict=True)]
        return checked([f.result() for f in futures])


def percentiles(values: list[float]) -> str:
    if not values:
        return "no gaps"
    ordered = sorted(values)
    p = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return f"p50 {p(0.5) * 1e3:7.1f} ms  p99 {p(0.99) * 1e3:7.1f} ms  max {ordered[-1] * 1e3:7.1f} ms  ({len(values)} gaps)"


def long_prompt_case(client, tokens: int, streams: int, log_each=log) -> dict:
    """``streams`` text chats decode; after a few seconds a ``tokens``-token prompt is sent;
    the streams' gaps before it and while it is prefilled (until its first token)."""
    stop = threading.Event()
    # The seeded tokenizer is byte level: one ASCII character is one token (plus the chat template's).
    prompt = ("All work and no play makes a dull model. " * (tokens // 40 + 1))[:tokens - 20]
    with ThreadPoolExecutor(streams + 1) as pool:
        running = [pool.submit(chat, client, "stream", f"Stream {i}: tell a long story.", 30_000, True, stop)
                   for i in range(streams)]
        time.sleep(6.0)  # every stream past its prefill, decoding
        sent = time.monotonic()
        log_each(f"  sending the {tokens}-token prompt beside {streams} decoding streams")
        long = chat(client, "long", prompt, 1)
        time.sleep(2.0)
        stop.set()
        answers = [f.result() for f in running]
    if long.error or long.first is None:
        raise RuntimeError(f"the long prompt failed: {long.error}")
    failed = [a.error for a in answers if a.error]
    if failed:
        raise RuntimeError(f"a decoding stream failed: {failed[0]}")
    before = [g for a in answers for at, g in a.gaps if sent - 4.0 <= at - g and at < sent]
    # every gap that overlaps the prefill, the one a stream waited through it included
    during = [g for a in answers for at, g in a.gaps if at >= sent and at - g <= long.first]
    return {"long_ttft_s": long.ttft, "before": before, "during": during}


def rss_by_process(workers: dict[str, WorkerProcess]) -> dict[str, int]:
    """Resident bytes of each worker process and of each of SGLang's child processes."""
    sizes = {}
    for name, worker in workers.items():
        proc = psutil.Process(worker.proc.pid)
        sizes[name] = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                label = child.cmdline()[0] if child.cmdline() and "::" in child.cmdline()[0] else child.name()
                sizes[f"{name}/{label}"] = child.memory_info().rss
            except psutil.Error:
                pass
    return sizes


def sequential_case(client, images: Images, count: int, workers: dict[str, WorkerProcess], max_tokens: int) -> dict:
    start = rss_by_process(workers)
    marks = {0: start}
    for i in range(1, count + 1):
        checked([image_chat(client, images, SMALL, max_tokens)])
        if i % max(1, count // 4) == 0 or i == count:
            marks[i] = rss_by_process(workers)
            log(f"  {i}/{count} sequential chats; RSS " + ", ".join(
                f"{name} {rss / 2**20:.0f} MiB" for name, rss in marks[i].items()))
    return marks


def start_workers(folder: str, encoders: int, language_args: list[str]) -> dict[str, WorkerProcess]:
    """The encoders, then SGLang's server on them; the ones started are stopped if one fails."""
    started: dict[str, WorkerProcess] = {}
    try:
        with ThreadPoolExecutor(encoders) as pool:
            for i, f in enumerate([pool.submit(WorkerProcess, "encode", "--model-path", folder)
                                   for _ in range(encoders)]):
                started[f"encoder{i + 1}"] = f.result()
        urls = [w.url for w in started.values()]
        started["language"] = WorkerProcess("language", "--model-path", folder, "--encoder-urls", *urls,
                                            *language_args, command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=400)
    except BaseException:
        stop_workers(started)
        raise
    return started


def stop_workers(workers: dict[str, WorkerProcess]) -> None:
    for name, worker in reversed(list(workers.items())):
        try:
            code = worker.stop()
            log(f"stopped {name} (pid {worker.proc.pid}, exit {code})")
        except Exception as exc:  # noqa: BLE001 - go on stopping the others
            log(f"stopping {name} failed: {exc}")


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="checkpoint folder (default: the seeded one, hidden 256 and 2 layers, "
                                         "written to a temp folder)")
    ap.add_argument("--quick", action="store_true", help="smaller numbers (see the module docstring)")
    ap.add_argument("--encoders", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=131072,
                    help="SGLang's KV pool in tokens (default 131072; 0: SGLang's own sizing)")
    ap.add_argument("--language-arg", action="append", default=[], metavar="FLAG",
                    help="a flag for SGLang's server, e.g. --language-arg=--chunked-prefill-size=1024 (repeatable)")
    ap.add_argument("--skip", action="append", default=[], choices=["long", "sequential"],
                    help="leave out the 30K-prompt case or the sequential one")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    scale = QUICK if args.quick else FULL
    language_args = list(args.language_arg)
    if args.max_total_tokens:
        language_args += ["--max-total-tokens", str(args.max_total_tokens)]
    sequential = 0 if "sequential" in args.skip else scale.sequential
    # in the order they are sent: warm-up, lone, the small ones alone, the mix, the sequential chats
    order = [*SIZES, *(s for s, n in scale.lone.items() for _ in range(n)), *[SMALL] * scale.mix[SMALL],
             *(s for s in (BIG, HD, SMALL) for _ in range(scale.mix[s])), *[SMALL] * sequential]
    signal.signal(signal.SIGTERM, interrupted)  # as Ctrl-C: the finally below stops every worker either way
    results: dict = {"scale": "quick" if args.quick else "full", "language_args": language_args}
    workers: dict[str, WorkerProcess] = {}
    with tempfile.TemporaryDirectory(prefix="bench-mix-") as tmp:
        try:
            log(f"making {len(order)} images on a thread")
            images = Images(order)
            folder = args.model_path or str(write_checkpoint(Path(tmp) / "seeded", 256, layers=2))
            log(f"starting {args.encoders} encoders and SGLang's language server on {folder} "
                f"(flags: {' '.join(language_args) or 'none'}); SGLang takes about a minute here")
            t0 = time.monotonic()
            workers = start_workers(folder, args.encoders, language_args)
            log(f"workers up in {time.monotonic() - t0:.0f} s: " + ", ".join(
                f"{n} pid {w.proc.pid}" for n, w in workers.items()))
            from openai import OpenAI

            client = OpenAI(base_url=f"{workers['language'].url}/v1", api_key="none", timeout=900, max_retries=0)
            run(client, images, scale, workers, results, args.skip, sequential)
        except KeyboardInterrupt:
            log("interrupted: stopping the workers")
            raise SystemExit(130) from None
        finally:
            stop_workers(workers)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def run(client, images: Images, scale: Scale, workers: dict[str, WorkerProcess], results: dict, skip: list[str],
        sequential: int) -> None:
    images.wait_all()
    log("warm-up: one chat per size")
    for size in SIZES:
        checked([image_chat(client, images, size, scale.max_tokens)])
    lone: dict[str, float] = {}
    for size, count in scale.lone.items():
        answers = checked([image_chat(client, images, size, scale.max_tokens) for _ in range(count)])
        lone[size] = statistics.median(a.ttft for a in answers)
        log(f"lone {size}: TTFT " + ", ".join(f"{a.ttft:.2f}" for a in answers) + " s")
    results["lone_ttft_s"] = lone

    small_count = scale.mix[SMALL]
    log(f"{small_count} x {SMALL} at once, alone")
    alone = at_once(client, images, {SMALL: small_count}, scale.max_tokens)
    results["smalls_alone_ttft_s"] = alone_median = median_ttft(alone, SMALL)

    log("the mix: " + ", ".join(f"{n} x {s}" for s, n in scale.mix.items()) + ", sent together")
    t0 = time.monotonic()
    mix = at_once(client, images, scale.mix, scale.max_tokens)
    log(f"  every answer in after {max(a.end for a in mix) - t0:.1f} s")
    results["mix"] = [{"size": a.size, "ttft_s": round(a.ttft, 3), "answer_s": round(a.end - a.sent, 3)} for a in mix]

    print(f"\n{'size':>10} {'lone TTFT':>10} {'mix TTFT p50':>13} {'mix TTFT max':>13} {'answer p50':>11} "
          f"{'mix/lone':>9} {'target':>7}")
    ratios = {}
    for size in SIZES:
        in_mix = [a for a in mix if a.size == size]
        if not in_mix:
            continue
        ratios[size] = ratio = median_ttft(mix, size) / lone[size]
        target = f"<= {TARGETS[size]:g}x" if size in TARGETS else ""
        verdict = ("met" if ratio <= TARGETS[size] else "MISSED") if size in TARGETS else ""
        print(f"{size:>10} {lone[size]:>9.2f}s {median_ttft(mix, size):>12.2f}s "
              f"{max(a.ttft for a in in_mix):>12.2f}s {statistics.median(a.end - a.sent for a in in_mix):>10.2f}s "
              f"{ratio:>8.2f}x {target:>7} {verdict}")
    print(f"{small_count} x {SMALL} alone, at once: TTFT p50 {alone_median:.2f}s "
          f"({alone_median / lone[SMALL]:.2f}x lone): the small ones' own concurrency")
    results["ratios"] = ratios

    if "long" not in skip:
        log(f"a {scale.long_prompt_tokens}-token prompt while {scale.streams} streams decode")
        long = long_prompt_case(client, scale.long_prompt_tokens, scale.streams)
        print(f"\n{scale.long_prompt_tokens}-token prompt beside {scale.streams} decoding streams: its TTFT "
              f"{long['long_ttft_s']:.2f}s; the streams' inter-token gaps")
        print(f"  before: {percentiles(long['before'])}")
        print(f"  during: {percentiles(long['during'])}")
        results["long_prompt"] = {"ttft_s": long["long_ttft_s"], "before_s": long["before"], "during_s": long["during"]}

    if sequential:
        log(f"{sequential} sequential chats ({SMALL}, a new image each)")
        marks = sequential_case(client, images, sequential, workers, scale.max_tokens)
        first, last = marks[0], marks[max(marks)]
        print(f"\nresident memory over {sequential} sequential chats:")
        for name in first:
            if name in last:
                print(f"  {name:>40}: {first[name] / 2**20:8.1f} MiB -> {last[name] / 2**20:8.1f} MiB "
                      f"({(last[name] - first[name]) / 2**20:+.1f})")
        results["rss"] = {str(k): v for k, v in marks.items()}

    print(f"\nsmall_ttft_ratio={ratios[SMALL]:.2f}")
    print(f"4k_ttft_ratio={ratios[BIG]:.2f}")


if __name__ == "__main__":
    main()
