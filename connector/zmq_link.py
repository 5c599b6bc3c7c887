"""ZMQ plumbing shared by both sides: one PULL loop per manager, cached PUSH sockets."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

_QUEUE_LIMIT = 100_000  # control messages queued for one peer (a few hundred bytes each)


class PushSockets:
    """PUSH sockets keyed by ``(host, port)``; ZMQ sockets are not thread-safe, so one lock.

    Messages to one peer leave in the order they were sent. A send never blocks: a peer that
    has not taken ``_QUEUE_LIMIT`` messages is not reading, and the send raises ``zmq.Again``.
    """

    def __init__(self, context: zmq.Context) -> None:
        self._context = context
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._lock = threading.Lock()

    def send(self, host: str, port: int, frames: list[bytes]) -> None:
        with self._lock:
            sock = self._sockets.get((host, port))
            if sock is None:
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDHWM, _QUEUE_LIMIT)
                sock.setsockopt(zmq.SNDTIMEO, 0)
                sock.connect(f"tcp://{_bracket(host)}:{port}")
                self._sockets[(host, port)] = sock
            sock.send_multipart(frames)

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
        with self._lock:
            sock = self._sockets.pop((host, port), None)
            if sock is not None:
                sock.close(linger=0)

    def close(self) -> None:
        with self._lock:
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()


class PullLoop:
    """Binds a PULL socket on ``host`` (random port) and hands every message to ``handler``.

    The handler must not raise; if it does, the error is logged and the loop goes on.
    """

    def __init__(self, context: zmq.Context, host: str, handler: Callable[[list[bytes]], None], name: str) -> None:
        self._sock = context.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, 64 << 20)  # control messages only
        self.port = self._sock.bind_to_random_port(f"tcp://{_bracket(host)}")
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sock.recv_multipart()
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
