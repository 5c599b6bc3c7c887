"""Adds a fixed delay to every packet of one netfilter queue: a link's propagation delay where
the kernel has no ``netem`` (``harness/hosts.py`` runs it inside a host's namespace).

iptables rules send the host's packets to queue ``--queue`` (``NFQUEUE --queue-bypass``: with
no process bound to the queue they pass undelayed). This process asks the kernel for each
packet's id only (no payload is copied; GSO packets stay whole) and accepts each ``--delay-ms``
after it was queued. Packets are accepted in the order they were queued, so one batch verdict
("every id up to N") releases all that are due: one message per wake-up, whatever the rate.

It speaks nfnetlink_queue over a raw netlink socket (``linux/netfilter/nfnetlink_queue.h``):
bind the queue, ask for metadata only, then read packet messages and answer verdicts.
"""

from __future__ import annotations

import argparse
import collections
import errno
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
SO_RCVBUFFORCE = 33  # not in Python's socket module
NLM_F_REQUEST, NLM_F_ACK = 0x1, 0x4
NLMSG_ERROR = 0x2
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 1 << 2
NF_ACCEPT = 1
NLMSG_HEADER = struct.Struct("=IHHII")  # length, type, flags, sequence, port id
NFGEN_HEADER = struct.Struct("=BBH")  # family, version, resource id (the queue, big-endian)
QUEUE_MAXLEN = 1 << 16  # packets held at once; a full queue drops (as a router's buffer would)


def _attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _message(kind: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = NFGEN_HEADER.pack(socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return NLMSG_HEADER.pack(NLMSG_HEADER.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, 0, 0) + body


def _check_ack(sock: socket.socket) -> None:
    data = sock.recv(65536)
    _, kind, _, _, _ = NLMSG_HEADER.unpack_from(data)
    if kind == NLMSG_ERROR:
        (code,) = struct.unpack_from("=i", data, NLMSG_HEADER.size)
        if code:
            raise OSError(-code, f"nfnetlink_queue refused the configuration: {os.strerror(-code)}")


def bind_queue(queue: int) -> socket.socket:
    """A netlink socket bound to ``queue``, receiving packet ids only."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.bind((0, 0))
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 32 << 20)  # root: past rmem_max
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    config = [
        _attr(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, socket.htons(socket.AF_INET))),
        _attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META)),
        _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", QUEUE_MAXLEN)),
        _attr(NFQA_CFG_MASK, struct.pack(">I", NFQA_CFG_F_GSO)) + _attr(NFQA_CFG_FLAGS, struct.pack(">I", NFQA_CFG_F_GSO)),
    ]
    for attrs in config:
        sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
        _check_ack(sock)
    return sock


def packet_ids(data: bytes) -> list[int]:
    """The packet ids of the packet messages in one netlink read."""
    ids, offset = [], 0
    while offset + NLMSG_HEADER.size <= len(data):
        length, kind, _, _, _ = NLMSG_HEADER.unpack_from(data, offset)
        if length < NLMSG_HEADER.size:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            at, end = offset + NLMSG_HEADER.size + NFGEN_HEADER.size, offset + length
            while at + 4 <= end:
                attr_length, attr_kind = struct.unpack_from("=HH", data, at)
                if attr_length < 4:
                    break
                if attr_kind & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from(">I", data, at + 4)[0])
                    break
                at += attr_length + (-attr_length % 4)
        offset += length + (-length % 4)
    return ids


def run(queue: int, delay_s: float) -> None:
    sock = bind_queue(queue)
    sock.setblocking(False)
    held: collections.deque[tuple[float, int]] = collections.deque()  # (due, packet id), in queue order
    print(f"delaying queue {queue} by {delay_s * 1e3:g} ms", flush=True)
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        if select.select([sock], [], [], timeout)[0]:
            now = time.monotonic()
            while True:
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    break
                except OSError as exc:  # the socket's buffer overflowed: those packets wait for a resend
                    if exc.errno != errno.ENOBUFS:
                        raise
                    continue
                held.extend((now + delay_s, packet) for packet in packet_ids(data))
        now, last = time.monotonic(), None
        while held and held[0][0] <= now:
            last = held.popleft()[1]
        if last is not None:
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, last))
            sock.send(_message(NFQNL_MSG_VERDICT_BATCH, queue, verdict))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--queue", type=int, required=True, help="the netfilter queue number")
    parser.add_argument("--delay-ms", type=float, required=True, help="added to every packet of the queue")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run(args.queue, args.delay_ms / 1e3)


if __name__ == "__main__":
    main()
