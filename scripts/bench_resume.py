"""Cost of partial transfers: resume rounds vs one round vs the reference clone-and-concat.

Connector over real Mooncake TCP between two processes (the encode side is
``connector_peer.py``), embeddings of hidden 3584 in bf16. For each size, three modes:

* resume: today's path, default allocation of 8192 tokens, as many rounds as needed;
* single: an allocation large enough for one round;
* clone-concat: the reference fork's strategy (copy each partial round out of the pool,
  free it, allocate the rest, resume, concatenate at the end).

Each time runs from "the encoder has the embedding in its blocks" to "the language side
holds the assembled embedding". Modes are interleaved within each repetition (rotating which
goes first); medians, spread (min..max) and per-repetition ratios to single. Prints a table
and, last, ``ratio_resume_vs_single_32768=<x>``.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from connector.config import ConnectorConfig  # noqa: E402
from connector.receiver import receive_embedding  # noqa: E402
from harness.peer_control import EncodePeer, assert_blocks_back, close_receiving_side, receiving_side  # noqa: E402

SIZES = (4096, 8192, 8193, 16384, 32768, 65536)
MODES = ("single", "resume", "clone-concat")
HIDDEN = 3584


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="tokens per embedding")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="2 repetitions: a smoke run within a minute")
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--csv", help="write one row per size here")
    ap.add_argument("--plot", help="write a PNG of time against tokens here (matplotlib)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    reps = 2 if args.quick else args.reps

    blocks = -(-max(sizes) // 128) + 8
    config = ConnectorConfig(num_blocks=blocks, hidden_size=HIDDEN)  # default allocation: 8192 tokens
    peer = EncodePeer("--num-blocks", str(blocks), "--hidden-size", str(HIDDEN))
    manager = receiving_side(config)
    pool = manager.pool
    rooms = itertools.count(1)
    times = {(n, m): [] for n in sizes for m in MODES}
    rounds = {}

    def run(mode: str, tokens: int, seed: int) -> float:
        room = next(rooms)
        digests = peer.call("stage", room=room, tokens=tokens, seed=seed)["digests"]
        t0 = time.perf_counter()
        emb, receiver = receive_embedding(manager, peer.bootstrap_addr, room,
                                          first_blocks=pool.blocks_for(tokens) if mode == "single" else None,
                                          clone_concat=mode == "clone-concat")
        elapsed = time.perf_counter() - t0
        if emb.digests() != digests:
            raise SystemExit(f"digest mismatch: {mode}, {tokens} tokens")
        emb.release()
        rounds[(tokens, mode)] = receiver.resume_rounds + 1
        return elapsed

    try:
        for mode in MODES:  # warm-up: connections, page faults, first allocations
            run(mode, max(sizes), 0)
        for rep in range(reps):
            for i, tokens in enumerate(sizes):
                order = MODES[(rep + i) % 3:] + MODES[:(rep + i) % 3]
                for mode in order:
                    times[(tokens, mode)].append(run(mode, tokens, rep + 1))  # same data in every mode
            print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
        assert_blocks_back(peer, manager)
    finally:
        close_receiving_side(manager)
        peer.close()

    rows = []
    for tokens in sizes:
        med = {m: statistics.median(times[(tokens, m)]) for m in MODES}
        spread = {m: (min(times[(tokens, m)]), max(times[(tokens, m)])) for m in MODES}
        ratio = {m: statistics.median(a / b for a, b in zip(times[(tokens, m)], times[(tokens, "single")], strict=True))
                 for m in ("resume", "clone-concat")}
        rows.append({"tokens": tokens, "mib": tokens * HIDDEN * 2 / 2**20, "rounds_resume": rounds[(tokens, "resume")],
                     **{f"{m}_ms": med[m] * 1e3 for m in MODES},
                     **{f"{m}_min_ms": spread[m][0] * 1e3 for m in MODES},
                     **{f"{m}_max_ms": spread[m][1] * 1e3 for m in MODES},
                     "resume_vs_single": ratio["resume"], "clone_concat_vs_single": ratio["clone-concat"]})

    print(f"\nresume overhead, {reps} repetitions, hidden {HIDDEN} bf16, Mooncake TCP loopback; medians (min..max)")
    print(f"{'tokens':>7} {'MiB':>6} {'rounds':>6} {'single ms':>19} {'resume ms':>19} {'clone-concat ms':>19} "
          f"{'resume/single':>13} {'clone/single':>12}")
    for r in rows:
        cells = [f"{r[f'{m}_ms']:7.1f} ({r[f'{m}_min_ms']:.0f}..{r[f'{m}_max_ms']:.0f})" for m in MODES]
        print(f"{r['tokens']:>7} {r['mib']:>6.1f} {r['rounds_resume']:>6} {cells[0]:>19} {cells[1]:>19} {cells[2]:>19} "
              f"{r['resume_vs_single']:>13.3f} {r['clone_concat_vs_single']:>12.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"reps": reps, "rows": rows,
                                               "raw_s": {f"{n}/{m}": v for (n, m), v in times.items()}}, indent=1))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if args.plot:
        plot(rows, args.plot, reps)
    by_tokens = {r["tokens"]: r for r in rows}
    if 32768 in by_tokens:
        print(f"ratio_resume_vs_single_32768={by_tokens[32768]['resume_vs_single']:.3f}")


def plot(rows: list[dict], path: str, reps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    tokens = [r["tokens"] for r in rows]
    for mode, style in zip(MODES, ("o-", "s-", "^--"), strict=True):
        med = [r[f"{mode}_ms"] for r in rows]
        low = [r[f"{mode}_ms"] - r[f"{mode}_min_ms"] for r in rows]
        high = [r[f"{mode}_max_ms"] - r[f"{mode}_ms"] for r in rows]
        ax.errorbar(tokens, med, yerr=[low, high], fmt=style, capsize=3, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("embedding tokens (hidden 3584, bf16)")
    ax.set_ylabel("encoder blocks -> assembled embedding (ms)")
    ax.set_title(f"Resume overhead, Mooncake TCP loopback, median of {reps} (bars: min..max)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
