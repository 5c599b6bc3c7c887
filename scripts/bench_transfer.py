"""Connector throughput next to a plain loopback socket, measured side by side in one run.

For each size the connector time runs from the receiver's init (the sender already holds the
embedding in its blocks) to the assembled embedding on the receiver, status included. The
socket time runs from the request to the last byte in a preallocated buffer
(``sendall``/``recv_into``). Modes are interleaved within each repetition, alternating which
goes first, so background load hits both alike. Prints a table and, last,
``ratio_connector_vs_socket_64MiB=<x>`` (median of per-repetition ratios).
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_control import EncodePeer  # noqa: E402

from connector.allocator import BlockAllocator  # noqa: E402
from connector.buffers import BufferPool  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.mooncake_transport import MooncakeTransport  # noqa: E402
from connector.receiver import EmbeddingReceiverManager, receive_embedding  # noqa: E402

MiB = 1 << 20


def socket_fetch(sock: socket.socket, buf: memoryview, n: int) -> None:
    sock.sendall(struct.pack("<Q", n))
    got = 0
    while got < n:
        got += sock.recv_into(buf[got:n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,64,256", help="embedding sizes in MiB")
    ap.add_argument("--reps", type=int, default=7)
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
    pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
    allocator = BlockAllocator(config.num_blocks)
    transport = MooncakeTransport(config.host, completion=config.completion)
    manager = EmbeddingReceiverManager(config, transport, pool, allocator)
    sock = socket.create_connection(("127.0.0.1", peer.info["socket_port"]))
    landing = np.empty(blocks * 128 * (row_bytes + 16) + 64, np.uint8)
    rooms = itertools.count(1)
    results: dict[int, dict[str, list[float]]] = {s: {"connector": [], "socket": []} for s in sizes}
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
                order = ["connector", "socket"] if rep % 2 == 0 else ["socket", "connector"]
                for mode in order:
                    t0 = time.perf_counter()
                    if mode == "connector":
                        emb, _ = receive_embedding(manager, peer.bootstrap_addr, room)
                    else:
                        socket_fetch(sock, memoryview(landing), nbytes)
                    results[size][mode].append(time.perf_counter() - t0)
                if emb.digests() != digests:
                    raise SystemExit(f"digest mismatch at {size} MiB, room {room}")
                emb.release()
            print(f"repetition {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
        assert allocator.all_free() and peer.call("stats")["free_blocks"] == blocks, "blocks leaked"
    finally:
        sock.close()
        manager.close()
        transport.close()
        peer.close()

    print(f"\nconnector ({args.completion} completion) vs loopback socket, {args.reps} repetitions, "
          f"hidden {args.hidden_size} bf16, medians")
    print(f"{'size':>8} {'connector ms':>13} {'GB/s':>6} {'socket ms':>10} {'GB/s':>6} {'ratio':>6} {'ratio min..max':>15}")
    summary = {}
    for size in sizes:
        tokens = size * MiB // row_bytes
        nbytes = tokens * (row_bytes + 16) + 64
        c, s = results[size]["connector"], results[size]["socket"]
        ratios = [b / a for a, b in zip(c, s, strict=True)]  # connector throughput / socket throughput
        summary[size] = {"connector_s": c, "socket_s": s, "ratios": ratios, "bytes": nbytes,
                         "ratio_median": statistics.median(ratios)}
        mc, ms = statistics.median(c), statistics.median(s)
        print(f"{size:>5}MiB {mc * 1e3:>13.1f} {nbytes / mc / 1e9:>6.2f} {ms * 1e3:>10.1f} {nbytes / ms / 1e9:>6.2f} "
              f"{statistics.median(ratios):>6.2f} {min(ratios):>7.2f}..{max(ratios):<7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"completion": args.completion, "reps": args.reps, "sizes": summary}, indent=1))
    if 64 in summary:
        print(f"ratio_connector_vs_socket_64MiB={summary[64]['ratio_median']:.3f}")


if __name__ == "__main__":
    main()
