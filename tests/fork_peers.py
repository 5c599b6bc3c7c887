"""Test doubles that behave on the wire exactly like the reference fork (ZhengWG/sglang vl-dis-1030).

Written from ``research/fork_wire.md``, not from the fork's code: real ZMQ, a real Mooncake
engine (:class:`MooncakeTransport`) and a :class:`BufferPool` for registered memory, no pickle.

* :class:`ForkLanguage` is a fork-shaped language side: 5-frame register, 7-frame init,
  8-frame resume; it unpacks every status as ``room, status = frames``.
* :class:`ForkEncoder` is a fork-shaped encode side with the fork's bootstrap HTTP server: it
  takes frame 0 of every message as ``None`` (register) or an int room, and sends 2-frame
  statuses.

Where the fork's thread would die on a message, the double records a *violation* and its
thread stops as the fork's does; tests assert ``violations == []``.
"""

from __future__ import annotations

import asyncio
import queue
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import requests
import zmq
from aiohttp import web

from connector.allocator import BlockAllocator
from connector.buffers import BufferPool, Embedding
from connector.mooncake_transport import MooncakeTransport
from connector.transport import TransferError
from harness.connector_peer import synthetic_embedding  # scripts/, on the path by conftest

REGISTER = b"None"
FAILED, TRANSFERRING, SUCCESS = 0, 3, 4  # KVPoll values the fork sends
AUX_BUFFER = 3


def _pack_ptrs(ptrs: tuple[int, ...]) -> bytes:
    """The fork's register frame 4: one native u64 per buffer."""
    return b"".join(struct.pack("Q", p) for p in ptrs)


def _ascii_int(frame: bytes) -> int:
    return int(frame.decode("ascii"))


class _ForkSide:
    """What both doubles have: a registered pool with its Mooncake engine, a PULL socket, and
    PUSH sockets to the peers it answers."""

    def __init__(self, num_blocks: int, block_size: int, hidden_size: int, dtype: str, host: str) -> None:
        self.pool = BufferPool(num_blocks, block_size, hidden_size, dtype)
        self.allocator = BlockAllocator(num_blocks)
        self.transport = MooncakeTransport(host, completion="sync")
        self.transport.register([(b.ctypes.data, b.nbytes) for b in self.pool.buffers])
        self.violations: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self._push: dict[tuple[str, int], zmq.Socket] = {}

    def _messages(self) -> Iterator[list[bytes]]:
        """Every message to the PULL socket until the side is closed."""
        while not self._stop.is_set():
            if self._pull.poll(100):
                yield self._pull.recv_multipart()

    def _close_side(self) -> None:
        """After the side's threads stopped: sockets, pool registration, engine."""
        for sock in self._push.values():
            sock.close(0)
        self._pull.close(0)
        self._ctx.term()
        self.transport.unregister([b.ctypes.data for b in self.pool.buffers])
        self.transport.close()


# ---- language side ------------------------------------------------------------------------------


@dataclass
class ForkLanguageRoom:
    """One request on the fork-shaped language side."""

    room: int
    rank: tuple[str, int]  # the encode rank's (ip, port)
    allocations: list[list[int]]  # the init's blocks, then each resume's
    statuses: list[int] = field(default_factory=list)
    total: int | None = None  # aux[0] of the first block of the first allocation
    aux: np.ndarray | None = None
    result: Embedding | None = None  # set on Success
    failed: bool = False  # a Failed status came
    error: str = ""  # what this double found wrong with the room (not a wire violation)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def resume_rounds(self) -> int:
        return len(self.allocations) - 1


class ForkLanguage(_ForkSide):
    """A fork-shaped language side with its own PULL socket, pool and Mooncake engine.

    ``first_tokens`` is the first allocation (the fork allocates 8192 tokens); a resume
    allocates the rest, at most ``resume_cap_blocks`` blocks when set (to force several rounds).
    """

    def __init__(self, num_blocks: int = 160, block_size: int = 128, hidden_size: int = 3584,
                 dtype: str = "bfloat16", first_tokens: int = 8192, resume_cap_blocks: int | None = None,
                 host: str = "127.0.0.1") -> None:
        super().__init__(num_blocks, block_size, hidden_size, dtype, host)
        self.host, self.first_tokens, self.resume_cap_blocks = host, first_tokens, resume_cap_blocks
        self.port = self._pull_port
        self.rooms: dict[int, ForkLanguageRoom] = {}
        self.received: list[list[bytes]] = []  # every message, as it came
        self.stray: list[tuple[int, int]] = []  # statuses for rooms it does not know (ignored)
        self._dead = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="fork-language-pull", daemon=True)
        self._thread.start()

    @property
    def session_id(self) -> str:
        return self.transport.session_id

    def lookup(self, bootstrap_addr: str, room: int, engine_rank: int = 0) -> tuple[str, int]:
        """The encode rank for ``room``, found with the fork's two ``GET /route`` calls."""
        base = f"http://{bootstrap_addr}"
        sizes = requests.get(f"{base}/route", params={"engine_rank": -1, "target_dp_group": -1}, timeout=5)
        sizes.raise_for_status()
        tp, dp = sizes.json()["embedding_tp_size"], sizes.json()["embedding_dp_size"]
        params = {"engine_rank": engine_rank % (tp // dp), "target_dp_group": room % dp}
        resp = requests.get(f"{base}/route", params=params, timeout=5)
        resp.raise_for_status()
        return str(resp.json()["rank_ip"]), int(resp.json()["rank_port"])

    def start(self, room: int, rank: tuple[str, int]) -> ForkLanguageRoom:
        """Allocate ``first_tokens`` and send the init (after the register, once per rank)."""
        blocks = self.allocator.allocate(self.first_tokens // self.pool.block_size)
        assert blocks is not None, "fork language pool too small for the first allocation"
        r = ForkLanguageRoom(room, rank, [blocks])
        with self._lock:
            self.rooms[room] = r
            self._send(r, blocks, None)
        return r

    def wait(self, room: int, timeout: float) -> ForkLanguageRoom:
        """The room once its final status came; AssertionError on a violation or timeout."""
        r = self.rooms[room]
        deadline = time.monotonic() + timeout
        while not r.done.wait(0.02):
            if self._dead.is_set():
                raise AssertionError(f"fork language side: {self.violations[0]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"room {room}: no final status within {timeout:g}s "
                                     f"(statuses so far {r.statuses})")
        return r

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_side()

    # ---- internals -------------------------------------------------------------------------------

    def _send(self, r: ForkLanguageRoom, blocks: list[int], sent: int | None) -> None:
        """Init (``sent`` None) or resume of ``r`` with ``blocks`` (lock held)."""
        sock = self._push.get(r.rank)
        if sock is None:
            sock = self._push[r.rank] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{r.rank[0]}:{r.rank[1]}")
            sock.send_multipart([REGISTER, self.host.encode(), str(self.port).encode(), self.session_id.encode(),
                                 _pack_ptrs(self.pool.base_ptrs)])
        frames = [str(r.room).encode(), self.host.encode(), str(self.port).encode(), self.session_id.encode(),
                  ",".join(map(str, blocks)).encode(), b"1"]
        if sent is not None:
            frames.append(str(sent).encode())
        sock.send_multipart(frames + [str(len(blocks) * self.pool.block_size).encode()])

    def _receive(self) -> None:
        for frames in self._messages():
            with self._lock:
                self.received.append(frames)
                if len(frames) != 2:
                    return self._die(f"a {len(frames)}-frame message {[f[:24] for f in frames]}: "
                                     "`room, status = frames` raises")
                try:
                    room, status = _ascii_int(frames[0]), _ascii_int(frames[1])
                except ValueError:
                    return self._die(f"status frames {frames} are not ASCII ints")
                self._on_status(room, status)

    def _die(self, why: str) -> None:
        """The fork's receiving thread would raise here and stop for good."""
        self.violations.append(why)
        self._dead.set()

    def _on_status(self, room: int, status: int) -> None:
        r = self.rooms.get(room)
        if r is None or r.done.is_set():
            self.stray.append((room, status))
            return
        r.statuses.append(status)
        if status == FAILED:
            r.failed = True
            self._finish(r)
        elif status == TRANSFERRING:
            self._resume(r)
        elif status == SUCCESS:
            r.result = self._assemble(r)
            self._finish(r)

    def _read_aux(self, r: ForkLanguageRoom) -> int:
        if r.aux is None:
            r.aux = self.pool.aux[r.allocations[0][0]].copy()
            r.total = int(r.aux[0])
        assert r.total is not None
        return r.total

    def _resume(self, r: ForkLanguageRoom) -> None:
        """After a partial round: ``sent = min(total, allocated)``, allocate the rest, resume."""
        bs, total = self.pool.block_size, self._read_aux(r)
        sent = min(total, sum(map(len, r.allocations)) * bs)
        need = -(-(total - sent) // bs)
        if self.resume_cap_blocks is not None:
            need = min(need, self.resume_cap_blocks)
        blocks = self.allocator.allocate(need) if need > 0 else None
        if blocks is None:
            r.error = f"cannot resume at {sent} of {total} tokens ({need} blocks needed)"
            self._finish(r)
            return
        r.allocations.append(blocks)
        self._send(r, blocks, sent)

    def _assemble(self, r: ForkLanguageRoom) -> Embedding:
        """Rows, fill ids and M-RoPE ``[3, n]`` of every block, in allocation order."""
        p, total = self.pool, self._read_aux(r)
        out = Embedding.empty(total, p.hidden_size, p.dtype)
        tok = 0
        for block in (b for blocks in r.allocations for b in blocks):
            n = min(p.block_size, total - tok)
            if n <= 0:
                break
            out.embeddings[tok:tok + n] = p.embeddings[block, : n * p.row_bytes].reshape(n, p.row_bytes)
            out.fill_ids[tok:tok + n] = p.fill_ids[block, :n]
            out.mrope_positions[:, tok:tok + n] = p.mrope[block, : 3 * n].reshape(3, n)
            tok += n
        if tok != total:
            r.error = f"Success with {tok} of {total} tokens allocated"
        out.aux[:] = r.aux
        return out

    def _finish(self, r: ForkLanguageRoom) -> None:
        self.allocator.free([b for blocks in r.allocations for b in blocks])
        r.done.set()


# ---- encode side --------------------------------------------------------------------------------


class ForkBootstrap:
    """The fork's bootstrap HTTP server (aiohttp); it sends no ``X-EPD-Incarnation`` header."""

    def __init__(self, host: str) -> None:
        self.host, self.port = host, 0
        self._sizes: tuple[int, int] | None = None  # (tp, dp), fixed by the first PUT
        self._table: dict[int, dict[int, dict[str, object]]] = {}  # dp_group -> tp_rank -> route
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), name="fork-bootstrap", daemon=True)
        self._thread.start()
        assert started.wait(10) and self.port, "fork bootstrap server did not start"

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/route", self._route)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, self.host, 0).start())
        self.port = self._runner.addresses[0][1]
        started.set()
        self._loop.run_forever()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        if request.method == "PUT":
            body = await request.json()
            self._sizes = self._sizes or (int(body["tp_size"]), int(body["dp_size"]))
            tp, rank = self._sizes[0], int(body["engine_rank"])
            self._table.setdefault(rank // tp, {})[rank % tp] = {"rank_ip": body["rank_ip"],
                                                                 "rank_port": body["rank_port"]}
            return web.Response(text="OK")
        if request.method != "GET":
            return web.Response(status=405)
        if "engine_rank" not in request.query or "target_dp_group" not in request.query:
            return web.Response(status=400)
        rank, group = int(request.query["engine_rank"]), int(request.query["target_dp_group"])
        if rank == -1 and group == -1:
            tp, dp = self._sizes or (None, None)
            return web.json_response({"embedding_tp_size": tp, "embedding_dp_size": dp})
        try:
            return web.json_response(self._table[group][rank])
        except KeyError:
            return web.Response(status=500, text="KeyError")

    def close(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@dataclass
class _Transfer:
    """The fork's transfer info of one room: where the current round goes."""

    endpoint: str
    port: int
    session: str
    dst_blocks: list[int]
    allocated: int
    sent: int = 0
    pending: bool = True  # a round was asked for and not written yet


@dataclass
class _Staged:
    src_blocks: list[int]
    tokens: int
    held: bool


class ForkEncoder(_ForkSide):
    """A fork-shaped encode side: bootstrap server, PULL socket, source pool, Mooncake engine.

    Its receiving thread dies (a violation) on any message whose frame 0 is neither ``None``
    nor an int room; its transfer thread dies (no status sent) on a block-size mismatch or an
    unregistered session. ``stage(..., hold=True)`` keeps a room from being written until
    :meth:`release`.
    """

    def __init__(self, num_blocks: int = 160, block_size: int = 128, hidden_size: int = 3584,
                 dtype: str = "bfloat16", host: str = "127.0.0.1") -> None:
        super().__init__(num_blocks, block_size, hidden_size, dtype, host)
        self.received: list[tuple[int, bytes]] = []  # (frame count, frame 0) of every message
        self.statuses_sent: list[tuple[int, int]] = []
        self.dropped_resumes: list[int] = []  # resumes for rooms it has no transfer info for
        self._sessions: dict[str, tuple[int, ...]] = {}  # session -> destination base pointers
        self._transfers: dict[int, _Transfer] = {}
        self._staged: dict[int, _Staged] = {}
        self._rounds: queue.Queue[int] = queue.Queue()
        self.rank_port = self._pull_port  # its PUSH sockets are used by the transfer thread only
        self.bootstrap = ForkBootstrap(host)
        self.bootstrap_addr = f"{host}:{self.bootstrap.port}"
        requests.put(f"http://{self.bootstrap_addr}/route", timeout=5, json={
            "role": "Encode", "tp_size": 1, "dp_size": 1, "rank_ip": host, "rank_port": self.rank_port,
            "engine_rank": 0}).raise_for_status()
        self._receiver = threading.Thread(target=self._receive, name="fork-encoder-pull", daemon=True)
        self._transferer = threading.Thread(target=self._transfer, name="fork-encoder-transfer", daemon=True)
        self._receiver.start()
        self._transferer.start()

    @property
    def alive(self) -> bool:
        return self._receiver.is_alive() and self._transferer.is_alive()

    def foreign_messages(self) -> list[tuple[int, bytes]]:
        """Messages whose frame 0 is neither ``None`` nor an int room (ABORT, SUSPEND, PONG...)."""
        return [(n, head) for n, head in self.received if head != REGISTER and not head.isdigit()]

    def inited(self, room: int) -> bool:
        with self._lock:
            return room in self._transfers

    def stage(self, room: int, tokens: int, seed: int, hold: bool = False) -> Embedding:
        """Put :func:`synthetic_embedding` into source blocks; returns it (for comparing)."""
        return self.stage_embedding(room, synthetic_embedding(tokens, self.pool.hidden_size, self.pool.dtype, seed),
                                    hold)

    def stage_embedding(self, room: int, emb: Embedding, hold: bool = False) -> Embedding:
        """Put ``emb`` into source blocks for ``room``; returns it."""
        tokens = emb.num_tokens
        p = self.pool
        blocks = self.allocator.allocate(p.blocks_for(tokens))
        assert blocks is not None, "fork encoder pool too small"
        for i, block in enumerate(blocks):
            t0 = i * p.block_size
            n = min(p.block_size, tokens - t0)
            p.embeddings[block, : n * p.row_bytes] = emb.embeddings[t0:t0 + n].reshape(-1)
            p.fill_ids[block, :n] = emb.fill_ids[t0:t0 + n]
            p.mrope[block, : 3 * n] = emb.mrope_positions[:, t0:t0 + n].reshape(-1)
        p.aux[blocks[0]] = emb.aux
        with self._lock:
            self._staged[room] = _Staged(blocks, tokens, hold)
            self._queue_round(room)
        return emb

    def release(self, room: int) -> None:
        """Let a held room be written."""
        with self._lock:
            self._staged[room].held = False
            self._queue_round(room)

    def close(self) -> None:
        self._stop.set()
        self._receiver.join(timeout=5)
        self._transferer.join(timeout=30)
        self.bootstrap.close()
        self._close_side()

    # ---- receiving thread ----------------------------------------------------------------------

    def _receive(self) -> None:
        for frames in self._messages():
            with self._lock:
                self.received.append((len(frames), frames[0]))
                try:
                    self._on_message(frames)
                except Exception as exc:  # the fork's receiving thread dies here, for good
                    self.violations.append(f"receiving thread died on a {len(frames)}-frame message with frame 0 "
                                           f"{frames[0][:16]!r}: {type(exc).__name__}: {exc}")
                    return

    def _on_message(self, frames: list[bytes]) -> None:
        if frames[0] == REGISTER:
            ptrs = frames[4]
            self._sessions[frames[3].decode("ascii")] = struct.unpack(f"{len(ptrs) // 8}Q", ptrs)
            return
        room = _ascii_int(frames[0])
        if len(frames) < 7:
            raise ValueError(f"{len(frames)} frames is neither init nor resume")
        endpoint, port, session = frames[1].decode("ascii"), _ascii_int(frames[2]), frames[3].decode("ascii")
        blocks = [int(b) for b in frames[4].decode("ascii").split(",")]
        if len(frames) == 7:
            self._transfers[room] = _Transfer(endpoint, port, session, blocks, _ascii_int(frames[6]))
        else:
            t = self._transfers.get(room)
            if t is None:  # the fork logs and drops it
                self.dropped_resumes.append(room)
                return
            t.dst_blocks, t.sent, t.allocated, t.pending = blocks, _ascii_int(frames[6]), _ascii_int(frames[7]), True
        self._queue_round(room)

    def _queue_round(self, room: int) -> None:
        """Hand the room's next round to the transfer thread once data and request are there (lock held)."""
        t, s = self._transfers.get(room), self._staged.get(room)
        if t is not None and s is not None and t.pending and not s.held:
            t.pending = False
            self._rounds.put(room)

    # ---- transfer thread -------------------------------------------------------------------------

    def _transfer(self) -> None:
        while not self._stop.is_set():
            try:
                room = self._rounds.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._write_round(room)
            except (KeyError, ValueError) as exc:  # the fork's transfer thread dies; no status is sent
                self.violations.append(f"transfer thread died on room {room}: {type(exc).__name__}: {exc}")
                return

    def _write_round(self, room: int) -> None:
        """Write ``min(remaining, allocated)`` tokens, per block per buffer, then a 2-frame status."""
        p, bs = self.pool, self.pool.block_size
        with self._lock:
            t, s = self._transfers[room], self._staged[room]
            dst_bases = self._sessions[t.session]
        if t.allocated // len(t.dst_blocks) != bs:
            raise ValueError(f"allocated_tokens {t.allocated} // {len(t.dst_blocks)} blocks != block size {bs}")
        n = min(s.tokens - t.sent, t.allocated)
        first_src = t.sent // bs
        srcs, dsts, lens = [], [], []
        for i in range(-(-n // bs)):
            in_block = min(bs, n - i * bs)
            for buf, item in enumerate(p.item_lens[:AUX_BUFFER]):
                srcs.append(p.base_ptrs[buf] + s.src_blocks[first_src + i] * item)
                dsts.append(dst_bases[buf] + t.dst_blocks[i] * item)
                lens.append(item * in_block // bs)
        if t.sent == 0:
            item = p.item_lens[AUX_BUFFER]
            srcs.append(p.base_ptrs[AUX_BUFFER] + s.src_blocks[0] * item)
            dsts.append(dst_bases[AUX_BUFFER] + t.dst_blocks[0] * item)
            lens.append(item)
        try:
            self.transport.write(t.session, srcs, dsts, lens)
            status = SUCCESS if t.sent + n >= s.tokens else TRANSFERRING
        except TransferError:
            status = FAILED
        with self._lock:
            t.sent += n
            self.statuses_sent.append((room, status))
            if status != TRANSFERRING:
                del self._transfers[room], self._staged[room]
                self.allocator.free(s.src_blocks)
        self._status_socket(t.endpoint, t.port).send_multipart([str(room).encode(), str(status).encode()])

    def _status_socket(self, host: str, port: int) -> zmq.Socket:
        sock = self._push.get((host, port))
        if sock is None:
            sock = self._push[(host, port)] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{host}:{port}")
        return sock
