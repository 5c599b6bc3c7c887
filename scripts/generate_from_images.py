"""Images and a prompt in, text out, in one request: the main job.

Starts an encode worker (SGLang's own encoder for the checkpoint, in our encode worker:
``python -m sglang.launch_server --disaggregation-mode encode``) and SGLang's own server as the
language worker that knows it (``python -m sglang.launch_server --disaggregation-mode language
--encoder-urls ...``), both on one Qwen2.5-VL checkpoint folder (the seeded one, written by
``make_checkpoint.py``, unless ``--model-path``). Each request goes to the language server alone
(SGLang's ``/generate`` with the prompt and ``image_data``): it sends the images to its encoder,
receives the embedding through the resumable connector over as many resume rounds as it needs,
checks its digest against the encoder's, and SGLang prefills and decodes. Per request it prints
the image tokens, the resume rounds, the time to first token (SGLang's own, from the request's
arrival) split into encode (the encoder's decode + preprocess + tower), transfer (the rest of the
way to the embedding assembled on the language side: the ``/encode`` call, the wire, the resume
rounds), prefill (SGLang's scheduler, first forward pass to first token) and other (SGLang's
inputs, its queue), and the generated tokens and text (after one small warm-up request: SGLang's
encoder's first forward pass is several times slower than the next ones). Then checks
one request against transformers' monolithic ``Qwen2_5_VLForConditionalGeneration.generate`` on
the same folder, image and prompt (``monolithic.greedy_mismatch``: the ids equal at every step;
the seeded checkpoint's steps lead by far more than SGLang's and transformers' bf16 roundings
differ). Exits non-zero on any error or mismatch.

With ``--hosts`` the two workers run on two simulated hosts (``hosts.py``: network namespaces on a
bridge; needs root, iproute2, iptables), each bound to ``0.0.0.0`` and advertising its own
host's address, and this process is the client on a third: the same requests across hosts.

The seeded model has random weights: its text means nothing, its tokens are exact.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import requests  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import DEFAULT_SET, make_image  # noqa: E402

from harness.hosts import Network  # noqa: E402
from harness.workers import SGLANG_READY, WorkerProcess, free_port, start_together  # noqa: E402

SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")
P = "<|vision_start|><|image_pad|><|vision_end|>"
# a worker stopped by SIGINT (WorkerProcess.stop) exits 0, or -2 where SGLang's launcher lets the
# KeyboardInterrupt end it
CLEAN_EXITS = {0, -2}
QUICK_SET = [("448x448", [(448, 448)]), ("2x640x480", [(640, 480)] * 2)]


def prompt_for(images: int) -> str:
    marks = "".join(f"Image {i + 1}: {P}\n" for i in range(images))
    return f"<|im_start|>user\n{marks}Describe {'it' if images == 1 else 'them'}.<|im_end|>\n<|im_start|>assistant\n"


def start_workers(folder: str, encode_args: list[str], language_args: list[str],
                  timeout: float, net: Network | None = None) -> tuple[WorkerProcess, WorkerProcess]:
    """The encode worker and SGLang's language server, started side by side (the language server
    asks its encoders for their ``/health`` at the first request, not at start-up); on ``net``'s
    hosts ``encoder`` and ``language`` when it is given."""
    encode_port = free_port()
    place = {role: {} if net is None else {"host": net[role].address, "bind": "0.0.0.0", "netns": net[role].netns}
             for role in ("encoder", "language")}
    encode_host = place["encoder"].get("host", "127.0.0.1")
    language = ["--model-path", folder, "--encoder-urls", f"http://{encode_host}:{encode_port}", "--skip-server-warmup",
                "--enable-metrics", *language_args]  # --enable-metrics: SGLang's time stamps in meta_info
    encode, lang = start_together(
        lambda: WorkerProcess("encode", "--model-path", folder, *encode_args, port=encode_port,
                              command=SGLANG_LAUNCH, timeout=timeout, **place["encoder"]),
        lambda: WorkerProcess("language", *language, command=SGLANG_LAUNCH, ready=SGLANG_READY, timeout=timeout,
                              **place["language"]))
    return encode, lang


def ttft_split(meta: dict) -> dict:
    """The time to first token of one response (SGLang's ``first_token_latency``, from the request's
    arrival at its tokenizer manager), in ms, split by what the connector and SGLang put in
    ``meta_info``: encode (the encoder's ``encode_ms``: decode, preprocess, tower), transfer (the
    connector's ``transfer_ms``, from the room's start to the embedding assembled, less the
    encoder's own work: the ``/encode`` call, the wire, the resume rounds), prefill (SGLang's
    scheduler: first forward pass to the prefill's end) and other (the rest: SGLang's inputs,
    its queue, waiting for pool blocks)."""
    ttft = meta["first_token_latency"] * 1e3
    split = {"ttft_ms": ttft, "encode_ms": meta["encode_ms"],
             "transfer_ms": max(meta["transfer_ms"] - meta["encode_ms"], 0.0),
             "prefill_ms": (meta["prefill_finished_time"] - meta["forward_entry_time"]) * 1e3}
    split["other_ms"] = ttft - split["encode_ms"] - split["transfer_ms"] - split["prefill_ms"]
    return {key: round(value, 1) for key, value in split.items()}


def run(lang: WorkerProcess, rid: str, paths: list[str], new_tokens: int, timeout: float) -> dict:
    body = {"rid": rid, "text": prompt_for(len(paths)), "image_data": paths,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    start = time.perf_counter()
    try:
        answer = requests.post(f"{lang.url}/generate", json=body, timeout=timeout)
    except requests.RequestException as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if answer.status_code != 200:
        return {"error": f"{answer.status_code} {answer.text[:300]}"}
    out = answer.json()
    meta = out["meta_info"]
    return {"image_tokens": meta["image_tokens"], "prompt_tokens": meta["prompt_tokens"],
            "resume_rounds": meta["resume_rounds"], **ttft_split(meta),
            "e2e_ms": round((time.perf_counter() - start) * 1e3, 1), "output_ids": out["output_ids"],
            "text": out["text"], "prompt": body["text"]}


def monolithic_check(folder: str, prompt: str, paths: list[str], got: list[int]) -> tuple[list[int], str | None]:
    """transformers' own Qwen2.5-VL greedy ids for ``prompt`` with the images at ``paths`` (from the
    pixels, in this process), and None when ``got`` is that output as ``monolithic.greedy_mismatch``
    compares them, else what differs."""
    from monolithic import greedy_generate, greedy_mismatch, reference_inputs
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
    images = [Image.open(p).convert("RGB") for p in paths]
    inputs = reference_inputs(AutoProcessor.from_pretrained(folder).image_processor,
                              AutoTokenizer.from_pretrained(folder), prompt, images)
    reference = greedy_generate(model, inputs, len(got))
    return reference.ids, greedy_mismatch(got, reference)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="Qwen2.5-VL checkpoint folder (default: the seeded model, in a temp folder)")
    ap.add_argument("--quick", action="store_true", help="a 448x448 image and a 2-image request only")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--check", default="448x448", help="the request checked against the monolithic model")
    ap.add_argument("--encode-arg", action="append", default=[], help="extra flag for the encode worker")
    ap.add_argument("--language-arg", action="append", default=[], help="extra flag for SGLang's language server")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", help="write the per-request results here")
    ap.add_argument("--hosts", action="store_true",
                    help="each worker on a simulated host of its own, this process the client (needs root)")
    args = ap.parse_args()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # progress; the table goes to stdout
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="epd-generate-") as tmp, contextlib.ExitStack() as stack:
        net = stack.enter_context(Network(["encoder", "language"])) if args.hosts else None
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
        log("starting the encode worker and SGLang's language server ...")
        results = {}
        encode, lang = start_workers(folder, args.encode_arg, args.language_arg, args.timeout, net)
        log(f"both up after {time.perf_counter() - began:.0f} s: encoder at {encode.url}, language server at {lang.url}")
        try:
            # SGLang's encoder's first forward pass is several times slower than the next ones
            warm_up = f"{tmp}/warm-up.png"
            make_image(224, 224, seed=99).save(warm_up)
            warm = run(lang, "warm-up", [warm_up], 1, args.timeout)
            log("warm-up request (224x224, 1 token): " + (warm.get("error") or f"TTFT {warm['ttft_ms']:.0f} ms"))
            print(f"{'request':<12} {'tokens':>7} {'rounds':>6} {'encode':>7} {'transfer':>8} {'prefill':>8} "
                  f"{'other':>6} {'TTFT ms':>8}  output ids / text")
            for i, (name, paths) in enumerate(requests_set, start=1):
                log(f"[{i}/{len(requests_set)}] {name} ...")
                res = results[name] = run(lang, name, paths, args.new_tokens, args.timeout)
                if "error" in res:
                    print(f"{name:<12} ERROR {res['error']}", flush=True)
                    continue
                print(f"{name:<12} {res['image_tokens']:>7} {res['resume_rounds']:>6} {res['encode_ms']:>7.0f} "
                      f"{res['transfer_ms']:>8.0f} {res['prefill_ms']:>8.0f} {res['other_ms']:>6.0f} "
                      f"{res['ttft_ms']:>8.0f}  {res['output_ids'][:8]}... {res['text'][:40]!r}", flush=True)
        finally:
            codes = lang.stop(), encode.stop()
        ok = all("error" not in r for r in results.values())
        if not set(codes) <= CLEAN_EXITS:
            ok = False
            print(f"workers exited with {codes} (language, encode); logs: {lang.log_file.name}, {encode.log_file.name}")
        checked = results.get(args.check)
        if checked and "error" not in checked:
            log(f"running the monolithic model on {args.check} ...")
            expected, mismatch = monolithic_check(folder, checked["prompt"], dict(requests_set)[args.check],
                                                  checked["output_ids"])
            ok = ok and mismatch is None
            verdict = "tokens equal" if mismatch is None else f"TOKENS DIFFER: {mismatch}"
            print(f"monolithic check ({args.check}): {verdict} ({len(checked['output_ids'])} disaggregated, "
                  f"{len(expected)} monolithic)")
        elif args.check not in results:
            ok = False
            print(f"monolithic check: no request named {args.check}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    log(f"done in {time.perf_counter() - began:.0f} s")
    print(f"{sum('error' not in r for r in results.values())}/{len(results)} requests generated; "
          f"{'all checks passed' if ok else 'CHECKS FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
