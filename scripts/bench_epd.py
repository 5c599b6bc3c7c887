"""E/L, E/P/D and upstream SGLang's encoder + prefill + decode, side by side in one run, on one
checkpoint and the same media.

Three stacks, all up at once:

* ``E/L``: our encode worker and SGLang's server as the language worker (``--disaggregation-mode
  encode`` / ``language --encoder-urls``);
* ``E/P/D``: the same encode worker, our language side as SGLang's PD prefill
  (``--disaggregation-mode prefill --language-only --encoder-urls``), SGLang's decode server, and
  smg as SGLang's PD router (``--pd-disaggregation``);
* ``upstream``: SGLang's own ``--encoder-only`` server, its ``--language-only`` PD prefill
  (``--encoder-transfer-backend zmq_to_scheduler``), its decode server and the same router, with
  this project's plugin turned off (``SGLANG_PLUGINS=none``). On a CPU it gets by hand what the
  plugin gives the E/P/D stack (docs/deployment.md): the CPU flags, the prefill's environment
  default, and Mooncake's KV sender told to take page indices as a plain tensor (a
  ``sitecustomize`` on its ``PYTHONPATH``; SGLang has no flag for it).

The media are served over HTTP by this script, which counts every fetch and which process made
it: ``decode_media_reads`` is how often the E/P/D stack's decode server fetched a medium (SGLang's
PD carries no expanded ids or M-RoPE positions, so its tokenizer processes the media again).

The trace: a 448x448, a 1920x1080 and a 3840x2160 image and a chat with four 448x448 images,
sent at once to one stack, the stacks in turn (the first of a round rotates), ``--rounds`` rounds
of new images. Every request streams 16 greedy tokens; its time to first token is measured at the
client, and its ids are compared with transformers' monolithic model on the same checkpoint
(``monolithic.greedy_mismatch``, strict). Then, unless ``--quick``, the gaps between tokens (ITL)
of 4 decoding streams while nothing else arrives and while a 3840x2160 request arrives (what PD
is for: its prefill runs on the prefill server, not beside the decodes). On 2 cores every server
shares both cores, so the stacks' absolute times say little about separate machines; the
comparison is of the same work on the same cores.

Prints a table per stack; the last line is ``epd served=A/B equal_to_monolithic=C/D
decode_media_reads=R`` for the E/P/D stack.
"""

from __future__ import annotations

import argparse
import http.server
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
from bench_vs_upstream import NEW_TOKENS, chat_text, itl_under_prefill, percentile, stream  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from monolithic import greedy_generate, greedy_mismatch, reference_inputs  # noqa: E402
from transfer_large_image import make_image  # noqa: E402

from harness.workers import SGLANG_READY, WorkerProcess, free_port, smg_pd_router, start_together  # noqa: E402

SGLANG = (sys.executable, "-m", "sglang.launch_server")
STACKS = ("E/L", "E/P/D", "upstream")
TRACE = {"448x448": [(448, 448)], "1920x1080": [(1920, 1080)], "3840x2160": [(3840, 2160)],
         "4x448x448": [(448, 448)] * 4}
PD = ("--disaggregation-transfer-backend", "mooncake_tcp", "--max-total-tokens", "65536", "--skip-server-warmup")
# what the plugin gives SGLang's PD roles on a CPU, written out for the stack without it
CPU = ("--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle")
# the stand-in for the plugin's hook on Mooncake's KV sender, in every process of the upstream prefill
SITECUSTOMIZE = '''
import importlib.abc, importlib.machinery, sys

class _PlainPageIndices(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "sglang.srt.disaggregation.mooncake.conn":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.MooncakeKVSender.supports_host_tensor_indices = False

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _PlainPageIndices())
'''


class MediaServer:
    """The media over HTTP from ``root``; each fetch is kept with the pid of the process that
    made it (its socket's owner), so a stack's servers' reads can be counted."""

    def __init__(self, root: str) -> None:
        self.fetches: list[int | None] = []
        fetches = self.fetches

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, directory=root, **kwargs)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                fetches.append(owner(self.client_address, self.server.server_address))
                super().do_GET()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reads_by(self, pid: int) -> int:
        """Fetches made by process ``pid`` or any under it."""
        try:
            root = psutil.Process(pid)
            tree = {root.pid, *(p.pid for p in root.children(recursive=True))}
        except psutil.Error:
            return 0
        return sum(1 for fetcher in self.fetches if fetcher in tree)


def owner(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The pid whose TCP socket is ``client`` connected to ``server`` (root sees every process's)."""
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.raddr and tuple(conn.laddr) == tuple(client) and tuple(conn.raddr) == tuple(server):
            return conn.pid
    return None


def start(folder: str, tmp: str, log) -> tuple[dict[str, WorkerProcess], dict[str, int]]:
    """Every server of the three stacks: the encoders first (the language sides check them at start)."""
    upstream_env = {"SGLANG_PLUGINS": "none"}
    standin = Path(tmp) / "upstream-site"
    standin.mkdir()
    (standin / "sitecustomize.py").write_text(SITECUSTOMIZE)
    upstream_prefill_env = {**upstream_env, "PYTHONPATH": str(standin),
                            "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}
    kv = {"E/P/D": free_port(), "upstream": free_port()}
    encoders = start_together(
        lambda: WorkerProcess("encode", "--model-path", folder, command=SGLANG, timeout=600),
        # WorkerProcess adds --disaggregation-mode null; SGLang's own EPD flag comes after it
        lambda: WorkerProcess("null", "--encoder-only", "--model-path", folder, "--skip-server-warmup",
                              command=SGLANG, ready="Uvicorn running on", env=upstream_env, timeout=600))
    log(f"  encoders up: {[e.url for e in encoders]}")
    ours, theirs = encoders[0].url, encoders[1].url
    rest = start_together(
        lambda: WorkerProcess("language", "--model-path", folder, "--encoder-urls", ours, "--max-total-tokens",
                              "65536", "--skip-server-warmup", command=SGLANG, ready=SGLANG_READY, timeout=900),
        lambda: WorkerProcess("prefill", "--language-only", "--model-path", folder, "--encoder-urls", ours,
                              "--disaggregation-bootstrap-port", str(kv["E/P/D"]), "--enable-metrics", *PD,
                              command=SGLANG, ready=SGLANG_READY, timeout=900),
        lambda: WorkerProcess("decode", "--model-path", folder, *PD, command=SGLANG, ready=SGLANG_READY, timeout=900),
        lambda: WorkerProcess("prefill", "--language-only", "--model-path", folder, "--encoder-urls", theirs,
                              "--encoder-transfer-backend", "zmq_to_scheduler", "--disaggregation-bootstrap-port",
                              str(kv["upstream"]), *PD, *CPU, command=SGLANG, ready=SGLANG_READY,
                              env=upstream_prefill_env, timeout=900),
        lambda: WorkerProcess("decode", "--model-path", folder, *PD, *CPU, "--disaggregation-decode-retraction-backup",
                              "cpu_tensor", command=SGLANG, ready=SGLANG_READY, env=upstream_env, timeout=900))
    names = ("language", "prefill", "decode", "upstream prefill", "upstream decode")
    servers = {"encode": encoders[0], "upstream encode": encoders[1], **dict(zip(names, rest, strict=True))}
    return servers, kv


def trace_round(media: MediaServer, tmp: str, round_no: int) -> dict[str, dict]:
    """The round's requests: each a list of image URLs (new images every round)."""
    requests_of_round = {}
    for name, sizes in TRACE.items():
        paths = []
        for i, (w, h) in enumerate(sizes):
            path = Path(tmp) / "media" / f"r{round_no}-{name}-{i}.png"
            make_image(w, h, seed=1000 * round_no + 10 * len(paths) + w + h + i).save(path)
            paths.append(path)
        requests_of_round[name] = {"paths": [str(p) for p in paths],
                                   "urls": [f"{media.url}/{p.name}" for p in paths]}
    return requests_of_round


def reference_ids(folder: str):
    """``greedy(paths)``: transformers' monolithic greedy ids of the trace's prompt for ``paths``."""
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder).image_processor
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()

    def greedy(paths: list[str]):  # noqa: ANN202
        text = prompt_of(len(paths))
        pictures = [Image.open(p).convert("RGB") for p in paths]
        return greedy_generate(model, reference_inputs(processor, tokenizer, text, pictures), NEW_TOKENS)

    return greedy


def prompt_of(images: int) -> str:
    return chat_text([], "Describe it.").replace("<|vision_start|><|image_pad|><|vision_end|>",
                                                  "<|vision_start|><|image_pad|><|vision_end|>" * images)


def warm_up(urls: dict[str, str], media: MediaServer, tmp: str, log, timeout: float = 300) -> None:
    """Each stack answers a small request before anything is measured (servers that started
    together on a loaded machine may still be finding each other: asked again until one passes)."""
    path = Path(tmp) / "media" / "warm.png"
    make_image(224, 224, seed=5).save(path)
    for stack in STACKS:
        deadline, tries = time.monotonic() + timeout, 0
        while True:
            tries += 1
            answer = stream(urls[stack], prompt_of(1), [f"{media.url}/{path.name}"],
                            f"{stack.replace('/', '')}-warm{tries}")
            if "ttft" in answer:
                log(f"  {stack} warm after {tries} request(s)")
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{stack} answered no warm-up request within {timeout:.0f} s: {answer['error']}")
            time.sleep(2)


def run_trace(urls: dict[str, str], media: MediaServer, folder: str, rounds: int, tmp: str, log) -> dict[str, list]:
    greedy = reference_ids(folder)
    results: dict[str, list] = {stack: [] for stack in STACKS}
    warm_up(urls, media, tmp, log)
    for round_no in range(rounds):
        trace = trace_round(media, tmp, round_no)
        references = {name: greedy(req["paths"]) for name, req in trace.items()}
        order = STACKS[round_no % 3:] + STACKS[:round_no % 3]
        for stack in order:
            with ThreadPoolExecutor(len(trace)) as pool:
                sent = {name: pool.submit(stream, urls[stack], prompt_of(len(req["urls"])), req["urls"],
                                          f"{stack.replace('/', '')}-{round_no}-{name}") for name, req in trace.items()}
                answers = {name: future.result() for name, future in sent.items()}
            for name, answer in answers.items():
                equal = "ids" in answer and greedy_mismatch(answer["ids"], references[name]) is None
                results[stack].append({"request": name, **answer, "equal": equal})
            log(f"  round {round_no} {stack}: " + ", ".join(
                f"{name} {a['ttft']:.2f}s{'' if results[stack][-len(trace) + i]['equal'] else ' (ids differ)'}"
                if "ttft" in a else f"{name} {a['error']}" for i, (name, a) in enumerate(answers.items())))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", help="a Qwen2.5-VL checkpoint folder (default: the seeded 256x2 one)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the trace, new images each")
    ap.add_argument("--quick", action="store_true", help="one round, no ITL part")
    args = ap.parse_args()
    rounds = 1 if args.quick else args.rounds
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # progress; the tables go to stdout
    began = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_path or str(write_checkpoint(Path(tmp) / "seeded", 256, layers=2))
        (Path(tmp) / "media").mkdir()
        media = MediaServer(str(Path(tmp) / "media"))
        log("starting 2 encoders, a language server, 2 prefills and 2 decodes ...")
        servers, kv = start(folder, tmp, log)
        log(f"all up after {time.perf_counter() - began:.0f} s")
        try:
            with smg_pd_router([(servers["prefill"].url, kv["E/P/D"])], [servers["decode"].url],
                               Path(tmp) / "smg-epd.log") as epd_router, \
                 smg_pd_router([(servers["upstream prefill"].url, kv["upstream"])], [servers["upstream decode"].url],
                               Path(tmp) / "smg-upstream.log") as upstream_router:
                urls = {"E/L": servers["language"].url, "E/P/D": epd_router, "upstream": upstream_router}
                results = run_trace(urls, media, folder, rounds, tmp, log)
                decode_reads = media.reads_by(servers["decode"].proc.pid)
                itl = {} if args.quick else itl_part(urls, servers, tmp, log)
        finally:
            for server in servers.values():
                server.stop()
    report(results, itl, decode_reads)
    log(f"done in {time.perf_counter() - began:.0f} s")


def itl_part(urls: dict[str, str], servers: dict[str, WorkerProcess], tmp: str, log) -> dict[str, dict]:
    """Each stack in turn: 4 decoding streams, quiet, then a 3840x2160 request arrives (its media by
    path: every server here reads the temp folder); the streams are aborted on every server that
    holds them."""
    small, big = Path(tmp) / "media" / "itl-small.png", Path(tmp) / "media" / "itl-big.png"
    make_image(448, 448, seed=7).save(small)
    make_image(3840, 2160, seed=8).save(big)
    aborts = {"E/L": [servers["language"].url], "E/P/D": [servers["prefill"].url, servers["decode"].url],
              "upstream": [servers["upstream prefill"].url, servers["upstream decode"].url]}
    out = {}
    for stack in STACKS:
        out[stack] = itl_under_prefill(urls[stack], stack.replace("/", ""), str(small), str(big), 4,
                                       abort_urls=aborts[stack])
        log(f"  ITL {stack}: {out[stack]}")
    return out


def report(results: dict[str, list], itl: dict[str, dict], decode_reads: int) -> None:
    print(f"time to first token at the client, s, per request kind (p50 / p90 over the rounds); "
          f"{NEW_TOKENS} greedy tokens each")
    print(f"{'stack':>9} {'served':>7} {'equal':>6} | " + " | ".join(f"{name:>15}" for name in TRACE))
    for stack, rows in results.items():
        served = sum("ttft" in r for r in rows)
        equal = sum(r["equal"] for r in rows)
        cells = []
        for name in TRACE:
            times = [r["ttft"] for r in rows if r["request"] == name and "ttft" in r]
            cells.append(f"{statistics.median(times):6.2f} / {percentile(times, 0.9):5.2f}" if times else f"{'-':>15}")
        print(f"{stack:>9} {served:>3}/{len(rows):<3} {equal:>3}/{len(rows):<2} | " + " | ".join(cells))
    if itl:
        print("gaps between tokens of 4 decoding streams, ms (p50 / p99): quiet, and while a 3840x2160 request "
              "arrives (its TTFT)")
        for stack, gaps in itl.items():
            quiet, busy = gaps["quiet"], gaps["prefill"]

            def ms(value: float | None) -> str:
                return "-" if value is None else f"{value * 1e3:.0f}"

            print(f"{stack:>9} quiet {ms(quiet['p50'])} / {ms(quiet['p99'])} | during {ms(busy['p50'])} / "
                  f"{ms(busy['p99'])} (max {ms(busy['max'])}) | 4K {gaps['big']}")
    epd = results["E/P/D"]
    print(f"epd served={sum('ttft' in r for r in epd)}/{len(epd)} equal_to_monolithic={sum(r['equal'] for r in epd)}/"
          f"{len(epd)} decode_media_reads={decode_reads}")


if __name__ == "__main__":
    main()
