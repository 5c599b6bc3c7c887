"""Generation end to end: where the time to first token goes, and what disaggregation costs
against SGLang's own monolithic server, side by side in one run.

Two stacks up at once on one checkpoint folder (the seeded one unless ``--model-path``), SGLang's
server on both, the same flags (on a CPU: ``--device cpu --attention-backend torch_native
--sleep-on-idle --enable-mixed-chunk``, the CPU defaults of our language mode, and
``--max-total-tokens``):

* ``epd``: SGLang's own encoder in our encode worker (``python -m sglang.launch_server
  --disaggregation-mode encode``) and SGLang's server as the language worker (``...
  --disaggregation-mode language --encoder-urls``), the embedding through the resumable connector;
* ``monolithic``: ``python -m sglang.launch_server --model-path X``, no disaggregation: SGLang
  loads and preprocesses the image in its tokenizer manager and runs the vision tower in its
  scheduler, before the prefill.

Each stack gets two small warm-up requests. Then per image size, ``--reps`` distinct images (no
cache hit anywhere), each sent to both stacks in turn (one request at a time; which stack goes
first alternates), ``/generate`` of ``--new-tokens`` greedy tokens. The time to first token is
SGLang's own ``first_token_latency`` (from the request's arrival at its tokenizer manager; the
same clock on both stacks); ``meta_info`` (``--enable-metrics``) splits it:

* epd: encode (the encoder's ``encode_ms``: decode + preprocess + tower), transfer (the
  connector's ``transfer_ms``, from the room's start to the embedding assembled on the language
  side, less the encoder's own work: the ``/encode`` call, the wire, the resume rounds), prefill
  (SGLang's scheduler: first forward pass to the end of the prefill) and other (SGLang's inputs,
  its queue, waiting for pool blocks);
* monolithic: preprocess (the tokenizer manager: image load, resize, patches), prefill (with the
  vision tower) and other.

Medians over the repetitions; ``ratio`` = epd TTFT / monolithic TTFT (median of the per-image
ratios, min..max); ``same ids`` counts the images both stacks answered with the same ids. The last
line is ``epd_vs_monolithic_ttft_<size>=<x>`` for the last size (the largest by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import requests  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import make_image  # noqa: E402

from harness.workers import SGLANG_READY, WorkerProcess, free_port, start_together  # noqa: E402

SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")
SIZES = ((448, 448), (1024, 1024), (2048, 2048), (3840, 2160))
P = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{P}Describe it.<|im_end|>\n<|im_start|>assistant\n"
STACKS = ("epd", "monolithic")
WARMUPS = 2
CLEAN_EXITS = {0, -2}  # SIGINT: 0, or -2 where SGLang's launcher lets the KeyboardInterrupt end it


def cpu_flags() -> list[str]:
    """What our language mode adds on a CPU (sglang_ext/language_flags.py), given to both stacks."""
    import torch

    if torch.cuda.is_available():
        return []
    return ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle", "--enable-mixed-chunk"]


def start_stacks(folder: str, max_total_tokens: int, timeout: float) -> dict[str, WorkerProcess]:
    """The encode worker, the language server and the monolithic server, started at once."""
    common = ["--model-path", folder, "--skip-server-warmup", "--enable-metrics", "--max-total-tokens",
              str(max_total_tokens), *cpu_flags()]
    encode_port = free_port()
    starts = {
        "encode": lambda: WorkerProcess("encode", "--model-path", folder, port=encode_port,
                                        command=SGLANG_LAUNCH, timeout=timeout),
        "epd": lambda: WorkerProcess("language", *common, "--encoder-urls", f"http://127.0.0.1:{encode_port}",
                                     command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=timeout),
        # WorkerProcess adds --disaggregation-mode null: SGLang's own default, no disaggregation
        "monolithic": lambda: WorkerProcess("null", *common, command=SGLANG_LAUNCH, ready=SGLANG_READY,
                                            timeout=timeout),
    }
    return dict(zip(starts, start_together(*starts.values()), strict=True))


def split(stack: str, meta: dict) -> dict:
    """The TTFT of one response and its parts, in ms (module docstring)."""
    ttft = meta["first_token_latency"] * 1e3
    parts = {"ttft_ms": ttft, "prefill_ms": (meta["prefill_finished_time"] - meta["forward_entry_time"]) * 1e3}
    if stack == "epd":
        parts |= {"encode_ms": meta["encode_ms"], "transfer_ms": max(meta["transfer_ms"] - meta["encode_ms"], 0.0)}
    else:
        parts["preprocess_ms"] = (meta["api_server_dispatch_finish_ts"] - meta["request_received_ts"]) * 1e3
    parts["other_ms"] = ttft - sum(v for k, v in parts.items() if k != "ttft_ms")
    return parts


def generate(url: str, rid: str, path: str, new_tokens: int) -> dict:
    answer = requests.post(f"{url}/generate", timeout=900, json={
        "rid": rid, "text": PROMPT, "image_data": [path],
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}})
    if answer.status_code != 200:
        raise SystemExit(f"{rid}: {answer.status_code} {answer.text[:300]}")
    return answer.json()


def measure(servers: dict[str, WorkerProcess], sizes, reps: int, new_tokens: int, tmp: str, log) -> list[dict]:
    for i in range(WARMUPS):
        make_image(224, 224, seed=900 + i).save(f"{tmp}/warm{i}.png")
        for stack in STACKS:
            meta = generate(servers[stack].url, f"{stack}-warm{i}", f"{tmp}/warm{i}.png", 1)["meta_info"]
            log(f"  [{stack}] warm-up {i}: TTFT {meta['first_token_latency'] * 1e3:.0f} ms")
    rows = []
    for w, h in sizes:
        runs: dict[str, list[dict]] = {stack: [] for stack in STACKS}
        for rep in range(reps):
            path = f"{tmp}/{w}x{h}.{rep}.png"
            make_image(w, h, seed=w + h + rep).save(path)
            for stack in (STACKS if rep % 2 == 0 else STACKS[::-1]):
                out = generate(servers[stack].url, f"{stack}-{w}x{h}.{rep}", path, new_tokens)
                meta = out["meta_info"]
                runs[stack].append({**split(stack, meta), "ids": out["output_ids"], "image_tokens": meta["image_tokens"],
                                    "resume_rounds": meta.get("resume_rounds")})
        row: dict = {"image": f"{w}x{h}", "image_tokens": runs["epd"][0]["image_tokens"],
                     "resume_rounds": runs["epd"][0]["resume_rounds"]}
        if {r["image_tokens"] for stack in STACKS for r in runs[stack]} != {row["image_tokens"]}:
            raise SystemExit(f"{w}x{h}: the stacks made different image token counts: {runs}")
        for stack in STACKS:
            row[stack] = {key: round(statistics.median(r[key] for r in runs[stack]), 1)
                          for key in runs[stack][0] if key.endswith("_ms")}
        ratios = [e["ttft_ms"] / m["ttft_ms"] for e, m in zip(runs["epd"], runs["monolithic"], strict=True)]
        row |= {"ratio": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
                "ratio_max": round(max(ratios), 3), "same_ids": sum(e["ids"] == m["ids"] for e, m in
                                                                     zip(runs["epd"], runs["monolithic"], strict=True)),
                "reps": reps}
        rows.append(row)
        log(f"  {row}")
    return rows


def plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    for offset, stack, parts in ((-0.2, "epd", ("encode", "transfer", "prefill", "other")),
                                 (0.2, "monolithic", ("preprocess", "prefill", "other"))):
        bottom = [0.0] * len(rows)
        for part in parts:
            values = [r[stack][f"{part}_ms"] for r in rows]
            ax.bar([i + offset for i in x], values, width=0.4, bottom=bottom, label=f"{stack}: {part}")
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(list(x), [r["image"] for r in rows])
    ax.set_ylabel("time to first token (ms)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="checkpoint folder (default: the seeded one, written to a temp folder)")
    ap.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZES), help="WxH,...")
    ap.add_argument("--reps", type=int, default=3, help="distinct images per size")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--max-total-tokens", type=int, default=32768, help="both servers' KV pool")
    ap.add_argument("--quick", action="store_true", help="448x448 only, one repetition")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--plot", help="write a PNG here (matplotlib)")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    reps = args.reps
    if args.quick:
        sizes, reps = [(448, 448)], 1
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # progress; the table goes to stdout
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_path or str(write_checkpoint(Path(tmp) / "seeded", 3584))
        log("starting the encode worker, SGLang's language server and SGLang's monolithic server ...")
        servers = start_stacks(folder, args.max_total_tokens, 600)
        log(f"all up after {time.perf_counter() - began:.0f} s")
        try:
            rows = measure(servers, sizes, reps, args.new_tokens, tmp, log)
        finally:
            codes = {name: server.stop() for name, server in servers.items()}
    if not set(codes.values()) <= CLEAN_EXITS:
        raise SystemExit(f"servers exited with {codes}")
    print(f"time to first token, ms, medians of {reps}; epd = our encode worker + SGLang's language server through "
          f"the connector, monolithic = SGLang's server alone")
    print(f"{'image':>10} {'tokens':>7} {'rounds':>6} | {'epd TTFT':>8} {'encode':>7} {'transfer':>8} {'prefill':>8} "
          f"{'other':>6} | {'mono TTFT':>9} {'preproc':>7} {'prefill':>8} {'other':>6} | {'ratio (min..max)':>18} "
          f"{'same ids':>8}")
    for r in rows:
        e, m = r["epd"], r["monolithic"]
        print(f"{r['image']:>10} {r['image_tokens']:>7} {r['resume_rounds']:>6} | {e['ttft_ms']:>8.0f} "
              f"{e['encode_ms']:>7.0f} {e['transfer_ms']:>8.0f} {e['prefill_ms']:>8.0f} {e['other_ms']:>6.0f} | "
              f"{m['ttft_ms']:>9.0f} {m['preprocess_ms']:>7.0f} {m['prefill_ms']:>8.0f} {m['other_ms']:>6.0f} | "
              f"{r['ratio']:>6.2f} ({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) {r['same_ids']:>4}/{r['reps']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(args.plot, rows)
    log(f"done in {time.perf_counter() - began:.0f} s")
    print(f"epd_vs_monolithic_ttft_{rows[-1]['image']}={rows[-1]['ratio']:.3f}")


if __name__ == "__main__":
    main()
