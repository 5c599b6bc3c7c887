"""The encode side's view of its language peers: who registered, who is alive, who may be written.

A language worker registers one Mooncake session per pool (a new one after each wake-up or
restart). For peers whose register carried our extension frames this module also keeps them
honest about being alive:

* every ``interval`` each session with live rooms gets a ``PING``; a session that leaves
  ``max_misses`` pings in a row unanswered (each for at least half an interval) is declared
  dead (its rooms fail, so their encodes end and their blocks come back), and nothing is
  written to it until it answers a ping again. A ping speaks only for the rooms that existed
  when it was sent: a room the session joined (its init came) after the last missed ping left
  (the first request after a cut link healed, while that ping's bytes still sit in TCP's
  retransmission back-off) is spared, and the next ping decides for it;
* writes to a session start only while it is *confirmed*: after this process stopped running
  for a while (SIGSTOP, a frozen VM, a long stall), the language side may have given up on
  us and freed the blocks we were about to write. So after a stall no write starts until the
  session answered a ping sent after it; the ``PONG`` travels on the same socket as the
  session's other messages, so every abort it sent before has been handled by then.

Peers built from the reference fork get none of this (they do not parse a ping): their rooms
end by the bootstrap and resume timeouts, as in the fork.

A registration belongs to its endpoint: it is keyed by the Mooncake session *and* the ZMQ
endpoint that registered it (:data:`PeerKey`), and only that endpoint's inits and resumes are
served from it. A register naming a session already registered at another endpoint is added
beside it and takes nothing from it. Without the shared secret nothing proves that an endpoint
belongs to the session it names (a register may name any session, and ``localhost:PORT`` or
another address of the host reaches the same engine as ``127.0.0.1:PORT``), so a register
from elsewhere is served to whoever sent it, as one under a session name of its own would be:
it can never keep the session's own endpoint out, whether it came first or later.

At one endpoint, the endpoint itself settles which pool is its own. A registration is written
only once its endpoint has answered a ping with the pool's generation (its first write waits one
ping round trip). A register that would change what an endpoint registered (another pool: a
woken worker registers a new one, or a forged one) is a *claim* beside it: no write to the
registration starts while a claim is open, and the next answer settles it: the pool whose
generation the endpoint answers with is kept, the others are dropped; a pool that nothing
proved yet holds no priority (a register forged before the worker's own first one is settled
by the same answer, even when it names a newer generation). The endpoint that stays silent for
``max_misses`` intervals settles nothing: the newest claim is kept, unproven. A register that
names an endpoint another session registered is added beside it; the endpoint is pinged (ping
numbers are unguessable), and the session that answers from there is the one living at that
endpoint: every other session registered there is dropped (a restarted worker's old session,
or an impostor's).

Fork peers cannot answer pings: their registrations are never settled by one, and a register at
their endpoint replaces what was there (until a pong proved an endpoint ours, a fork-shaped
register there is taken as a fork peer's: a fork peer must never get a ping). An older
generation than a pool its endpoint proved is refused as a replay.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

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


MAX_PEERS = 4096  # registrations; beyond it the oldest idle one is forgotten
MAX_CLAIMS = 4  # pools registered at one endpoint beside the one it holds, until a pong settles them

PeerKey = tuple[str, str, int]  # (Mooncake session, ZMQ endpoint, port): one registration


class Ping(NamedTuple):
    epoch: int  # the stall epoch it was sent in
    sent_at: float  # on the manager's clock


class DeadPeer(NamedTuple):
    key: PeerKey
    why: str
    missed_ping_sent: float  # when the last ping counted as missed left: it speaks for the rooms joined until then


@dataclass(frozen=True)
class LanguagePeer:
    """One pool, as a ``register`` described it."""

    endpoint: str
    port: int
    base_ptrs: tuple[int, ...]
    generation: int | None
    num_blocks: int | None  # set when its register carried our extension frames
    item_lens: tuple[int, ...] | None
    mismatch: str  # why its pool cannot receive from ours; empty when compatible

    @property
    def extended(self) -> bool:
        """It registered with our extension frames: it parses statuses with reasons, pings, acks."""
        return self.num_blocks is not None

    @property
    def address(self) -> tuple[str, int]:
        return self.endpoint, self.port

    def same_pool(self, other: LanguagePeer) -> bool:
        return (self.address, self.base_ptrs, self.generation, self.num_blocks, self.item_lens) == (
            other.address, other.base_ptrs, other.generation, other.num_blocks, other.item_lens)

    def describe(self) -> str:
        return f"{self.endpoint}:{self.port} generation {self.generation}"


@dataclass
class Registration:
    """What one endpoint registered for one session, and what it proved.

    ``held`` is the pool writes use; ``claims`` are other pools registered there since, newest
    last, until the endpoint's next answer says which one is its own. ``confirmed_epoch`` is the
    stall epoch in which the endpoint last answered a ping with ``held``'s generation (-1: it
    never did, or its last answer named a pool registered nowhere here)."""

    held: LanguagePeer
    order: int  # registers seen before this registration's first
    claims: list[LanguagePeer] = field(default_factory=list)
    confirmed_epoch: int = -1
    pings: dict[int, Ping] = field(default_factory=dict)  # unanswered pings by seq
    misses: int = 0  # heartbeat intervals in a row that ended with a ping unanswered
    # Declared dead by the heartbeats: nothing is written to it until it answers a ping again (a
    # write into a cut link makes Mooncake connect into it, and that connect, in TCP's SYN
    # back-off, holds up the peer's next writes for up to the cut's length after it heals).
    silent: bool = False

    @property
    def proven(self) -> bool:
        """Its endpoint answered a ping with ``held``'s generation (in some epoch)."""
        return self.confirmed_epoch >= 0

    def pools(self) -> list[LanguagePeer]:
        """Every pool registered here, newest first."""
        return [*reversed(self.claims), self.held]


@dataclass
class PongOutcome:
    confirmed: bool  # the answering registration may be written now
    dropped: list[tuple[PeerKey, Registration]]  # registrations of sessions that no longer live at that endpoint
    answering: PeerKey
    order: int  # of the answering registration
    refused: list[str] = field(default_factory=list)  # why each pool the answer settled against was dropped


class LanguagePeers:
    """Registered language endpoints and their liveness. Not thread-safe: the sender manager
    calls it under its lock."""

    def __init__(self, push: PushSockets, host: str, rank_port: int, interval: float, max_misses: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._push, self._host, self._rank_port = push, host, rank_port
        self.interval, self.max_misses, self.clock = interval, max_misses, clock
        self.stall = StallWatch(threshold=max(1.0, interval / 2))
        self._regs: dict[PeerKey, Registration] = {}  # least recently registered first
        self._seq = 0
        self._registers = 0

    def get(self, key: PeerKey) -> LanguagePeer | None:
        """The pool writes to ``key`` use (None: nothing registered there)."""
        reg = self._regs.get(key)
        return None if reg is None else reg.held

    def pools(self, key: PeerKey) -> list[LanguagePeer]:
        """Every pool registered at ``key``, newest first: a round request is served when one fits
        (the one its endpoint answers for is the one written, and checked again then)."""
        reg = self._regs.get(key)
        return [] if reg is None else reg.pools()

    def addresses_of(self, session: str) -> list[tuple[str, int]]:
        """The endpoints that registered ``session``."""
        return [(host, port) for s, host, port in self._regs if s == session]

    def speaks_ours_at(self, host: str, port: int) -> bool:
        """Whether the process at ``host:port`` parses our extension frames: it answered one of our
        pings, or something registered there, all of it with our extension frames (a fork peer
        there must get nothing else, even when a stranger registered that address as ours)."""
        at = [r for (_, h, p), r in self._regs.items() if (h, p) == (host, port)]
        return any(r.proven for r in at) or (bool(at) and all(p.extended for r in at for p in r.pools()))

    def speaks_ours(self, key: PeerKey) -> bool:
        return key in self._regs and self.speaks_ours_at(key[1], key[2])

    def registered_at(self, host: str, port: int) -> bool:
        return any((h, p) == (host, port) for _, h, p in self._regs)

    def register(self, msg: RegisterMsg, mismatch: str, busy: Callable[[], set[PeerKey]]) -> str:
        """Record a register; returns why it was refused ("" when it was taken, or held as a
        claim until its endpoint settles it). ``busy`` gives the registrations that have live
        rooms."""
        self._registers += 1
        new = LanguagePeer(msg.endpoint, msg.dst_port, msg.base_ptrs, msg.generation, msg.num_blocks,
                           msg.item_lens, mismatch)
        key = (msg.session_id, msg.endpoint, msg.dst_port)
        reg = self._regs.get(key)
        if reg is None:
            if len(self._regs) >= MAX_PEERS:
                in_use = busy()  # the oldest idle registration goes: one a repeated register kept young stays
                idle = next((k for k in self._regs if k not in in_use), None)
                if idle is None:
                    return f"{len(self._regs)} sessions registered, all with live rooms"
                del self._regs[idle]
            self._regs[key] = Registration(new, order=self._registers)
            sharing = [(k, r) for k, r in self._regs.items() if k[1:] == new.address]
            if len(sharing) > 1 and self.speaks_ours_at(*new.address):  # who answers from there lives there
                for k, r in sharing:
                    self._ping(k, r, self.stall.epoch())
            return ""
        self._regs[key] = self._regs.pop(key)  # the newest, for eviction
        if reg.held.same_pool(new):
            return ""  # a repeat (an open claim stays open: the endpoint's next answer settles it)
        # An older generation than a pool its endpoint proved is a replay; before any proof nothing
        # says which register is the endpoint's (a forged one may name 2**63-1).
        if reg.proven and None not in (reg.held.generation, new.generation) and new.generation < reg.held.generation:
            return (f"session {msg.session_id} registered at {msg.endpoint}:{msg.dst_port} with generation "
                    f"{new.generation}, older than its {reg.held.generation} (a replayed register?)")
        if not self.speaks_ours(key) or (not new.extended and not reg.proven):
            # A fork peer's endpoint (or one nothing proved ours, registered as a fork's): no ping
            # can settle anything there, so the newest register holds.
            reg.held, reg.claims, reg.confirmed_epoch = new, [], -1
            return ""
        reg.claims = [p for p in reg.claims if not p.same_pool(new)][-(MAX_CLAIMS - 1):] + [new]
        if not reg.pings:
            self._ping(key, reg, self.stall.epoch())
        return ""

    def may_write(self, key: PeerKey) -> bool:
        """A write to ``key`` may start now; if not, a ping is on its way and :meth:`on_pong`
        says when it may."""
        if self.writable(key):
            return True
        self.confirm(key)
        return False

    def writable(self, key: PeerKey) -> bool:
        """A write to ``key`` may start now (asks nothing of the peer)."""
        reg = self._regs.get(key)
        if reg is None or not self.speaks_ours(key):
            return True  # fork peers are never pinged; an unknown registration fails in the write, by name
        return not reg.claims and not reg.silent and reg.confirmed_epoch == self.stall.epoch()

    def confirm(self, key: PeerKey) -> None:
        """Ping ``key`` unless it may be written now or a ping of it is out in this epoch (its
        answer settles it)."""
        reg = self._regs.get(key)
        if reg is None or self.writable(key):
            return
        epoch = self.stall.epoch()
        if not any(p.epoch == epoch for p in reg.pings.values()):
            self._ping(key, reg, epoch)

    def on_pong(self, msg: PongMsg) -> PongOutcome | None:
        """Handle an answer (None: it answers no ping we sent, or names a session not registered
        at the endpoint that was pinged). The answering session lives at that endpoint: other
        sessions registered there are dropped; the pool whose generation it names is the one it
        holds (a pong without one: its newest register)."""
        pinged = next((k for k, r in self._regs.items() if msg.seq in r.pings), None)
        if pinged is None:
            return None
        key = (msg.session_id, pinged[1], pinged[2])
        reg = self._regs.get(key)
        if reg is None:
            return None
        epoch = self._regs[pinged].pings.pop(msg.seq).epoch
        refused = []
        pools = reg.pools()
        chosen = pools[0] if msg.generation is None else next(
            (p for p in pools if p.generation == msg.generation), None)
        if chosen is None:  # its pool is not registered here (yet): its register brings it
            reg.confirmed_epoch = -1
        else:
            losers = [p for p in pools if p is not chosen and (p is not reg.held or not reg.proven)]
            refused = [f"a register for session {msg.session_id} named {p.describe()}; that endpoint answers "
                       f"with generation {msg.generation}" for p in losers]
            if chosen is not reg.held:
                reg.held, reg.confirmed_epoch = chosen, -1
            reg.claims = []
            reg.confirmed_epoch = max(reg.confirmed_epoch, epoch)
        dropped = [(k, r) for k, r in self._regs.items() if k[1:] == key[1:] and k != key]
        for k, _ in dropped:
            del self._regs[k]
        reg.pings = {seq: ping for seq, ping in reg.pings.items() if seq > msg.seq}  # older ones are answered too
        reg.misses, reg.silent = 0, False
        return PongOutcome(self.writable(key), dropped, key, reg.order, refused)

    def beat(self, live: dict[PeerKey, float]) -> list[DeadPeer]:
        """One heartbeat interval: count misses, ping again; returns the registrations with live
        rooms that are now dead (forget nothing: an answer to a later ping brings one back).
        ``live`` maps each to the latest time it joined one of its live rooms: when that is after
        the last missed ping left, the registration keeps one miss short of dead (and the pings
        sent since), and its next answer or miss decides for the rooms it spared. A registration
        with open claims whose endpoint stays silent keeps its newest claim."""
        dead = []
        epoch, now = self.stall.epoch(), self.clock()
        for key in live.keys() | {k for k, r in self._regs.items() if r.claims}:
            reg = self._regs.get(key)
            if reg is None or not self.speaks_ours(key):
                continue
            # A ping of this epoch unanswered for half an interval (one sent by the last beat, not
            # one a write asked for just now)
            missed = [p.sent_at for p in reg.pings.values() if p.epoch == epoch and now - p.sent_at >= self.interval / 2]
            if missed:
                reg.misses += 1
            if reg.misses >= self.max_misses:
                why = f"{reg.misses} pings in a row unanswered ({self.interval:g}s apart)"
                last_missed = max(missed, default=now)
                if live.get(key, 0.0) > last_missed:  # rooms joined since: the pings sent since speak for them
                    reg.misses = self.max_misses - 1
                    reg.pings = {seq: ping for seq, ping in reg.pings.items() if ping.sent_at > last_missed}
                else:
                    reg.misses, reg.pings = 0, {}
                reg.silent = True
                if key in live:
                    dead.append(DeadPeer(key, why, last_missed))
                if reg.claims:
                    log.warning("session %s at %s:%d: %s; its newest register (%s) holds, unproven", key[0],
                                key[1], key[2], why, reg.claims[-1].describe())
                    reg.held, reg.claims, reg.confirmed_epoch = reg.claims[-1], [], -1
                continue
            self._ping(key, reg, epoch)
        return dead

    def _ping(self, key: PeerKey, reg: Registration, epoch: int) -> None:
        # Increasing (the high bits count) and unguessable (the low bits are random): a pong
        # proves its sender got this ping.
        self._seq += 1
        seq = (self._seq << 32) | secrets.randbits(32)
        reg.pings[seq] = Ping(epoch, self.clock())
        self._push.try_send(key[1], key[2], PingMsg(self._host, self._rank_port, seq).encode())

    def close(self) -> None:
        self.stall.close()
