"""The encode side's view of its language peers: who registered, who is alive, who may be written.

A language worker registers one Mooncake session per pool (a new one after each wake-up or
restart). For peers whose register carried our extension frames this module also keeps them
honest about being alive:

* every ``interval`` each session with live rooms gets a ``PING``; a session that leaves
  ``max_misses`` pings in a row unanswered is declared dead (its rooms fail, so their
  encodes end and their blocks come back);
* writes to a session start only while it is *confirmed*: after this process stopped running
  for a while (SIGSTOP, a frozen VM, a long stall), the language side may have given up on
  us and freed the blocks we were about to write. So after a stall no write starts until the
  session answered a ping sent after it; the ``PONG`` travels on the same socket as the
  session's other messages, so every abort it sent before has been handled by then.

Peers built from the reference fork get none of this (they do not parse a ping): their rooms
end by the bootstrap and resume timeouts, as in the fork.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from connector.messages import PingMsg, PongMsg, RegisterMsg
from connector.zmq_link import PushSockets

log = logging.getLogger(__name__)


class StallWatch:
    """Tells when this process stopped running for longer than ``threshold`` seconds.

    A thread ticks every ``tick`` seconds; :meth:`epoch` goes up by one for every stall seen,
    including one still going on (a thread that runs again before the ticker does sees the
    last tick far in the past).
    """

    def __init__(self, threshold: float, tick: float = 0.05) -> None:
        self.threshold, self._tick = threshold, tick
        self._last = time.monotonic()
        self._stalls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def epoch(self) -> int:
        return self._stalls + (time.monotonic() - self._last > self.threshold)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            if now - self._last > self.threshold:
                self._stalls += 1
                log.warning("this process did not run for %.1fs; writes wait until each peer answers a ping",
                            now - self._last)
            self._last = now

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


@dataclass
class LanguagePeer:
    """A language session that sent ``register`` (keyed by its Mooncake session id)."""

    endpoint: str
    port: int
    base_ptrs: tuple[int, ...]
    generation: int | None
    num_blocks: int | None  # set when its register carried our extension frames
    mismatch: str  # why its pool cannot receive from ours; empty when compatible
    confirmed_epoch: int = -1  # stall epoch in which it last answered a ping
    pings: dict[int, int] = field(default_factory=dict)  # unanswered ping seq -> stall epoch when sent
    misses: int = 0  # heartbeat intervals in a row that ended with a ping unanswered

    @property
    def extended(self) -> bool:
        """It registered with our extension frames: it parses statuses with reasons, pings, acks."""
        return self.num_blocks is not None


class LanguagePeers:
    """Registered language sessions and their liveness. Not thread-safe: the sender manager
    calls it under its lock."""

    def __init__(self, push: PushSockets, host: str, rank_port: int, interval: float, max_misses: int) -> None:
        self._push, self._host, self._rank_port = push, host, rank_port
        self.interval, self.max_misses = interval, max_misses
        self.stall = StallWatch(threshold=max(1.0, interval / 2))
        self._peers: dict[str, LanguagePeer] = {}
        self._seq = 0

    def get(self, session: str) -> LanguagePeer | None:
        return self._peers.get(session)

    def register(self, msg: RegisterMsg, mismatch: str) -> list[str]:
        """Record a register; returns the sessions it replaces (the same endpoint restarted)."""
        replaced = [s for s, p in self._peers.items() if (p.endpoint, p.port) == (msg.endpoint, msg.dst_port)
                    and s != msg.session_id]
        for session in replaced:
            del self._peers[session]
        # Not confirmed yet (confirmed_epoch -1): a register handled after a stall may be stale, so
        # the first write waits for one ping round trip.
        self._peers[msg.session_id] = LanguagePeer(msg.endpoint, msg.dst_port, msg.base_ptrs, msg.generation,
                                                   msg.num_blocks, mismatch)
        return replaced

    def may_write(self, session: str) -> bool:
        """A write to ``session`` may start now; if not, a ping is on its way and :meth:`on_pong`
        says when it may."""
        peer = self._peers.get(session)
        if peer is None or not peer.extended:
            return True  # fork peers are never pinged; an unknown session fails in the write, by name
        epoch = self.stall.epoch()
        if peer.confirmed_epoch == epoch:
            return True
        if epoch not in peer.pings.values():
            self._ping(session, peer, epoch)
        return False

    def on_pong(self, msg: PongMsg) -> bool:
        """Handle an answer; True when it confirmed its session for the current epoch."""
        peer = self._peers.get(msg.session_id)
        if peer is None or msg.seq not in peer.pings:
            return False
        epoch = peer.pings.pop(msg.seq)
        peer.pings = {seq: e for seq, e in peer.pings.items() if seq > msg.seq}  # older ones are answered too
        peer.misses = 0
        peer.confirmed_epoch = max(peer.confirmed_epoch, epoch)
        return peer.confirmed_epoch == self.stall.epoch()

    def beat(self, live_sessions: set[str]) -> list[tuple[str, str]]:
        """One heartbeat interval: count misses, ping again; returns ``(session, why)`` of the
        sessions that are now dead (forget nothing: a late answer brings one back)."""
        dead = []
        epoch = self.stall.epoch()
        for session in live_sessions:
            peer = self._peers.get(session)
            if peer is None or not peer.extended:
                continue
            if any(e == epoch for e in peer.pings.values()):  # a ping of this epoch is still unanswered
                peer.misses += 1
            if peer.misses >= self.max_misses:
                dead.append((session, f"{peer.misses} pings in a row unanswered ({self.interval:g}s apart)"))
                peer.misses, peer.pings = 0, {}
                continue
            self._ping(session, peer, epoch)
        return dead

    def _ping(self, session: str, peer: LanguagePeer, epoch: int) -> None:
        self._seq += 1
        peer.pings[self._seq] = epoch
        self._push.try_send(peer.endpoint, peer.port, PingMsg(self._host, self._rank_port, self._seq).encode())

    def close(self) -> None:
        self.stall.close()
