"""A 3840x2160 image's embedding across a link with a line rate and a delay, beside a plain socket on the same link.

The encode side (``connector_peer.py``) runs on a simulated host (``hosts.py``: its own network
namespace on a bridge), the receiving side in this process on the client host; the link
between them gets each rate (``tbf``) and one-way delay (``link_delay.py``, each way: the round
trip is twice it) in turn. Per link and repetition, interleaved (rotating which goes first):

* ``single``: the connector, one round (the language side allocates every block at once);
* ``resume``: the connector with the default first allocation of 8,192 tokens, so the 10,549
  tokens take one resume round;
* ``socket``: the same bytes over one TCP connection (``sendall`` / ``recv_into``).

Each time runs from "the encoder holds the embedding in its blocks" to "the receiver holds all
its bytes". Prints per link the medians, each mode's throughput as a share of the line rate,
``resume/single``, the round trip (an 8-byte request answered by one byte) and what the resume
round cost in round trips, then per link ``link_<rate>mbit_connector_of_line_rate=<x>`` and
``link_<rate>mbit_resume_within_target=<bool>``. The targets: at least 0.8 of the line
rate on 1 Gbit/s and 100 Mbit/s; resume at most 1.05x single plus one round trip. Needs root,
iproute2, iptables.

    .venv/bin/python scripts/bench_links.py [--links 10000:0.1,1000:1,100:10] [--reps 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_transfer import socket_fetch  # noqa: E402

from connector.config import ConnectorConfig  # noqa: E402
from connector.receiver import receive_embedding  # noqa: E402
from harness.hosts import Network  # noqa: E402
from harness.peer_control import EncodePeer, assert_blocks_back, close_receiving_side, receiving_side  # noqa: E402

TOKENS = 10_549  # a 3840x2160 image on Qwen2.5-VL
HIDDEN = 3584
FIRST_ALLOCATION = 8192
MODES = ("single", "resume", "socket")


def round_trip(sock: socket.socket, landing: memoryview) -> float:
    started = time.monotonic()
    socket_fetch(sock, landing, 1)
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", default="10000:0.1,1000:1,100:10",
                    help="links as RATE_MBIT[:DELAY_MS] (the delay one way, each way), comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    links = [(float(rate), float(delay or 0)) for rate, _, delay in (link.partition(":") for link in args.links.split(","))]
    row_bytes = HIDDEN * 2
    blocks = -(-TOKENS // 128) + 4
    nbytes = TOKENS * (row_bytes + 16) + 64  # embeddings, fill ids, M-RoPE positions, aux
    results: dict[tuple[float, float], dict[str, list[float]]] = {}
    with Network(["encoder"]) as net:
        host = net["encoder"]
        config = ConnectorConfig(host=net.client_address, num_blocks=blocks, hidden_size=HIDDEN,
                                 default_allocate_tokens=FIRST_ALLOCATION)
        peer = EncodePeer("--num-blocks", str(blocks), "--hidden-size", str(HIDDEN), host=host.address,
                          prefix=host.exec_prefix())
        manager = receiving_side(config)
        sock = socket.create_connection((host.address, peer.info["socket_port"]))
        landing = memoryview(np.empty(nbytes, np.uint8))
        rooms = itertools.count(1)

        def run(mode: str) -> float:
            if mode == "socket":  # the peer sends its pool's bytes
                started = time.monotonic()
                socket_fetch(sock, landing, nbytes)
                return time.monotonic() - started
            room = next(rooms)
            digests = peer.call("stage", room=room, tokens=TOKENS, seed=room)["digests"]
            started = time.monotonic()
            first = blocks if mode == "single" else None
            emb, receiver = receive_embedding(manager, peer.bootstrap_addr, room, first_blocks=first)
            took = time.monotonic() - started
            if emb.digests() != digests:
                raise SystemExit(f"digest mismatch ({mode}, room {room})")
            if (receiver.resume_rounds > 0) != (mode == "resume"):
                raise SystemExit(f"{mode}: {receiver.resume_rounds} resume rounds")
            emb.release()
            return took

        try:
            for rate, delay_ms in links:
                net.shape(host, rate)
                net.undelay()
                if delay_ms:
                    net.delay(host, None, delay_ms)
                # Warm-up on this link, not timed: connections, handshakes, page faults, and TCP's
                # window settling to the link's rate and delay.
                warm = {mode: run(mode) for mode in MODES}
                print(f"{rate:g} Mbit/s + {delay_ms:g} ms: warm-up " + ", ".join(f"{m} {t * 1e3:.0f} ms" for m, t in warm.items()),
                      file=sys.stderr, flush=True)
                rows = results[rate, delay_ms] = {m: [] for m in (*MODES, "rtt")}
                for rep in range(args.reps):
                    order = MODES[rep % 3:] + MODES[:rep % 3]
                    for mode in order:
                        rows[mode].append(run(mode))
                    rows["rtt"].append(round_trip(sock, landing))
                    print(f"{rate:g} Mbit/s + {delay_ms:g} ms: repetition {rep + 1}/{args.reps} done", file=sys.stderr,
                          flush=True)
            assert_blocks_back(peer, manager)
        finally:
            sock.close()
            close_receiving_side(manager)
            peer.close()

    print(f"\n{TOKENS} tokens x {HIDDEN} bf16 ({nbytes / 1e6:.1f} MB) from the encoder host, {args.reps} repetitions, "
          f"medians; share = bytes / time / line rate; resume rtts = (resume - single) / round trip")
    print(f"{'link':>17} {'single ms':>10} {'share':>6} {'resume ms':>10} {'resume/single':>14} {'resume rtts':>12} "
          f"{'socket ms':>10} {'share':>6} {'rtt ms':>7}")
    summary = {}
    for (rate, delay_ms), rows in results.items():
        med = {m: statistics.median(v) for m, v in rows.items()}
        line_s = nbytes * 8 / (rate * 1e6)
        row = summary[f"{rate:g}mbit"] = {
            "rate_mbit": rate, "delay_ms": delay_ms, "ms": {m: v * 1e3 for m, v in med.items()},
            "connector_share": line_s / med["single"], "socket_share": line_s / med["socket"],
            "resume_over_single": med["resume"] / med["single"],
            "resume_rtts": (med["resume"] - med["single"]) / med["rtt"],
            "resume_within_target": med["resume"] <= 1.05 * med["single"] + med["rtt"], "raw_s": rows}
        print(f"{rate:>7g} Mb/s {delay_ms:>4g} ms {row['ms']['single']:>10.1f} {row['connector_share']:>6.2f} "
              f"{row['ms']['resume']:>10.1f} {row['resume_over_single']:>14.3f} {row['resume_rtts']:>12.2f} "
              f"{row['ms']['socket']:>10.1f} {row['socket_share']:>6.2f} {row['ms']['rtt']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    for name, row in summary.items():
        print(f"link_{name}_resume_within_target={row['resume_within_target']}")
    for name, row in summary.items():
        print(f"link_{name}_connector_of_line_rate={row['connector_share']:.3f}")


if __name__ == "__main__":
    main()
