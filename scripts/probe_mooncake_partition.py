"""What a partition does to Mooncake's own TCP connections, measured in two simulated hosts.

A sender host writes 1.4 MB into a receiver host's registered buffer (Mooncake's TCP transport,
the connector's timeouts). The link is cut; one write fails by Mooncake's progress timeout (its
pooled connection dropped), and another is started into the cut, so Mooncake connects into it.
After ``--cut`` seconds the link heals and one more write is timed. Printed: each write's
result and seconds. Without ``--rto-max-ms`` the connect made into the cut sits in TCP's SYN
back-off (1, 3, 7, 15 s ...) and the write after the heal waits for it; with
``--rto-max-ms 1000`` (the hosts' ``net.ipv4.tcp_rto_max_ms``, Linux 6.15+) it does not.

    python scripts/probe_mooncake_partition.py [--cut 15] [--rto-max-ms 1000]

Needs root (network namespaces, ``harness/hosts.py``). ``tests/test_mooncake_partition.py``
drives its receiver and its ``--transport-sender`` (the connector's own ``MooncakeTransport``)
to check what that transport says of a write given up on in a cut.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WRITE_BYTES = 1_400_000  # a 1920x1080 image's embedding on the small checkpoint, about
BUFFER_BYTES = 8 << 20


def _engine(host: str):  # noqa: ANN202
    import numpy as np

    from connector.mooncake_transport import MOONCAKE_ENV_DEFAULTS

    for key, value in MOONCAKE_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    assert engine.initialize(host, "P2PHANDSHAKE", "tcp", "") == 0
    buffer = np.zeros(BUFFER_BYTES, np.uint8)
    assert engine.register_memory(buffer.ctypes.data, buffer.nbytes) == 0
    return engine, buffer


def receiver(host: str) -> None:
    """Prints its session and buffer address, then, for each ``crc OFFSET`` line read, the CRC of
    the write-sized range at that offset (until the parent closes the pipe)."""
    engine, buffer = _engine(host)
    print(json.dumps({"session": f"{host}:{engine.get_rpc_port()}", "addr": buffer.ctypes.data}), flush=True)
    for line in sys.stdin:
        offset = int(line.split()[1])
        print(json.dumps({"crc": zlib.crc32(buffer[offset:offset + WRITE_BYTES])}), flush=True)


def pattern(seed: int) -> bytes:
    """The bytes a transport sender's write numbered ``seed`` carries."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, WRITE_BYTES, dtype=np.uint8).tobytes()


def transport_sender(host: str, session: str, dst: int) -> None:
    """The connector's transport: reads ``write NAME SEED OFFSET`` (write ``pattern(SEED)`` at
    that offset of the receiver's buffer; prints ok, failed or unsettled) and ``settled NAME``
    (whether an unsettled write has settled) lines. Each write has a source buffer of its own:
    one given up on may still be read."""
    import numpy as np

    from connector.mooncake_transport import MooncakeTransport
    from connector.transport import TransferError, WriteUnsettled

    transport = MooncakeTransport(host)
    sources = np.zeros((8, WRITE_BYTES), np.uint8)
    transport.register([(sources.ctypes.data, sources.nbytes)])
    held, written = {}, 0
    for line in sys.stdin:
        verb, name, *rest = line.split()
        if verb == "settled":
            print(json.dumps({"settled": held[name]()}), flush=True)
            continue
        source, written = sources[written % len(sources)], written + 1
        source[:] = np.frombuffer(pattern(int(rest[0])), np.uint8)
        started, result = time.monotonic(), "ok"
        try:
            transport.write(session, [source.ctypes.data], [dst + int(rest[1])], [WRITE_BYTES])
        except WriteUnsettled as exc:
            result, held[name] = "unsettled", exc.settled
        except TransferError:
            result = "failed"
        print(json.dumps({"write": name, "result": result, "seconds": round(time.monotonic() - started, 2)}),
              flush=True)


def sender(host: str, session: str, dst: int) -> None:
    """Reads ``wait NAME`` (write and wait for it) or ``start NAME`` (write on a thread) lines."""
    engine, buffer = _engine(host)

    def write(name: str) -> None:
        started = time.monotonic()
        batch = engine.transfer_submit_write(session, buffer.ctypes.data, dst, WRITE_BYTES)
        while (rc := engine.transfer_check_status(batch)) in (0, -2) and time.monotonic() - started < 120:
            time.sleep(0.01)
        print(json.dumps({"write": name, "ok": rc == 1, "rc": rc, "seconds": round(time.monotonic() - started, 2)}),
              flush=True)

    for line in sys.stdin:
        verb, name = line.split()
        if verb == "wait":
            write(name)
        else:
            threading.Thread(target=write, args=(name,), daemon=True).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cut", type=float, default=15.0, help="seconds the link stays cut")
    parser.add_argument("--rto-max-ms", type=int, default=0,
                        help="set net.ipv4.tcp_rto_max_ms to this in both hosts (0: leave the default)")
    args = parser.parse_args()
    from harness.hosts import Network

    me = [sys.executable, str(Path(__file__).resolve())]
    with Network(["sender", "receiver"], rto_max_ms=args.rto_max_ms or None) as net:
        send_host, recv_host = net["sender"], net["receiver"]
        recv = subprocess.Popen([*recv_host.exec_prefix(), *me, "--receiver", recv_host.address],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        info = json.loads(recv.stdout.readline())
        send = subprocess.Popen([*send_host.exec_prefix(), *me, "--sender", send_host.address, info["session"],
                                 str(info["addr"])], stdin=subprocess.PIPE, text=True)

        def tell(line: str) -> None:
            send.stdin.write(line + "\n")
            send.stdin.flush()

        try:
            tell("wait warm-up")
            time.sleep(2)
            net.cut(send_host, recv_host)
            print(f"cut for {args.cut:g} s", flush=True)
            time.sleep(1)
            tell("wait into-the-cut")  # fails by the progress timeout: its connection is dropped
            time.sleep(4)
            tell("start connect-into-the-cut")  # a new connection, its SYNs dropped
            time.sleep(max(0.0, args.cut - 5))
            net.heal(send_host, recv_host)
            print("healed", flush=True)
            time.sleep(0.5)
            tell("wait first-after-the-heal")
            time.sleep(max(10.0, args.cut * 2))  # long enough for the connect's next SYN
        finally:
            send.kill()
            recv.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--receiver"]:
        receiver(sys.argv[2])
    elif sys.argv[1:2] == ["--transport-sender"]:
        transport_sender(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif sys.argv[1:2] == ["--sender"]:
        sender(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
