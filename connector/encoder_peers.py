"""The language side's view of its encode peers: routes, incarnations, sleep, health probes.

Everything here that talks to a peer runs on its own small thread pool, one call per peer at a
time, so a peer that does not answer delays nobody else: a route lookup (``resolve``) is
shared by every request for that peer while it runs, and a health probe of one peer never
waits for another's.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import requests

from connector.bootstrap import INCARNATION_HEADER, RankRoute, fetch_route

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """What one ``GET /health`` of a peer found."""

    ok: bool
    text: str = ""
    incarnation: str | None = None
    gone: bool = False  # the connection was refused: no process listens, so none can write to us
    why: str = ""


@dataclass
class EncoderPeer:
    """One encode worker, keyed by its bootstrap address."""

    addr: str
    route: RankRoute | None = None
    incarnation: str | None = None  # the encoder process our rooms are bound to
    misses: int = 0  # health probes in a row that failed
    asleep_since: float | None = None
    durable: bool = False  # asleep with its rooms on disk: it may restart meanwhile
    lookup: Future | None = None  # the route lookup under way
    probing: bool = False
    dead: str = ""  # why it was declared dead; cleared when it answers again


class EncoderPeers:
    """Per-peer state and the calls that reach peers. Thread-safe (own lock)."""

    def __init__(self, interval: float, secret: bytes = b"", workers: int = 8) -> None:
        self.interval, self._secret = interval, secret
        self._lock = threading.Lock()
        self._peers: dict[str, EncoderPeer] = {}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="encoder-peers")
        self._http = requests.Session()

    def peer(self, addr: str) -> EncoderPeer:
        with self._lock:
            return self._peers.setdefault(addr, EncoderPeer(addr))

    def resolve(self, addr: str, room: int) -> Future:
        """A future of the peer's route (at once when known); one lookup per peer at a time. A peer
        declared dead is looked up again: an answer brings it back, no answer fails at once."""
        with self._lock:
            peer = self._peers.setdefault(addr, EncoderPeer(addr))
            if peer.route is not None and not peer.dead:
                done: Future = Future()
                done.set_result(peer.route)
                return done
            if peer.lookup is None:
                peer.lookup = self._pool.submit(self._look_up, peer, room)
            return peer.lookup

    def _look_up(self, peer: EncoderPeer, room: int) -> RankRoute:
        try:
            route = fetch_route(peer.addr, room, timeout=self.interval, secret=self._secret)
        except BaseException:
            with self._lock:
                peer.lookup = None
            raise
        with self._lock:  # in one step: whoever finds no lookup under way finds the route
            peer.lookup, peer.route, peer.dead = None, route, ""
            if route.incarnation:
                peer.incarnation = peer.incarnation or route.incarnation
        return route

    def forget_route(self, addr: str) -> RankRoute | None:
        with self._lock:
            peer = self._peers.get(addr)
            route, peer.route = (peer.route, None) if peer else (None, None)
            return route

    def probe(self, addrs: set[str], on_result: Callable[[str, Probe], None]) -> None:
        """Start a health probe of each peer that has none running; ``on_result`` gets each."""
        for addr in addrs:
            with self._lock:
                peer = self._peers.setdefault(addr, EncoderPeer(addr))
                if peer.probing:
                    continue
                peer.probing = True
            self._pool.submit(self._probe, peer, on_result)

    def _probe(self, peer: EncoderPeer, on_result: Callable[[str, Probe], None]) -> None:
        base = peer.addr if peer.addr.startswith("http") else f"http://{peer.addr}"
        try:
            resp = self._http.get(f"{base}/health", timeout=self.interval)
            result = (Probe(True, resp.text, resp.headers.get(INCARNATION_HEADER)) if resp.status_code == 200
                      else Probe(False, why=f"HTTP {resp.status_code}"))
        except requests.RequestException as exc:
            result = Probe(False, gone=_refused(exc), why=type(exc).__name__)
        finally:
            with self._lock:
                peer.probing = False
        on_result(peer.addr, result)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()


def _refused(exc: BaseException) -> bool:
    """The peer's host said no process listens on the port (not a timeout, not a reset)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or getattr(seen, "errno", None) == errno.ECONNREFUSED:
            return True
        seen = seen.__cause__ or seen.__context__
    return False
