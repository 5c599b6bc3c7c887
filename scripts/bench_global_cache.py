"""A trace of image chats across two encoder hosts and two language hosts behind smg, without an
embedding cache, with each language server's own, and with the cluster's (Mooncake Store), side
by side in one run.

Hosts are simulated (``hosts.py``: network namespaces on a bridge): two encoder hosts (SGLang's
encoder in our encode worker), two language hosts (SGLang's server, ``--encoder-urls`` both
encoders), a gateway host (smg, round robin over the language servers) and, for the cluster's
cache, a store host (``mooncake_master``; the encoders lend it their memory). The trace: chats
over a set of images of sizes from 448x448 to 3840x2160, each chat's image drawn by Zipf
popularity, some chats of several turns (each turn sends the image again, as OpenAI clients
do), ``--concurrency`` chats at once, the same trace for each configuration. Every request is a
streamed ``/generate`` through smg with its image as a ``data:`` URI; its TTFT is the time to the
first chunk. The language servers run without SGLang's radix cache, so that every request
prefills its whole prompt wherever it lands and TTFT differs only by how the embedding came.

A request is a first sighting (no request of its image started before it), a repeat on the same
server (one of its image finished before it started, on the server it landed on), a repeat on the
other server (those finished only on the other server), or an overlap (the others had not finished;
not counted). Where each landed is read from the language servers' logs (``rid=``).

Per configuration: encoder forward passes (items encoded, from the encoders' metrics), TTFT p50
and p90 of first sightings and of each kind of repeat, and bytes moved (embeddings through the
connector, read from the store, written to it), and R: per image with repeats of both kinds, the
median TTFT of its repeats on the other server over that of its repeats on the same one, the
median over those images (an image's size sets its prefill, so only one image's repeats are
compared; the popular images, small in this trace, are most of the repeats on the same server).
In the trace, R also measures the queues each repeat met (the configuration without any cache
shows a ratio far from 1 too), so with the cluster's cache a probe follows the trace: images no
request has sent (1280x720 to 2560x1440), each sent to one server, then, once its entry is in the
store, again to that server (its own cache) and to the other (the store), one at a time and
straight to each, alternating the order; its R is the median of other/same over those images.
The last line is ``global_cache encoder_passes=N distinct_media=M repeat_other_over_same=R`` for
the cluster's cache, R the probe's (the trace's where no probe ran); the trace's R is in the table
line above it. Needs root, iproute2, iptables.

Upstream SGLang's EPD encoder has a global cache too (``--enable-mm-global-cache``); it is not run
here: its controller moves embeddings through a pinned host pool from CUDA tensors
(``EmbeddingCacheController.store_to_pool_async``), which SGLang's CPU engine does not have, and its
language side never reads the store.

    .venv/bin/python scripts/bench_global_cache.py [--quick] [--model-path DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transfer_large_image import make_image  # noqa: E402

from harness.hosts import Network  # noqa: E402
from harness.workers import (  # noqa: E402
    SGLANG_LAUNCH,
    SGLANG_READY,
    MooncakeMaster,
    WorkerProcess,
    free_port,
    smg_gateway,
    start_together,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SIZES = [(448, 448), (640, 480), (896, 896), (1280, 720), (1920, 1080), (2560, 1440), (3840, 2160)]
QUICK_SIZES = [(448, 448), (640, 480), (896, 672), (1280, 720)]
ANY = "0.0.0.0"
SECRET = "the-benchmark-clusters-control-secret"
CONFIGS = ("none", "local", "global")  # no embedding cache, each server's own, the cluster's
ZIPF_S = 1.1
MULTI_TURN_SHARE = 0.3
PROBES = 8  # images no request has sent, measured one at a time after the trace (see probe)
PROBE_SIZES = [(1920, 1080), (1280, 720), (2560, 1440), (896, 896)]
PUT_OK = 'epd_global_cache_puts_total{outcome="ok"}'


@dataclass
class Request:
    chat: int
    turn: int
    image: int
    rid: str
    started: float = 0.0
    finished: float = 0.0
    ttft_s: float = 0.0
    status: int = 0
    server: str = ""
    kind: str = ""


@dataclass
class Outcome:
    config: str
    requests: list[Request] = field(default_factory=list)
    encoder_passes: float = 0.0
    connector_bytes: float = 0.0
    store_bytes: float = 0.0
    probes: list[dict] = field(default_factory=list)  # the global configuration's (see probe)


def make_trace(chats: int, images: int, seed: int) -> list[list[tuple[int, int]]]:
    """Per chat, its turns as ``(image, turn)``: one image per chat by Zipf popularity, 30% of the
    chats two or three turns."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** ZIPF_S for rank in range(images)]
    trace = []
    for _ in range(chats):
        image = rng.choices(range(images), weights)[0]
        turns = rng.choice((2, 3)) if rng.random() < MULTI_TURN_SHARE else 1
        trace.append([(image, turn) for turn in range(1, turns + 1)])
    return trace


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def stream_ttft(gateway: str, request: Request, uri: str) -> None:
    text = (f"<|im_start|>user\n{IMAGE}Chat {request.chat}, turn {request.turn}: what is in it?<|im_end|>\n"
            "<|im_start|>assistant\n")
    body = {"rid": request.rid, "text": text, "image_data": [uri], "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    request.started = time.perf_counter()
    with requests.post(f"{gateway}/generate", json=body, stream=True, timeout=900) as resp:
        request.status = resp.status_code
        for line in resp.iter_lines():
            if line.startswith(b"data:") and not request.ttft_s:
                request.ttft_s = time.perf_counter() - request.started
    request.finished = time.perf_counter()


def run_trace(gateway: str, trace: list[list[tuple[int, int]]], uris: list[str], config: str,
              concurrency: int) -> list[Request]:
    chats = [[Request(c, turn, image, f"{config}-{c}-{turn}") for image, turn in turns] for c, turns in enumerate(trace)]
    done = 0
    lock = threading.Lock()

    def one_chat(turns: list[Request]) -> None:
        nonlocal done
        for request in turns:
            stream_ttft(gateway, request, uris[request.image])
            with lock:
                done += 1
                if done % 10 == 0:
                    print(f"  {config}: {done} requests answered", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one_chat, chats))
    return [request for turns in chats for request in turns]


def probe(languages: list[WorkerProcess], encoders: list[WorkerProcess], count: int) -> list[dict]:
    """The embedding path alone, after the trace: ``count`` images no request has sent, each sent
    first to one language server (encoded, written to the store), then, once its write has landed,
    again to that server (its own cache) and to the other (the cluster's cache), one at a time and
    straight to each, alternating which server saw it first and which repeat goes first; the
    repeats' TTFTs."""
    rows = []
    for k in range(count):
        width, height = PROBE_SIZES[k % len(PROBE_SIZES)]
        picture = io.BytesIO()
        make_image(width, height, seed=50_000 + k).save(picture, format="PNG")
        uri = "data:image/png;base64," + base64.b64encode(picture.getvalue()).decode()
        first, other = languages[k % 2].url, languages[1 - k % 2].url
        written = sum(metric(e.url, PUT_OK) for e in encoders)
        sighting = Request(-1, 0, -1, f"probe-{k}-first")
        stream_ttft(first, sighting, uri)
        deadline = time.monotonic() + 30
        while sum(metric(e.url, PUT_OK) for e in encoders) <= written and time.monotonic() < deadline:
            time.sleep(0.1)
        ttft = {}
        for label, url in (("same", first), ("other", other))[:: 1 if k % 4 < 2 else -1]:
            request = Request(-1, 1, -1, f"probe-{k}-{label}")
            stream_ttft(url, request, uri)
            if request.status != 200 or sighting.status != 200:
                raise RuntimeError(f"probe {k}: {sighting.status} then {request.status} ({label})")
            ttft[label] = request.ttft_s
        rows.append({"size": f"{width}x{height}", "first": sighting.ttft_s, **ttft})
    return rows


def classify(requests_: list[Request]) -> None:
    """Each request's kind (see the module docstring), from start and finish times and servers."""
    for request in requests_:
        same_image = [r for r in requests_ if r.image == request.image and r.started < request.started]
        if not same_image:
            request.kind = "first"
            continue
        finished = [r for r in same_image if r.finished < request.started]
        if not finished or len(finished) < len(same_image):
            request.kind = "overlap"
        elif any(r.server == request.server for r in finished):
            request.kind = "repeat_same"
        else:
            request.kind = "repeat_other"


def run_config(config: str, net: Network, folder: str, trace: list, uris: list[str], concurrency: int,
               logs: Path, probes_wanted: int) -> Outcome:
    encoder_hosts, language_hosts = [net["encoder"], net["encoder2"]], [net["language"], net["language2"]]
    master = None
    cache_flags: tuple[str, ...] = ()
    if config == "global":
        store_host = net["store"]
        master = MooncakeMaster(logs / "master.log", store_host.address, store_host.exec_prefix())
        cache_flags = ("--mm-global-cache-master", master.address)
    ports = {host.name: free_port() for host in encoder_hosts}
    urls = [f"http://{host.address}:{ports[host.name]}" for host in encoder_hosts]
    env = {"SGLANG_EMBEDDING_CONTROL_SECRET": SECRET}

    def encoder(host):  # noqa: ANN001, ANN202
        return lambda: WorkerProcess("encode", "--model-path", folder, *cache_flags, port=ports[host.name],
                                     host=host.address, bind=ANY, netns=host.netns, env=env, timeout=300)

    def language(host):  # noqa: ANN001, ANN202
        own_cache = ("--image-embedding-cache-bytes", "0") if config == "none" else ()
        return lambda: WorkerProcess("language", "--model-path", folder, "--max-total-tokens", "65536",
                                     "--skip-server-warmup", "--disable-radix-cache", *own_cache, *cache_flags,
                                     "--mm-global-cache-segment-bytes", "0", "--encoder-urls", *urls,
                                     host=host.address, bind=ANY, netns=host.netns, trusted_media=False,
                                     command=SGLANG_LAUNCH, env=env, ready=SGLANG_READY, timeout=300)

    started = start_together(*(encoder(h) for h in encoder_hosts), *(language(h) for h in language_hosts))
    encoders, languages = started[:2], started[2:]
    outcome = Outcome(config)
    probes: list[dict] = []
    try:
        gateway_host = net["gateway"]
        with smg_gateway([w.url for w in languages], logs / f"smg-{config}.log", gateway_host.address, ANY,
                         gateway_host.exec_prefix()) as gateway:
            outcome.requests = run_trace(gateway, trace, uris, config, concurrency)
        for request in outcome.requests:
            pattern = re.compile(rf"rid={re.escape(request.rid)}:")
            request.server = next((w.url for w in languages if any(pattern.search(line) for line in w.log)), "")
        outcome.encoder_passes = sum(metric(e.url, 'epd_encoder_items_total{source="encoded"}') for e in encoders)
        outcome.connector_bytes = sum(metric(e.url, 'epd_bytes_total{role="encode"}') for e in encoders)
        outcome.store_bytes = sum(metric(w.url, "epd_global_cache_read_bytes_total") for w in (*encoders, *languages)) \
            + sum(metric(e.url, "epd_global_cache_written_bytes_total") for e in encoders)
        if config == "global" and probes_wanted:  # after the trace's counts: its images are not the trace's
            probes = probe(languages, encoders, probes_wanted)
    finally:
        for worker in reversed(started):
            worker.stop()
        if master is not None:
            master.stop()
    classify(outcome.requests)
    outcome.probes = probes
    return outcome


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def paired_ratio(requests_: list[Request]) -> float:
    """The median over images of (median TTFT of its repeats on the other server) / (median of its
    repeats on the same server), over the images that have both: the images' sizes, which set
    their prefill, are the same on both sides of each ratio."""
    ratios = []
    for image in {r.image for r in requests_}:
        other = [r.ttft_s for r in requests_ if r.image == image and r.kind == "repeat_other" and r.status == 200]
        same = [r.ttft_s for r in requests_ if r.image == image and r.kind == "repeat_same" and r.status == 200]
        if other and same:
            ratios.append(statistics.median(other) / statistics.median(same))
    return statistics.median(ratios) if ratios else float("nan")


def summary(outcome: Outcome) -> dict:
    row: dict = {"config": outcome.config, "requests": len(outcome.requests),
                 "failed": sum(r.status != 200 for r in outcome.requests),
                 "encoder_passes": outcome.encoder_passes, "connector_mb": outcome.connector_bytes / 1e6,
                 "store_mb": outcome.store_bytes / 1e6}
    for kind in ("first", "repeat_same", "repeat_other", "overlap"):
        ttfts = [r.ttft_s for r in outcome.requests if r.kind == kind and r.status == 200]
        row[kind] = {"n": len(ttfts), "p50_s": quantile(ttfts, 0.5), "p90_s": quantile(ttfts, 0.9)}
    row["repeat_other_over_same"] = paired_ratio(outcome.requests)
    if outcome.probes:
        row["probes"] = outcome.probes
        row["probe_other_over_same"] = statistics.median(p["other"] / p["same"] for p in outcome.probes)
    row["per_request"] = [asdict(r) for r in outcome.requests]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="24 chats over 8 images up to 1280x720")
    parser.add_argument("--chats", type=int, default=None, help="chats in the trace (default 200; --quick 24)")
    parser.add_argument("--images", type=int, default=None, help="images they draw from (default 50; --quick 8)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--model-path", default=None, help="checkpoint (default: the seeded Qwen2.5-VL, width 3584)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probes", type=int, default=PROBES, help="images of the probe after the trace (default "
                                                                    "%(default)s; 0: none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    chats, count, sizes = (24, 8, QUICK_SIZES) if args.quick else (200, 50, SIZES)
    chats, count = args.chats or chats, args.images or count
    tmp = tempfile.TemporaryDirectory(prefix="bench-global-cache-")
    root = Path(tmp.name)
    folder = args.model_path
    if folder is None:
        from make_checkpoint import write_checkpoint

        folder = str(write_checkpoint(root / "seeded", 3584))
    rng = random.Random(args.seed)
    uris = []
    for i in range(count):
        width, height = sizes[i % len(sizes)] if i < len(sizes) else rng.choice(sizes)
        path = root / f"image-{i}.png"
        make_image(width, height, seed=100 + i).save(path)
        uris.append("data:image/png;base64," + base64.b64encode(path.read_bytes()).decode())
    trace = make_trace(chats, count, args.seed)
    distinct = len({image for turns in trace for image, _ in turns})
    print(f"trace: {chats} chats, {sum(map(len, trace))} requests, {distinct} distinct images of {count}, "
          f"concurrency {args.concurrency}", flush=True)
    rows = []
    with Network(["encoder", "encoder2", "language", "language2", "gateway", "store"], rto_max_ms=1000) as net:
        for config in args.configs:
            outcome = run_config(config, net, folder, trace, uris, args.concurrency, root, args.probes)
            rows.append(summary(outcome))
            row = rows[-1]
            print(f"{config:>6}: {row['requests']} requests ({row['failed']} failed), encoder passes "
                  f"{row['encoder_passes']:.0f}, moved {row['connector_mb']:.0f} MB through the connector and "
                  f"{row['store_mb']:.0f} MB through the store; TTFT p50/p90 s: " + ", ".join(
                      f"{kind} {row[kind]['p50_s']:.2f}/{row[kind]['p90_s']:.2f} (n={row[kind]['n']})"
                      for kind in ("first", "repeat_same", "repeat_other"))
                  + f"; repeat other/same, per image: {row['repeat_other_over_same']:.2f}"
                  + (f"; one at a time, other/same: {row['probe_other_over_same']:.2f} (n={len(row['probes'])})"
                     if "probes" in row else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": trace, "rows": rows}, indent=1))
    last = next(row for row in reversed(rows) if row["config"] == "global") if "global" in args.configs else rows[-1]
    ratio = last.get("probe_other_over_same", last["repeat_other_over_same"])  # the probe's, where it ran
    print(f"global_cache encoder_passes={last['encoder_passes']:.0f} distinct_media={distinct} "
          f"repeat_other_over_same={ratio:.2f}")
    return 0 if all(row["failed"] == 0 for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
