"""Generation end to end: where the time to first token goes, and what the engine costs in decode.

Part 1, through real worker processes on one checkpoint folder (the seeded one unless
``--model-path``): for each image size, ``/encode`` + ``/generate`` (one new token), with the
time to first token split into encode (decode + preprocess + vision tower, from the encode
worker's reply), transfer (from the encoder having the embedding to the language side holding
all of it, resume rounds included: the encode worker's ``send_ms``), prefill and the rest (HTTP,
the digest and copy out of the pool, prompt building, queueing). Medians over ``--reps``.

Part 2, in this process on the same folder: decode tokens/s of the engine with 1, 4 and 16 text
requests running, against a bare loop of the same model's forward calls over the same number of
sequences and tokens (no scheduler, no sampler, no bookkeeping); the two alternate per
repetition. Prints a table and, last, ``engine_vs_bare_decode_batch4=<x>``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import requests  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import make_image  # noqa: E402
from workers import model_workers  # noqa: E402

SIZES = ((448, 448), (1024, 1024), (2048, 2048), (3840, 2160))
BATCHES = (1, 4, 16)
P = "<|vision_start|><|image_pad|><|vision_end|>"


def ttft_rows(folder: str, sizes, reps: int, log) -> list[dict]:
    rows, room = [], 0
    with model_workers(folder, "--max-total-tokens", "32768") as (encode, lang):
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(1) as pool:
            for w, h in sizes:
                path = f"{tmp}/{w}x{h}.png"
                make_image(w, h, seed=w + h).save(path)
                parts: dict[str, list[float]] = {k: [] for k in ("ttft", "encode", "transfer", "prefill", "other")}
                for rep in range(reps + 1):  # the first is a warm-up
                    room += 1
                    start = time.perf_counter()
                    sent = pool.submit(requests.post, f"{encode.url}/encode", json={
                        "rid": f"e{room}", "bootstrap_room": room, "images": [path]}, timeout=600)
                    answer = requests.post(f"{lang.url}/generate", timeout=600, json={
                        "rid": f"g{room}", "text": f"<|im_start|>user\n{P}Describe.<|im_end|>\n<|im_start|>assistant\n",
                        "bootstrap_host": "127.0.0.1", "bootstrap_port": encode.bootstrap_port,
                        "bootstrap_room": room, "sampling_params": {"max_new_tokens": 1}})
                    ttft = (time.perf_counter() - start) * 1e3
                    if answer.status_code != 200 or sent.result().status_code != 200:
                        raise SystemExit(f"{w}x{h}: {answer.status_code} {answer.text[:300]} / {sent.result().text[:300]}")
                    if rep == 0:
                        continue
                    meta, encoded = answer.json()["meta_info"], sent.result().json()
                    # transfer: from the encoder having the embedding to the language side holding all of it
                    split = {"ttft": ttft, "encode": encoded["encode_ms"], "transfer": encoded["send_ms"],
                             "prefill": meta["prefill_ms"]}
                    split["other"] = ttft - split["encode"] - split["transfer"] - split["prefill"]
                    for key, value in split.items():
                        parts[key].append(value)
                row = {"image": f"{w}x{h}", "image_tokens": meta["image_tokens"],
                       "resume_rounds": meta["resume_rounds"]}
                row |= {f"{k}_ms": round(statistics.median(v), 1) for k, v in parts.items()}
                row["transfer_share"] = round(row["transfer_ms"] / row["ttft_ms"], 4)
                rows.append(row)
                log(f"  {row}")
    return rows


def decode_rows(folder: str, batches, tokens: int, reps: int, log) -> list[dict]:
    from transformers import AutoTokenizer

    from language_side.engine import Engine, GenRequest, SamplingParams
    from language_side.model import LanguageModel
    from language_side.prompt import build_prompt

    model = LanguageModel(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [build_prompt(tokenizer, f"Request number {i}: tell a long story.", [], model.max_length)
               for i in range(max(batches))]

    def engine_run(n: int) -> float:
        engine = Engine(model, tokenizer, 1 << 20, set())  # no stop token: every request runs ``tokens`` steps
        for i in range(n):
            engine.add(GenRequest(f"r{i}", prompts[i], None, SamplingParams(max_new_tokens=tokens + 1)))
        engine.step()  # the prefills and first tokens: not decode
        start = time.perf_counter()
        while not engine.idle:
            engine.step()
        return n * tokens / (time.perf_counter() - start)

    def bare_run(n: int) -> float:
        seqs = [model.prefill(prompts[i], None) for i in range(n)]
        start = time.perf_counter()
        for _ in range(tokens):
            for seq in seqs:
                model.decode(seq, int(seq.last_logits.argmax()))
        return n * tokens / (time.perf_counter() - start)

    rows = []
    for n in batches:
        engine_tps, bare_tps = [], []
        for rep in range(reps + 1):
            pair = (engine_run, bare_run) if rep % 2 else (bare_run, engine_run)
            results = {f.__name__: f(n) for f in pair}
            if rep:  # the first is a warm-up
                engine_tps.append(results["engine_run"])
                bare_tps.append(results["bare_run"])
        ratios = [e / b for e, b in zip(engine_tps, bare_tps, strict=True)]
        row = {"batch": n, "engine_tokens_per_s": round(statistics.median(engine_tps), 1),
               "bare_tokens_per_s": round(statistics.median(bare_tps), 1),
               "engine_vs_bare": round(statistics.median(ratios), 3)}
        rows.append(row)
        log(f"  {row}")
    return rows


def plot(path: str, ttft: list[dict], decode: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(ttft)
    for part in ("encode", "transfer", "prefill", "other"):
        values = [r[f"{part}_ms"] for r in ttft]
        left.bar([r["image"] for r in ttft], values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set_ylabel("time to first token (ms)")
    left.legend()
    x = [str(r["batch"]) for r in decode]
    right.plot(x, [r["engine_tokens_per_s"] for r in decode], "o-", label="engine")
    right.plot(x, [r["bare_tokens_per_s"] for r in decode], "s--", label="bare forward loop")
    right.set_xlabel("running requests")
    right.set_ylabel("decode tokens/s")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="checkpoint folder (default: the seeded one, written to a temp folder)")
    ap.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZES), help="WxH,...")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32, help="decode steps per measurement")
    ap.add_argument("--quick", action="store_true", help="one small image, batches 1 and 4, one repetition")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--plot", help="write a PNG here (matplotlib)")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    reps, tokens = args.reps, args.decode_tokens
    if args.quick:
        sizes, batches, reps, tokens = [(448, 448)], [1, 4], 1, 8
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # progress; the table goes to stdout
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_path or str(write_checkpoint(Path(tmp) / "seeded", 3584))
        log("time to first token, through an encode and a language worker:")
        ttft = ttft_rows(folder, sizes, reps, log)
        log("decode, engine against a bare forward loop:")
        decode = decode_rows(folder, batches, tokens, reps, log)
    print(f"{'image':>10} {'tokens':>7} {'rounds':>6} {'TTFT ms':>9} {'encode':>8} {'transfer':>9} {'prefill':>8} "
          f"{'other':>7} {'transfer share':>15}")
    for r in ttft:
        print(f"{r['image']:>10} {r['image_tokens']:>7} {r['resume_rounds']:>6} {r['ttft_ms']:>9.1f} "
              f"{r['encode_ms']:>8.1f} {r['transfer_ms']:>9.1f} {r['prefill_ms']:>8.1f} {r['other_ms']:>7.1f} "
              f"{r['transfer_share']:>15.1%}")
    print(f"{'batch':>6} {'engine tok/s':>13} {'bare tok/s':>11} {'engine/bare':>12}")
    for r in decode:
        print(f"{r['batch']:>6} {r['engine_tokens_per_s']:>13.1f} {r['bare_tokens_per_s']:>11.1f} "
              f"{r['engine_vs_bare']:>12.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ttft": ttft, "decode": decode}, indent=2))
    if args.plot:
        plot(args.plot, ttft, decode)
    at4 = next((r for r in decode if r["batch"] == 4), decode[-1])
    print(f"engine_vs_bare_decode_batch{at4['batch']}={at4['engine_vs_bare']:.3f}")


if __name__ == "__main__":
    main()
