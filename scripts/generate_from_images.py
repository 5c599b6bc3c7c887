"""Images and a prompt in, text out, in one request: the main job.

Starts an encode worker and a language worker that knows it (``--encoder-urls``) on one
Qwen2.5-VL checkpoint folder (the seeded one, written by ``make_checkpoint.py``, unless
``--model-path``), sends each request to the language worker alone (``/generate`` with the
prompt and ``image_data``: it sends the images to its encoder, receives the embedding over
resume rounds as needed, checks its digest against the encoder's, and generates), and prints
per request: image tokens, resume rounds, the time to first token split into encode / transfer
/ prefill, and the generated tokens and text. Then checks one request against transformers'
monolithic ``Qwen2_5_VLForConditionalGeneration.generate`` on the same folder, image and prompt.
Exits non-zero on any error or mismatch.

The seeded model has random weights: its text means nothing, its tokens are exact.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import requests  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from monolithic import reference_tokens  # noqa: E402
from transfer_large_image import DEFAULT_SET, make_image  # noqa: E402
from workers import WorkerProcess, model_workers  # noqa: E402

P = "<|vision_start|><|image_pad|><|vision_end|>"
QUICK_SET = [("448x448", [(448, 448)]), ("2x640x480", [(640, 480)] * 2)]


def prompt_for(images: int) -> str:
    marks = "".join(f"Image {i + 1}: {P}\n" for i in range(images))
    return f"<|im_start|>user\n{marks}Describe {'it' if images == 1 else 'them'}.<|im_end|>\n<|im_start|>assistant\n"


def run(lang: WorkerProcess, rid: str, paths: list[str], new_tokens: int, timeout: float) -> dict:
    body = {"rid": rid, "text": prompt_for(len(paths)), "image_data": paths,
            "sampling_params": {"max_new_tokens": new_tokens}}
    start = time.perf_counter()
    answer = requests.post(f"{lang.url}/generate", json=body, timeout=timeout)
    if answer.status_code != 200:
        return {"error": f"{answer.status_code} {answer.text[:300]}"}
    out = answer.json()
    meta = out["meta_info"]
    return {"image_tokens": meta["image_tokens"], "resume_rounds": meta["resume_rounds"],
            "encode_ms": out["encode_ms"], "transfer_ms": max(out["transfer_ms"] - out["encoder_wait_ms"], 0.0),
            "prefill_ms": meta["prefill_ms"], "ttft_ms": meta["first_token_ms"],
            "e2e_ms": round((time.perf_counter() - start) * 1e3, 1), "output_ids": out["output_ids"],
            "text": out["text"], "prompt": body["text"]}


def monolithic_tokens(folder: str, prompt: str, paths: list[str], new_tokens: int) -> list[int]:
    """transformers' own Qwen2.5-VL, from the pixels, in this process."""
    from PIL import Image
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from embedding_side.encoders import QwenVisionEncoder

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    images = [Image.open(p).convert("RGB") for p in paths]
    return reference_tokens(model, QwenVisionEncoder(folder), AutoTokenizer.from_pretrained(folder), prompt, images,
                            new_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="Qwen2.5-VL checkpoint folder (default: the seeded model, in a temp folder)")
    ap.add_argument("--quick", action="store_true", help="a 448x448 image and a 2-image request only")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--check", default="448x448", help="the request checked against the monolithic model")
    ap.add_argument("--worker-arg", action="append", default=[], help="extra flag for both workers")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the per-request results here")
    args = ap.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # progress; the table goes to stdout
    with tempfile.TemporaryDirectory(prefix="epd-generate-") as tmp:
        folder = args.model_path
        if folder is None:
            log("writing the seeded checkpoint ...")
            folder = str(write_checkpoint(Path(tmp) / "seeded", 3584))
        requests_set = []
        for n, (name, sizes) in enumerate(QUICK_SET if args.quick else DEFAULT_SET):
            paths = []
            for i, (w, h) in enumerate(sizes):
                paths.append(f"{tmp}/{name}-{i}.png")
                make_image(w, h, seed=10 * n + i).save(paths[-1])
            requests_set.append((name, paths))
        log("starting the encode and language workers ...")
        results = {}
        with model_workers(folder, both=tuple(args.worker_arg), timeout=600, one_request=True) as (_, lang):
            print(f"{'request':<12} {'tokens':>7} {'rounds':>6} {'encode':>7} {'transfer':>8} {'prefill':>8} "
                  f"{'TTFT ms':>8}  output ids / text")
            for i, (name, paths) in enumerate(requests_set, start=1):
                log(f"[{i}/{len(requests_set)}] {name} ...")
                res = results[name] = run(lang, name, paths, args.new_tokens, args.timeout)
                if "error" in res:
                    print(f"{name:<12} ERROR {res['error']}", flush=True)
                    continue
                print(f"{name:<12} {res['image_tokens']:>7} {res['resume_rounds']:>6} {res['encode_ms']:>7.0f} "
                      f"{res['transfer_ms']:>8.0f} {res['prefill_ms']:>8.0f} {res['ttft_ms']:>8.0f}  "
                      f"{res['output_ids'][:8]}... {res['text'][:40]!r}", flush=True)
        ok = all("error" not in r for r in results.values())
        checked = results.get(args.check)
        if checked and "error" not in checked:
            log(f"running the monolithic model on {args.check} ...")
            paths = dict(requests_set)[args.check]
            expected = monolithic_tokens(folder, checked["prompt"], paths, args.new_tokens)
            equal = expected == checked["output_ids"]
            ok = ok and equal
            print(f"monolithic check ({args.check}): {'tokens equal' if equal else 'TOKENS DIFFER'} "
                  f"({len(checked['output_ids'])} disaggregated, {len(expected)} monolithic)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"{sum('error' not in r for r in results.values())}/{len(results)} requests generated; "
          f"{'all checks passed' if ok else 'CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
