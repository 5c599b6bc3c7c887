"""ZMQ plumbing shared by both sides: one PULL loop per manager, cached PUSH sockets.

Both sign what they send and check what they receive when a shared secret is set
(:mod:`connector.auth`).
"""

from __future__ import annotations

import collections
import errno
import logging
import resource
import socket
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from connector.auth import AuthError, sign, verify
from connector.rejections import Rejections

log = logging.getLogger(__name__)

_QUEUE_LIMIT = 100_000  # control messages queued for one peer (a few hundred bytes each)
# Peers with an open PUSH socket; beyond it the least recently used one is closed, so a flood of
# messages naming made-up reply addresses cannot use up a ZMQ context's 1023 sockets (each peer
# takes three: the PUSH and its monitor's two ends) nor the process's open files (four each: the
# three sockets' mailboxes and the connection), of which the peers get half at most.
MAX_SOCKETS = 256
FILES_PER_PEER = 4
# A connection is never dropped while it may still deliver: messages to one peer arrive in the
# order they were sent, none lost, which the protocol leans on (an abort is handled before the
# pong that follows it; a frozen peer reads, once it runs again, what was sent meanwhile). An
# earlier version dropped a connection whose bytes stayed unacknowledged for 5 s (ZMQ's
# TCP_MAXRT): the drop could come just after a cut link returned, with the next request's init
# inside, and that request waited for the 300 s timeouts. So a connection outlives a partition
# (MAXRT_MS, about what the kernel's default 15 retries give), and what was sent into the cut is
# retransmitted at most RTO_MAX_MS apart (TCP_RTO_MAX_MS, Linux 6.15+; the kernel's own ceiling
# is 120 s): once the link is back it goes within a second, and what was sent after it (the next
# request's init) with it, instead of waiting for a back-off that grew with the cut's length.
CONNECT_MS = 1000  # a connect unanswered this long is tried again (not the kernel's 2-minute SYN retries)
MAXRT_MS = 900_000
RTO_MAX_MS = 1000  # the kernel's floor for the option
TCP_RTO_MAX_MS = 44  # <linux/tcp.h>; Python's socket module does not name it yet


class PushSockets:
    """PUSH sockets keyed by ``(host, port)``; ZMQ sockets are not thread-safe, so one lock.

    Messages to one peer leave in the order they were sent. A send never blocks: a peer that
    has not taken ``_QUEUE_LIMIT`` messages is not reading, and the send raises ``zmq.Again``.
    Each socket's TCP connections get their retransmissions capped (:data:`RTO_MAX_MS`): ZMQ
    reports each new connection's descriptor on a monitor socket, read at the next send.
    """

    def __init__(self, context: zmq.Context, secret: bytes = b"") -> None:
        self._context, self._secret = context, secret
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_sockets = (MAX_SOCKETS if open_files == resource.RLIM_INFINITY
                            else max(1, min(MAX_SOCKETS, open_files // 2 // FILES_PER_PEER)))
        self._sockets: collections.OrderedDict[tuple[str, int], tuple[zmq.Socket, zmq.Socket]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def send(self, host: str, port: int, frames: list[bytes]) -> None:
        with self._lock:
            entry = self._sockets.get((host, port))
            if entry is None:
                if len(self._sockets) >= self.max_sockets:  # peers named in messages are not all real
                    _close(*self._sockets.popitem(last=False)[1], linger=0)
                entry = self._sockets[(host, port)] = self._connect(host, port)
            self._sockets.move_to_end((host, port))
            sock, monitor = entry
            while monitor.poll(0):
                _cap_retransmissions(recv_monitor_message(monitor)["value"])
            sock.send_multipart(sign(frames, self._secret))

    def _connect(self, host: str, port: int) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self._context.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, _QUEUE_LIMIT)
            sock.setsockopt(zmq.SNDTIMEO, 0)
            sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_MS)
            sock.setsockopt(zmq.TCP_MAXRT, MAXRT_MS)
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        except zmq.ZMQError:  # out of files: the socket must not outlive this (a context waits for it)
            sock.close(linger=0)
            raise
        try:
            sock.connect(f"tcp://{_bracket(host)}:{port}")
        except zmq.ZMQError:
            _close(sock, monitor, linger=0)
            raise
        return sock, monitor

    def try_send(self, host: str, port: int, frames: list[bytes]) -> bool:
        """:meth:`send`, logging instead of raising when the peer cannot take the message (its
        rooms then end by liveness checks or timeouts)."""
        try:
            self.send(host, port, frames)
            return True
        except zmq.ZMQError as exc:
            log.warning("cannot reach peer %s:%d: %s", host, port, exc)
            return False

    def drop(self, host: str, port: int) -> None:
        """Close the socket to ``host:port``, discarding what it still holds; the next send
        connects anew."""
        with self._lock:
            entry = self._sockets.pop((host, port), None)
            if entry is not None:
                _close(*entry, linger=0)

    def close(self) -> None:
        with self._lock:
            for entry in self._sockets.values():
                _close(*entry)
            self._sockets.clear()


def _close(sock: zmq.Socket, monitor: zmq.Socket, linger: int | None = None) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=linger)


_rto_cap_unsupported = False


def _cap_retransmissions(fd: int) -> None:
    """Set TCP_RTO_MAX_MS on the connection ZMQ opened as ``fd``. The descriptor may be closed (or
    even reused) by the time its event is read: a failure leaves that connection uncapped."""
    global _rto_cap_unsupported
    if _rto_cap_unsupported:
        return
    try:
        conn = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        if conn.type == socket.SOCK_STREAM and conn.family in (socket.AF_INET, socket.AF_INET6):
            conn.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, RTO_MAX_MS)
    except OSError as exc:
        if exc.errno == errno.ENOPROTOOPT:
            _rto_cap_unsupported = True
            log.info("this kernel has no TCP_RTO_MAX_MS (Linux 6.15+): after a partition, control messages "
                     "wait for TCP's retransmission back-off")
    finally:
        conn.detach()  # ZMQ's descriptor: never closed here


class PullLoop:
    """Binds a PULL socket on ``host`` (``port``, or a random one when it is 0 or taken) and hands
    every message to ``handler``, without its MAC frame; with a secret, a message that does not
    prove it never gets there.

    The handler must not raise; if it does, the error is logged and the loop goes on.
    """

    def __init__(self, context: zmq.Context, host: str, handler: Callable[[list[bytes]], None], name: str,
                 rejections: Rejections, secret: bytes = b"", port: int = 0) -> None:
        self._rejections, self._secret = rejections, secret
        self._sock = context.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # control messages only
        self.port = self._bind(host, port)
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _bind(self, host: str, port: int) -> int:
        if port:
            try:
                self._sock.bind(f"tcp://{_bracket(host)}:{port}")
                return port
            except zmq.ZMQError as exc:
                log.warning("cannot listen on %s:%d again (%s); using another port", host, port, exc)
        return self._sock.bind_to_random_port(f"tcp://{_bracket(host)}")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
            try:
                frames = verify(frames, self._secret)
            except AuthError as exc:
                self._rejections.reject("unauthenticated", f"{len(frames)}-frame message dropped: {exc}")
                continue
            except Exception:  # a bug in the check must not stop the loop (nor let the message in)
                log.exception("error checking a control message's MAC")
                continue
            try:
                self._handler(frames)
            except Exception:  # a bad message must never stop the loop
                log.exception("error handling a control message")
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host
