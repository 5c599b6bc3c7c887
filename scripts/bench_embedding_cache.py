"""A 3-turn chat over the same image (a 4K frame by default) through the OpenAI API of a language
worker with ``--encoder-urls``, with the embedding cache and without it, side by side in one run.

One encode worker and two language workers on the seeded checkpoint (one with
``--image-embedding-cache-bytes 0``). Each turn sends the whole conversation again, the image
as a ``data:`` URI in the first user message, and streams the answer; the time to the first
chunk is the turn's TTFT. Turn 1 encodes on both; from turn 2 the cached worker skips the
encoder and the transfer. Prints a table and, last, ``cache_ttft_turn2_ratio=<with/without>``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from transfer_large_image import make_image  # noqa: E402

from harness.workers import WorkerProcess, free_port, start_together  # noqa: E402


def chat_turns(url: str, image_uri: str, turns: int) -> list[dict]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
    messages: list[dict] = []
    rows = []
    for turn in range(1, turns + 1):
        content: list[dict] = [{"type": "text", "text": f"Turn {turn}: what now?"}]
        if turn == 1:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_uri}})
        messages.append({"role": "user", "content": content})
        start = time.perf_counter()
        first, text = None, ""
        for chunk in client.chat.completions.create(model="seeded", messages=messages, max_tokens=4, temperature=0,
                                                    stream=True):
            first = first or time.perf_counter()
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        rows.append({"turn": turn, "ttft_s": first - start, "total_s": time.perf_counter() - start})
        messages.append({"role": "assistant", "content": text})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="3840x2160", help="WxH of the image (default %(default)s)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--model-path", help="Qwen2.5-VL folder (default: the seeded one, hidden 3584, one layer)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    tmp = tempfile.TemporaryDirectory(prefix="bench-cache-")
    if args.model_path is None:
        print("writing the seeded checkpoint ...", file=sys.stderr, flush=True)
    folder = args.model_path or str(write_checkpoint(Path(tmp.name) / "model", 3584))
    buffer = io.BytesIO()
    make_image(width, height, seed=5).save(buffer, "PNG")
    image_uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    encode_port = free_port()
    configs = {"cache": (), "no cache": ("--image-embedding-cache-bytes", "0")}
    # the encoder and both language servers start side by side (a server asks its encoders for
    # their /health at its first request, not at start-up)
    encode, *languages = start_together(
        lambda: WorkerProcess("encode", "--model-path", folder, port=encode_port),
        *(lambda extra=extra: WorkerProcess("language", "--model-path", folder, "--encoder-urls",
                                            f"http://127.0.0.1:{encode_port}", "--skip-server-warmup", *extra,
                                            timeout=300) for extra in configs.values()))
    workers = dict(zip(configs, languages, strict=True))
    try:
        results = {}
        for name, worker in workers.items():
            print(f"{args.turns}-turn chat, {name} ...", file=sys.stderr, flush=True)
            results[name] = chat_turns(worker.url, image_uri, args.turns)
    finally:
        for worker in workers.values():
            worker.stop()
        encode.stop()
        tmp.cleanup()
    print(f"\n{args.turns}-turn chat over one {width}x{height} image (data: URI), TTFT in ms")
    print(f"{'turn':>4} {'with cache':>11} {'without':>9} {'ratio':>6}")
    for with_cache, without in zip(results["cache"], results["no cache"], strict=True):
        print(f"{with_cache['turn']:>4} {with_cache['ttft_s'] * 1e3:>11.0f} {without['ttft_s'] * 1e3:>9.0f} "
              f"{with_cache['ttft_s'] / without['ttft_s']:>6.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.turns >= 2:
        print(f"cache_ttft_turn2_ratio={results['cache'][1]['ttft_s'] / results['no cache'][1]['ttft_s']:.2f}")


if __name__ == "__main__":
    main()
