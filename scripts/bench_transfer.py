"""Connector throughput next to a plain loopback socket, measured side by side in one run.

Two intervals per mode, on ``time.monotonic()`` (one clock for both processes):

* from the first byte: connector from the moment the sender's first write starts to the
  assembled embedding on the receiver, status included; socket from the sender's first
  ``sendall`` to the last byte in a preallocated buffer (``recv_into``);
* end to end: from the receiver's init (connector; the sender already holds the embedding in
  its blocks) or its 8-byte request (socket), so control messages and hand-offs count too.

A third mode, ``mooncake``, times one bare Mooncake write of the same embedding bytes between
the same two pools (on the sender), to show what the connector adds to its transport.

Modes are interleaved within each repetition, alternating which goes first, so background
load hits both alike. Prints a table, ``ratio_end_to_end_64MiB=<x>``, a bootstrap 95%
interval for the median from the first byte (``ratio_64MiB_95ci=<lo>..<hi>``: how far this
run's noise leaves it) and, last, ``ratio_connector_vs_socket_64MiB=<x>`` (from the first byte);
ratios are medians of per-repetition throughput ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from connector.config import ConnectorConfig  # noqa: E402
from connector.receiver import receive_embedding  # noqa: E402
from harness.peer_control import EncodePeer, assert_blocks_back, close_receiving_side, receiving_side  # noqa: E402

MiB = 1 << 20


def socket_fetch(sock: socket.socket, buf: memoryview, n: int) -> None:
    sock.sendall(struct.pack("<Q", n))
    got = 0
    while got < n:
        got += sock.recv_into(buf[got:n])


def median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median (seeded: the same numbers give the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[draws // 40], medians[draws - 1 - draws // 40]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256", help="embedding sizes in MiB")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--hidden-size", type=int, default=3584)
    ap.add_argument("--completion", choices=["poll", "sync"], default="poll")
    ap.add_argument("--json", help="write the raw numbers here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    row_bytes = args.hidden_size * 2
    max_tokens = max(sizes) * MiB // row_bytes
    blocks = -(-max_tokens // 128) + 8
    config = ConnectorConfig(num_blocks=blocks, hidden_size=args.hidden_size, completion=args.completion,
                             default_allocate_tokens=blocks * 128)  # one round: measure the data path
    peer = EncodePeer("--num-blocks", str(blocks), "--hidden-size", str(args.hidden_size),
                      "--completion", args.completion)
    manager = receiving_side(config)
    pool, transport = manager.pool, manager.transport
    sock = socket.create_connection(("127.0.0.1", peer.info["socket_port"]))
    landing = np.empty(blocks * 128 * (row_bytes + 16) + 64, np.uint8)
    rooms = itertools.count(1)
    # per size: mode -> seconds per repetition, from the first byte and end to end
    results: dict[int, dict[str, list[float]]] = {
        s: {m: [] for m in ("connector", "socket", "mooncake", "connector_e2e", "socket_e2e")} for s in sizes}
    try:
        # Warm-up: connections, handshakes, page faults on both pools.
        for _ in range(2):
            room = next(rooms)
            peer.call("stage", room=room, tokens=max_tokens, seed=room)
            receive_embedding(manager, peer.bootstrap_addr, room)[0].release()
            socket_fetch(sock, memoryview(landing), max_tokens * row_bytes)
        for rep in range(args.reps):
            for size in sizes:
                tokens = size * MiB // row_bytes
                nbytes = tokens * (row_bytes + 16) + 64  # embeddings + fill_ids + mrope + aux
                room = next(rooms)
                digests = peer.call("stage", room=room, tokens=tokens, seed=room)["digests"]
                modes = ["connector", "socket", "mooncake"]
                for mode in modes[rep % 3:] + modes[:rep % 3]:
                    if mode == "mooncake":
                        times = peer.call("raw_write", session=transport.session_id, dst=pool.embeddings.ctypes.data,
                                          nbytes=tokens * row_bytes)
                        results[size][mode].append(times["ended_at"] - times["started_at"])
                        continue
                    t0 = time.monotonic()
                    if mode == "connector":
                        emb, _ = receive_embedding(manager, peer.bootstrap_addr, room)
                        t1 = time.monotonic()
                        first_byte = peer.call("status", room=room)["first_write_at"]
                        if emb.digests() != digests:
                            raise SystemExit(f"digest mismatch at {size} MiB, room {room}")
                        emb.release()  # before the bare write reuses the same pool bytes
                    else:
                        socket_fetch(sock, memoryview(landing), nbytes)
                        t1 = time.monotonic()
                        first_byte = peer.call("stats")["socket_send_started_at"]
                    results[size][mode].append(t1 - first_byte)
                    results[size][f"{mode}_e2e"].append(t1 - t0)
            print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
        assert_blocks_back(peer, manager)
    finally:
        sock.close()
        close_receiving_side(manager)
        peer.close()

    print(f"\nconnector ({args.completion} completion) vs loopback socket, {args.reps} repetitions, "
          f"hidden {args.hidden_size} bf16, medians; ratio = connector throughput / socket throughput")
    print(f"{'':>8} {'--- from the first byte ---':>44}   {'--- end to end ---':>26}   {'bare':>11}")
    print(f"{'size':>8} {'connector ms':>13} {'socket ms':>10} {'ratio':>6} {'min..max':>12}   "
          f"{'connector ms':>13} {'socket ms':>10} {'ratio':>6}   {'mooncake ms':>11}")
    summary = {}
    for size in sizes:
        tokens = size * MiB // row_bytes
        nbytes = tokens * (row_bytes + 16) + 64
        r = results[size]
        ratios = [b / a for a, b in zip(r["connector"], r["socket"], strict=True)]
        e2e = [b / a for a, b in zip(r["connector_e2e"], r["socket_e2e"], strict=True)]
        summary[size] = {**{f"{m}_s": v for m, v in r.items()}, "bytes": nbytes, "ratios": ratios,
                         "ratio_median": statistics.median(ratios), "ratio_e2e_median": statistics.median(e2e)}
        med = {m: statistics.median(v) * 1e3 for m, v in r.items()}
        print(f"{size:>5}MiB {med['connector']:>13.1f} {med['socket']:>10.1f} {statistics.median(ratios):>6.2f} "
              f"{min(ratios):>5.2f}..{max(ratios):<5.2f}   {med['connector_e2e']:>13.1f} {med['socket_e2e']:>10.1f} "
              f"{statistics.median(e2e):>6.2f}   {med['mooncake']:>11.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"completion": args.completion, "reps": args.reps, "sizes": summary}, indent=1))
    if 64 in summary:
        low, high = median_interval(summary[64]["ratios"])
        print(f"ratio_end_to_end_64MiB={summary[64]['ratio_e2e_median']:.3f}")
        print(f"ratio_64MiB_95ci={low:.3f}..{high:.3f}")
        print(f"ratio_connector_vs_socket_64MiB={summary[64]['ratio_median']:.3f}")


if __name__ == "__main__":
    main()
