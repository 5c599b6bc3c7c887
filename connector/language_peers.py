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

Registration belongs to its owner. A register that names an endpoint another session already
registered is added beside it, never in its place; the endpoint is pinged (ping numbers are
unguessable), and the session that answers from there is the one living at that endpoint:
every other session registered there is dropped (a restarted or woken worker's old session, or
an impostor's). A register that would change what a session of ours already registered (its
pool: a woken worker registers a new one; or its endpoint) is a *claim*, taken only once that
session's endpoint settles it: the claim is taken when the endpoint answers a ping with the
claim's generation, or answers no ping for ``max_misses`` intervals (the process is gone); it
is dropped when the endpoint answers with another generation, or answers at all while the claim
names another endpoint. No write to the session starts while a claim is open. A fork peer's
session cannot answer pings: a register moving it elsewhere is refused while it has live rooms.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from connector.messages import PingMsg, PongMsg, RegisterMsg
from connector.zmq_link import PushSockets

log = logging.getLogger(__name__)


class StallWatch:
    """Tells when this process stopped running for longer than ``threshold`` seconds.

    A thread ticks every ``tick`` seconds; :meth:`epoch` goes up by one for every stall seen,
    including one still going on (a thread that runs again before the ticker does sees the
    last tick far in the past). The ticker counts a stall and moves its last tick in one step
    under a lock, and :meth:`epoch` reads both under it: read between the two, the stall would
    be counted twice (``epoch`` one above what the watch settles on), and a ping tagged with
    that epoch, once answered, would leave its session's ``confirmed_epoch`` above every epoch
    to come, so no write to it would start again until the next stall.
    """

    def __init__(self, threshold: float, tick: float = 0.05) -> None:
        self.threshold, self._tick = threshold, tick
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stalls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def epoch(self) -> int:
        with self._lock:
            return self._stalls + (time.monotonic() - self._last > self.threshold)

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            with self._lock:  # the clock is read under the lock too: a stall epoch() saw is counted
                now = time.monotonic()
                gap, self._last = now - self._last, now
                stalled = gap > self.threshold
                if stalled:
                    self._stalls += 1
            if stalled:  # logged outside the lock: the GIL may pass to another thread here
                log.warning("this process did not run for %.1fs; writes wait until each peer answers a ping", gap)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)


MAX_PEERS = 4096  # registered sessions; beyond it the oldest idle one is forgotten


@dataclass
class LanguagePeer:
    """A language session that sent ``register`` (keyed by its Mooncake session id)."""

    endpoint: str
    port: int
    base_ptrs: tuple[int, ...]
    generation: int | None
    num_blocks: int | None  # set when its register carried our extension frames
    item_lens: tuple[int, ...] | None
    mismatch: str  # why its pool cannot receive from ours; empty when compatible
    confirmed_epoch: int = -1  # stall epoch in which it last answered a ping
    pings: dict[int, int] = field(default_factory=dict)  # unanswered ping seq -> stall epoch when sent
    misses: int = 0  # heartbeat intervals in a row that ended with a ping unanswered
    order: int = 0  # registers seen before this one

    @property
    def extended(self) -> bool:
        """It registered with our extension frames: it parses statuses with reasons, pings, acks."""
        return self.num_blocks is not None

    @property
    def address(self) -> tuple[str, int]:
        return self.endpoint, self.port

    def same_pool(self, other: LanguagePeer) -> bool:
        return (self.address, self.base_ptrs, self.num_blocks, self.item_lens) == (
            other.address, other.base_ptrs, other.num_blocks, other.item_lens)


@dataclass
class PongOutcome:
    confirmed: bool  # the answering session may be written now
    dropped: list[tuple[str, LanguagePeer]]  # sessions that no longer live at the answering endpoint
    answering: LanguagePeer | None
    refused_claim: str = ""  # why a register the answer settled was dropped ("" if none was)


class LanguagePeers:
    """Registered language sessions and their liveness. Not thread-safe: the sender manager
    calls it under its lock."""

    def __init__(self, push: PushSockets, host: str, rank_port: int, interval: float, max_misses: int) -> None:
        self._push, self._host, self._rank_port = push, host, rank_port
        self.interval, self.max_misses = interval, max_misses
        self.stall = StallWatch(threshold=max(1.0, interval / 2))
        self._peers: dict[str, LanguagePeer] = {}
        self._claims: dict[str, LanguagePeer] = {}  # session -> a register its endpoint has not settled yet
        self._seq = 0
        self._registers = 0

    def get(self, session: str) -> LanguagePeer | None:
        return self._peers.get(session)

    def speaks_ours_at(self, host: str, port: int) -> bool:
        """Whether the process at ``host:port`` parses our extension frames: something registered
        there, all of it with our extension frames (a fork peer there must get nothing else, even
        when a stranger registered that address as ours)."""
        at = [p for p in self._peers.values() if p.address == (host, port)]
        return bool(at) and all(p.extended for p in at)

    def speaks_ours(self, session: str) -> bool:
        peer = self._peers.get(session)
        return peer is not None and self.speaks_ours_at(*peer.address)

    def registered_at(self, host: str, port: int) -> bool:
        return any(p.address == (host, port) for p in self._peers.values())

    def register(self, msg: RegisterMsg, mismatch: str, busy: Callable[[], set[str]]) -> str:
        """Record a register; returns why it was refused ("" when it was taken, or held as a
        claim until the session's endpoint settles it). ``busy`` gives the sessions that have
        live rooms."""
        self._registers += 1
        new = LanguagePeer(msg.endpoint, msg.dst_port, msg.base_ptrs, msg.generation, msg.num_blocks,
                           msg.item_lens, mismatch, order=self._registers)
        old = self._peers.get(msg.session_id)
        if old is not None and old.same_pool(new):
            self._peers[msg.session_id] = self._peers.pop(msg.session_id)  # a repeat: the newest, for eviction
            self._claims.pop(msg.session_id, None)  # its owner says again what it has
            return ""
        if (old is not None and old.address == new.address and None not in (old.generation, new.generation)
                and new.generation < old.generation):
            return (f"session {msg.session_id} registered with generation {new.generation}, older than its "
                    f"{old.generation} (a replayed register?)")
        if old is not None and self.speaks_ours(msg.session_id):
            self._claims[msg.session_id] = new
            if not old.pings:
                self._ping(msg.session_id, old, self.stall.epoch())
            return ""
        if old is not None and old.address != new.address and msg.session_id in busy():
            return (f"session {msg.session_id} registered again from {msg.endpoint}:{msg.dst_port} while it has "
                    f"live rooms at {old.endpoint}:{old.port}")
        if old is None and len(self._peers) >= MAX_PEERS:
            in_use = busy()  # the oldest idle session goes: one a repeated register kept young stays
            idle = next((s for s in self._peers if s not in in_use), None)
            if idle is None:
                return f"{len(self._peers)} sessions registered, all with live rooms"
            del self._peers[idle]
            self._claims.pop(idle, None)
        self._take(msg.session_id, new)
        return ""

    def _take(self, session: str, new: LanguagePeer) -> None:
        # Not confirmed yet (confirmed_epoch -1): a register handled after a stall may be stale, so
        # the first write waits for one ping round trip.
        self._peers.pop(session, None)
        self._peers[session] = new
        sharing = [(s, p) for s, p in self._peers.items() if p.address == new.address]
        if len(sharing) > 1 and self.speaks_ours_at(*new.address):  # who answers from there lives there
            for other, peer in sharing:
                self._ping(other, peer, self.stall.epoch())

    def may_write(self, session: str) -> bool:
        """A write to ``session`` may start now; if not, a ping is on its way and :meth:`on_pong`
        says when it may."""
        if self.writable(session):
            return True
        self.confirm(session)
        return False

    def writable(self, session: str) -> bool:
        """A write to ``session`` may start now (asks nothing of the peer)."""
        peer = self._peers.get(session)
        if peer is None or not self.speaks_ours(session):
            return True  # fork peers are never pinged; an unknown session fails in the write, by name
        if session in self._claims:
            return False  # which pool it has is not settled: the answer to the claim's ping starts it
        return peer.confirmed_epoch == self.stall.epoch()

    def confirm(self, session: str) -> None:
        """Ping ``session`` unless it is confirmed for this epoch or a ping of it is out (or a
        claim's ping is: its answer settles the session)."""
        peer = self._peers.get(session)
        if peer is None or not self.speaks_ours(session) or session in self._claims:
            return
        epoch = self.stall.epoch()
        if peer.confirmed_epoch != epoch and epoch not in peer.pings.values():
            self._ping(session, peer, epoch)

    def on_pong(self, msg: PongMsg) -> PongOutcome | None:
        """Handle an answer (None: it answers no ping we sent, or comes from elsewhere). The
        answering session lives at the endpoint that was pinged: other sessions there are dropped."""
        pinged = next((p for p in self._peers.values() if msg.seq in p.pings), None)
        answering = self._peers.get(msg.session_id)
        if pinged is None or answering is None or answering.address != pinged.address:
            return None
        epoch = pinged.pings.pop(msg.seq)
        refused = ""
        claim = self._claims.pop(msg.session_id, None)
        if claim is not None:
            if claim.address == answering.address and msg.generation in (None, claim.generation):
                claim.pings = answering.pings  # the same endpoint: its pings are still out
                self._take(msg.session_id, claim)
                answering = claim
            elif claim.address == answering.address:
                refused = (f"a register for session {msg.session_id} named generation {claim.generation}; "
                           f"its endpoint {claim.endpoint}:{claim.port} answers with {msg.generation}")
            else:
                refused = (f"a register moved session {msg.session_id} to {claim.endpoint}:{claim.port}; "
                           f"it answers at {answering.endpoint}:{answering.port}")
        dropped = [(s, p) for s, p in self._peers.items() if p.address == answering.address and p is not answering]
        for session, _ in dropped:
            del self._peers[session]
            self._claims.pop(session, None)
        answering.pings = {seq: e for seq, e in answering.pings.items() if seq > msg.seq}  # older ones are answered too
        answering.misses = 0
        answering.confirmed_epoch = max(answering.confirmed_epoch, epoch)
        return PongOutcome(answering.confirmed_epoch == self.stall.epoch(), dropped, answering, refused)

    def beat(self, live_sessions: set[str]) -> list[tuple[str, str]]:
        """One heartbeat interval: count misses, ping again; returns ``(session, why)`` of the
        sessions with live rooms that are now dead (forget nothing: a late answer brings one
        back). A claimed session whose endpoint stays silent goes to its claim."""
        dead = []
        epoch = self.stall.epoch()
        for session in live_sessions | set(self._claims):
            peer = self._peers.get(session)
            if peer is None or not self.speaks_ours(session):
                continue
            if any(e == epoch for e in peer.pings.values()):  # a ping of this epoch is still unanswered
                peer.misses += 1
            if peer.misses >= self.max_misses:
                why = f"{peer.misses} pings in a row unanswered ({self.interval:g}s apart)"
                peer.misses, peer.pings = 0, {}
                if session in live_sessions:
                    dead.append((session, why))
                if (claim := self._claims.pop(session, None)) is not None:
                    log.warning("session %s moves to %s:%d: %s at %s:%d", session, claim.endpoint, claim.port, why,
                                peer.endpoint, peer.port)
                    self._take(session, claim)
                continue
            self._ping(session, peer, epoch)
        return dead

    def _ping(self, session: str, peer: LanguagePeer, epoch: int) -> None:
        # Increasing (the high bits count) and unguessable (the low bits are random): a pong
        # proves its sender got this ping.
        self._seq += 1
        seq = (self._seq << 32) | secrets.randbits(32)
        peer.pings[seq] = epoch
        self._push.try_send(peer.endpoint, peer.port, PingMsg(self._host, self._rank_port, seq).encode())

    def close(self) -> None:
        self.stall.close()
