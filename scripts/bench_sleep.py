"""Sleep and wake of SGLang's server (the language worker) in the middle of decoding: level 1
(SGLang pauses in place, the KV kept) against level 2 (SGLang retracts, the KV freed and
recomputed at wake-up), measured side by side in one run.

An encode worker (SGLang's encoder: ``python -m sglang.launch_server
--disaggregation-mode encode``) and SGLang's server as the language worker
(``... --disaggregation-mode language --encoder-urls``, ``--disable-radix-cache``: every run of
a request is prefilled from scratch, so a run compares with another only through the sleep) on
one checkpoint folder (the seeded one, hidden 3584, one layer, 2 KiB of KV per token, unless
``--model-path``). For each count N and repetition, with N distinct 448x448 images (one per
stream), three runs of the same N greedy streams (``ignore_eos``, ``--new-tokens`` each):

* ``awake``: no sleep, the reference;
* ``level 1``: ``POST /sleep?level=1&preserve_state=true`` once every stream has 8 tokens,
  ``--asleep`` seconds asleep, ``POST /wake_up``;
* ``level 2``: the same with ``level=2`` (SGLang also releases its memory occupation: on a CPU
  its KV cache is flushed, the weights stay).

Reported per mode and N (medians over the repetitions): the KV the streams held when the sleep
came (their tokens x the model's KV bytes per token), the sleep and the wake-up as a client sees
them (HTTP), the wait from sending the wake-up to each stream's next token (median over the
streams) against the inter-token latency before the sleep, the resident memory of the language
server's processes asleep against before the sleep, SGLang's retractions, and how many streams
ended with the ids of their awake run. ``ratio`` = level 2's (sleep + wake-up -> next token)
over level 1's; the last line is ``level2_vs_level1_sleep_wake_<N>=<x>`` (N = 8 if measured,
else the largest).

Level 1 moves no byte, so its cost does not grow with the KV; level 2's wake-up prefills every
stream's prompt and tokens so far again, which grows with the model's compute per token: a
narrow model with a 7B's KV geometry would not tell what a 7B pays, so no such shape is run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transfer_large_image import make_image  # noqa: E402

from harness.workers import SGLANG_READY, WorkerProcess, free_port, start_together, tree_rss  # noqa: E402

SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")
P = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{P}Describe it.<|im_end|>\n<|im_start|>assistant\n"
MODES = ("level 1", "level 2")
BEFORE_SLEEP = 8  # tokens every stream has before the sleep
CLEAN_EXITS = {0, -2}  # SIGINT: 0, or -2 where SGLang's launcher lets the KeyboardInterrupt end it


def kv_bytes_per_token(folder: str) -> int:
    """2 (K and V) x layers x KV heads x head dim x the dtype's bytes, from the folder's config."""
    config = json.loads((Path(folder) / "config.json").read_text())
    text = config.get("text_config") or config
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return 2 * text["num_hidden_layers"] * (text.get("num_key_value_heads") or heads) * head_dim * (
        4 if dtype in ("float32", "float") else 2)


def start_workers(folder: str, max_total_tokens: int, timeout: float) -> tuple[WorkerProcess, WorkerProcess]:
    encode_port = free_port()
    encode, language = start_together(
        lambda: WorkerProcess("encode", "--model-path", folder, port=encode_port,
                              command=SGLANG_LAUNCH, timeout=timeout),
        lambda: WorkerProcess("language", "--model-path", folder, "--encoder-urls", f"http://127.0.0.1:{encode_port}",
                              "--skip-server-warmup", "--disable-radix-cache", "--max-total-tokens",
                              str(max_total_tokens), command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=timeout))
    return encode, language


class Stream:
    """One streamed greedy ``/generate``, read on a thread: each event's arrival and ids."""

    def __init__(self, url: str, rid: str, image: str, new_tokens: int) -> None:
        self.rid, self.new_tokens = rid, new_tokens
        self.arrivals: list[float] = []
        self.events: list[dict] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._read, args=(url, image), daemon=True)
        self._thread.start()

    def _read(self, url: str, image: str) -> None:
        body = {"rid": self.rid, "text": PROMPT, "image_data": [image], "stream": True,
                "sampling_params": {"max_new_tokens": self.new_tokens, "temperature": 0, "ignore_eos": True}}
        try:
            with requests.post(f"{url}/generate", json=body, stream=True, timeout=900) as answer:
                if answer.status_code != 200:
                    self.error = f"{answer.status_code} {answer.text[:300]}"
                    return
                for line in answer.iter_lines():
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = str(event["error"])[:300]
                            return
                        self.arrivals.append(time.perf_counter())
                        self.events.append(event)
        except requests.RequestException as exc:
            self.error = f"{type(exc).__name__}: {str(exc)[:300]}"

    def tokens(self) -> int:
        return len(self.ids())

    def ids(self) -> list[int]:
        """The ids so far, whether SGLang sends each event's new ids or all of them."""
        if not self.events:
            return []
        last = self.events[-1]["output_ids"]
        total = self.events[-1].get("meta_info", {}).get("completion_tokens", len(last))
        return last if len(last) == total else [t for e in self.events for t in e["output_ids"]]

    def join(self) -> dict:
        self._thread.join(900)
        if self.error or self._thread.is_alive():
            raise SystemExit(f"stream {self.rid}: {self.error or 'no end'}")
        return self.events[-1]["meta_info"]


def one_run(url: str, pid: int, images: list[str], mode: str | None, new_tokens: int, asleep_s: float, kv_per_token: int,
            rids) -> dict:
    """N streams (one per image); with ``mode``, a sleep of that level once each has
    :data:`BEFORE_SLEEP` tokens, and a wake-up ``asleep_s`` later."""
    streams = [Stream(url, f"s{next(rids)}", image, new_tokens) for image in images]
    if mode is None:
        metas = [s.join() for s in streams]
        return {"ids": [s.ids() for s in streams], "retractions": sum(m["num_retractions"] for m in metas)}
    deadline = time.monotonic() + 600
    while min(len(s.arrivals) for s in streams) < BEFORE_SLEEP:
        if time.monotonic() > deadline or any(s.error for s in streams):
            raise SystemExit("the streams did not start: " + "; ".join(s.error or "" for s in streams))
        time.sleep(0.005)
    before = {s.rid: list(s.arrivals) for s in streams}
    rss_before = tree_rss(pid)
    level = mode.split()[-1]
    t0 = time.perf_counter()
    slept = requests.post(f"{url}/sleep", params={"level": level, "preserve_state": "true"}, timeout=300)
    sleep_s = time.perf_counter() - t0
    if slept.status_code != 200 or not slept.json().get("is_sleeping"):
        raise SystemExit(f"/sleep?level={level}: {slept.status_code} {slept.text[:300]}")
    tokens_at_sleep = sum(s.tokens() for s in streams)
    time.sleep(asleep_s)
    rss_asleep = tree_rss(pid)
    seen = {s.rid: len(s.arrivals) for s in streams}  # what arrived before the wake-up
    wake_sent = time.perf_counter()
    woke = requests.post(f"{url}/wake_up", timeout=300)
    wake_s = time.perf_counter() - wake_sent
    if woke.status_code != 200:
        raise SystemExit(f"/wake_up: {woke.status_code} {woke.text[:300]}")
    metas = [s.join() for s in streams]
    late = [s.rid for s in streams if len(s.arrivals) <= seen[s.rid]]
    if late:
        raise SystemExit(f"streams {late} had ended before the wake-up: raise --new-tokens")
    itl = statistics.median(b - a for times in before.values() for a, b in itertools.pairwise(times[2:]))
    next_token = statistics.median(s.arrivals[seen[s.rid]] - wake_sent for s in streams)
    prompt_tokens = metas[0]["prompt_tokens"]
    return {"ids": [s.ids() for s in streams], "retractions": sum(m["num_retractions"] for m in metas),
            "kv_bytes": (len(streams) * prompt_tokens + tokens_at_sleep) * kv_per_token, "sleep_s": sleep_s,
            "wake_s": wake_s, "next_token_s": next_token, "itl_s": itl, "rss_before": rss_before,
            "rss_asleep": rss_asleep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="Qwen2.5-VL folder (default: the seeded one, hidden 3584, one layer)")
    ap.add_argument("--counts", default="1,8,32", help="streams decoding at once")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128, help="per stream")
    ap.add_argument("--asleep", type=float, default=0.5, help="seconds between the sleep and the wake-up")
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # progress; the table goes to stdout
    began = time.perf_counter()
    rows: list[dict] = []
    rids = itertools.count()
    with tempfile.TemporaryDirectory(prefix="bench-sleep-") as tmp:
        folder = args.model_path
        if folder is None:
            from make_checkpoint import write_checkpoint

            folder = str(write_checkpoint(Path(tmp) / "seeded", 3584))
        kv_per_token = kv_bytes_per_token(folder)
        images = []
        for i in range(max(counts)):
            images.append(f"{tmp}/{i}.png")
            make_image(448, 448, seed=500 + i).save(images[-1])
        log("starting the encode worker and SGLang's language server ...")
        # every stream's prompt (~290 tokens) and tokens, twice over
        encode, language = start_workers(folder, max(32768, 2 * max(counts) * (300 + args.new_tokens)), 600)
        log(f"both up after {time.perf_counter() - began:.0f} s")
        try:
            for rep, n in itertools.product(range(args.reps), counts):
                awake = one_run(language.url, language.proc.pid, images[:n], None, args.new_tokens, 0, kv_per_token,
                                rids)
                order = MODES if rep % 2 == 0 else MODES[::-1]
                for mode in order:
                    run = one_run(language.url, language.proc.pid, images[:n], mode, args.new_tokens, args.asleep,
                                  kv_per_token, rids)
                    equal = sum(a == b for a, b in zip(run.pop("ids"), awake["ids"], strict=True))
                    rows.append({"mode": mode, "n": n, "rep": rep, "equal": equal, **run})
                    log(f"  repetition {rep + 1}/{args.reps}, {n} streams, {mode}: sleep {run['sleep_s'] * 1e3:.0f} "
                        f"ms, wake {run['wake_s'] * 1e3:.0f} ms, next token {run['next_token_s'] * 1e3:.0f} ms, "
                        f"{equal}/{n} streams as awake, {run['retractions']} retractions")
        finally:
            codes = language.stop(), encode.stop()
    if not set(codes) <= CLEAN_EXITS:
        raise SystemExit(f"workers exited with {codes} (language, encode)")
    print(f"\nsleep + wake-up of SGLang's server mid-decode, {args.reps} repetitions, medians; {args.new_tokens} greedy "
          f"tokens per stream, {args.asleep} s asleep; ratio = level 2's (sleep + wake-up -> next token) over level 1's")
    print(f"{'mode':<8} {'N':>3} {'KV MiB':>7} {'sleep ms':>9} {'wake ms':>8} {'wake→next ms':>12} {'ITL ms':>7} "
          f"{'next/ITL':>8} {'RSS asleep-before MiB':>22} {'retractions':>11} {'ids as awake':>12} {'ratio':>6}")
    ratios: dict[int, float] = {}
    summary = []
    for n, mode in itertools.product(counts, MODES):
        sel = [r for r in rows if (r["mode"], r["n"]) == (mode, n)]
        med = {k: statistics.median(r[k] for r in sel) for k in ("kv_bytes", "sleep_s", "wake_s", "next_token_s",
                                                                   "itl_s", "retractions")}
        med["rss_delta"] = statistics.median(r["rss_asleep"] - r["rss_before"] for r in sel)
        equal, total = sum(r["equal"] for r in sel), n * len(sel)
        cost = {m: [r["sleep_s"] + r["next_token_s"] for r in rows if (r["mode"], r["n"]) == (m, n)] for m in MODES}
        ratio = statistics.median(b / a for a, b in zip(cost["level 1"], cost["level 2"], strict=True))
        ratios[n] = ratio
        summary.append({"mode": mode, "n": n, **med, "equal": equal, "of": total,
                        "ratio": ratio if mode == "level 2" else 1.0})
        print(f"{mode:<8} {n:>3} {med['kv_bytes'] / 2**20:>7.1f} {med['sleep_s'] * 1e3:>9.1f} {med['wake_s'] * 1e3:>8.1f} "
              f"{med['next_token_s'] * 1e3:>12.1f} {med['itl_s'] * 1e3:>7.1f} {med['next_token_s'] / med['itl_s']:>8.2f} "
              f"{med['rss_delta'] / 2**20:>22.1f} {med['retractions']:>11.0f} {f'{equal}/{total}':>12} "
              f"{ratio if mode == 'level 2' else 1.0:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    log(f"done in {time.perf_counter() - began:.0f} s")
    n = 8 if 8 in counts else max(counts)
    print(f"level2_vs_level1_sleep_wake_{n}={ratios[n]:.2f}")


if __name__ == "__main__":
    main()
