"""A 3840x2160 image's embedding across a link with a line rate, beside a plain socket on the same link.

The encode side (``connector_peer.py``) runs on a simulated host (``hosts.py``: its own network
namespace on a bridge), the receiving side in this process on the client host; the encoder
host's link is shaped with ``tbf`` to each rate in turn. Per link and repetition, interleaved
(rotating which goes first):

* ``single``: the connector, one round (the language side allocates every block at once);
* ``resume``: the connector with the default first allocation of 8,192 tokens, so the 10,549
  tokens take one resume round;
* ``socket``: the same bytes over one TCP connection (``sendall`` / ``recv_into``).

Each time runs from "the encoder holds the embedding in its blocks" to "the receiver holds all
its bytes". Prints per link the medians, each mode's throughput as a share of the line rate,
``resume/single``, and the round trip (an 8-byte request answered by one byte), then a line
``link_<rate>_connector_of_line_rate=<x>`` per link (issue 37's target: at least 0.8 on 1 Gbit/s
and 100 Mbit/s). This machine's kernel has no ``netem``, so links get a rate but no added delay
(the round trip is the bridge's own). Needs root, iproute2, iptables.

    .venv/bin/python scripts/bench_links.py [--rates 10000,1000,100] [--reps 3] [--json out.json]
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
from hosts import Network  # noqa: E402
from peer_control import EncodePeer, assert_blocks_back, close_receiving_side, receiving_side  # noqa: E402

from connector.config import ConnectorConfig  # noqa: E402
from connector.receiver import receive_embedding  # noqa: E402

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
    ap.add_argument("--rates", default="10000,1000,100", help="line rates in Mbit/s, one link each")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    row_bytes = HIDDEN * 2
    blocks = -(-TOKENS // 128) + 4
    nbytes = TOKENS * (row_bytes + 16) + 64  # embeddings, fill ids, M-RoPE positions, aux
    results: dict[float, dict[str, list[float]]] = {}
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
            for mode in MODES:  # warm-up: connections, handshakes, page faults
                run(mode)
            for rate in rates:
                net.shape(host, rate)
                rows = results[rate] = {m: [] for m in (*MODES, "rtt")}
                for rep in range(args.reps):
                    order = MODES[rep % 3:] + MODES[:rep % 3]
                    for mode in order:
                        rows[mode].append(run(mode))
                    rows["rtt"].append(round_trip(sock, landing))
                    print(f"{rate:g} Mbit/s: repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
            assert_blocks_back(peer, manager)
        finally:
            sock.close()
            close_receiving_side(manager)
            peer.close()

    print(f"\n{TOKENS} tokens x {HIDDEN} bf16 ({nbytes / 1e6:.1f} MB) from the encoder host, {args.reps} repetitions, "
          f"medians; share = bytes / time / line rate")
    print(f"{'link':>10} {'single ms':>10} {'share':>6} {'resume ms':>10} {'resume/single':>14} "
          f"{'socket ms':>10} {'share':>6} {'rtt ms':>7}")
    summary = {}
    for rate, rows in results.items():
        med = {m: statistics.median(v) for m, v in rows.items()}
        line_s = nbytes * 8 / (rate * 1e6)
        summary[rate] = {"ms": {m: v * 1e3 for m, v in med.items()}, "connector_share": line_s / med["single"],
                         "socket_share": line_s / med["socket"], "resume_over_single": med["resume"] / med["single"],
                         "raw_s": rows}
        row = summary[rate]
        print(f"{rate:>6g} Mb/s {row['ms']['single']:>10.1f} {row['connector_share']:>6.2f} "
              f"{row['ms']['resume']:>10.1f} {row['resume_over_single']:>14.3f} {row['ms']['socket']:>10.1f} "
              f"{row['socket_share']:>6.2f} {row['ms']['rtt']:>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in summary.items()}, indent=1))
    for rate, row in summary.items():
        print(f"link_{rate:g}mbit_connector_of_line_rate={row['connector_share']:.3f}")


if __name__ == "__main__":
    main()
