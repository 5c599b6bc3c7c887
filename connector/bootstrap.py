"""Bootstrap HTTP server (encode side) and its client (language side).

Routes and JSON bodies are the reference fork's, so fork peers can use ours:

* ``PUT /route`` ``{"role": "Encode", "tp_size", "dp_size", "rank_ip", "rank_port", "engine_rank"}``
* ``GET /route?engine_rank=-1&target_dp_group=-1`` -> ``{"embedding_tp_size", "embedding_dp_size"}``
* ``GET /route?engine_rank=R&target_dp_group=G`` -> ``{"rank_ip", "rank_port"}`` (plus the
  incarnation header below)
* ``GET /health`` -> ``OK`` (the language side's heartbeat), ``SLEEPING`` or ``SLEEPING
  checkpointed``; header ``X-EPD-Incarnation`` changes when the worker process restarts

Unknown ranks get 404 with a message (the fork answers 500).

Who may register a route: this server's own encode worker adds its ranks in process
(:meth:`BootstrapServer.put_route`). ``PUT /route`` over HTTP is refused (403) unless a shared
secret is set, and then it needs it, as ``GET /route`` does (``Authorization: Bearer``, see
:mod:`connector.auth`); otherwise anyone who reaches the port could point language workers,
and the pool addresses they register, at another host. ``/health`` stays open.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import requests
from aiohttp import web

from connector.auth import bearer, check_bearer

log = logging.getLogger(__name__)


INCARNATION_HEADER = "X-EPD-Incarnation"


@dataclass(frozen=True)
class RankRoute:
    rank_ip: str
    rank_port: int
    incarnation: str | None = field(default=None, compare=False)  # our encoders' header; fork peers send none

    @property
    def extended(self) -> bool:
        """An encoder of ours (it sent the incarnation header): it takes our extension messages
        (abort, suspend, pong); one built from the reference fork gets none of them."""
        return self.incarnation is not None



class BootstrapPortInUse(RuntimeError):
    """The bootstrap port is another process's (another encode worker on the same host)."""

class BootstrapServer:
    """aiohttp server in a daemon thread with its own event loop.

    ``health_status`` returns the text ``/health`` answers (it is called per request, so a
    worker can report "sleeping" there while staying alive).
    """

    def __init__(self, host: str, port: int, health_status: Callable[[], str] = lambda: "OK",
                 secret: bytes = b"") -> None:
        self.host, self.port, self._secret = host, port, secret
        self._health_status = health_status
        self.incarnation = uuid.uuid4().hex  # tells a restarted worker from the one before it
        self._sizes: tuple[int, int] | None = None  # (tp_size, dp_size), fixed by the first PUT
        self._table: dict[tuple[int, int], RankRoute] = {}  # (dp_group, tp_rank) -> route
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, args=(started,), name="bootstrap-http", daemon=True)
        self._thread.start()
        started.wait()
        if self._error is not None:
            taken = getattr(self._error, "errno", None) == errno.EADDRINUSE
            raise (BootstrapPortInUse if taken else RuntimeError)(
                f"bootstrap server could not listen on {host}:{port}: {self._error}") from self._error

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def put_route(self, tp_size: int, dp_size: int, rank_ip: str, rank_port: int, engine_rank: int) -> None:
        with self._lock:
            if self._sizes is None:
                self._sizes = (tp_size, dp_size)
            tp = self._sizes[0]
            self._table[(engine_rank // tp, engine_rank % tp)] = RankRoute(rank_ip, rank_port)

    def close(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_route("*", "/route", self._route)
        app.router.add_get("/health", self._health)
        try:
            self._runner = web.AppRunner(app, access_log=None)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            self._loop.run_until_complete(site.start())
            if self.port == 0:
                self.port = self._runner.addresses[0][1]
        except OSError as exc:
            self._error = exc
            started.set()
            return
        started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text=self._health_status(), headers={INCARNATION_HEADER: self.incarnation})

    async def _route(self, request: web.Request) -> web.Response:
        if not check_bearer(request.headers.get("Authorization"), self._secret):
            return web.Response(status=401, text="/route needs the shared secret (Authorization: Bearer)")
        if request.method == "PUT":
            if not self._secret:
                return web.Response(status=403, text="routes are registered by this server's own encode worker; "
                                                     "over HTTP only with a shared secret (--control-secret)")
            try:
                body = await request.json()
                if body.get("role") != "Encode":
                    raise ValueError(f"role must be 'Encode', got {body.get('role')!r}")
                self.put_route(int(body["tp_size"]), int(body["dp_size"]), str(body["rank_ip"]),
                               int(body["rank_port"]), int(body["engine_rank"]))
            except (ValueError, KeyError, TypeError) as exc:
                return web.Response(status=400, text=f"bad route registration: {exc}")
            return web.Response(text="OK")
        if request.method != "GET":
            return web.Response(status=405, text="only GET and PUT are allowed on /route")
        try:
            engine_rank = int(request.query["engine_rank"])
            dp_group = int(request.query["target_dp_group"])
        except (KeyError, ValueError):
            return web.Response(status=400, text="engine_rank and target_dp_group must be integers")
        with self._lock:
            if engine_rank == -1 and dp_group == -1:
                tp, dp = self._sizes or (None, None)
                return web.json_response({"embedding_tp_size": tp, "embedding_dp_size": dp})
            if self._sizes is None:
                return web.Response(status=404, text="no encode rank has registered yet")
            route = self._table.get((dp_group, engine_rank % self._sizes[0]))
        if route is None:
            return web.Response(status=404, text=f"no encode rank {engine_rank} in dp group {dp_group}")
        return web.json_response({"rank_ip": route.rank_ip, "rank_port": route.rank_port},
                                 headers={INCARNATION_HEADER: self.incarnation})


def fetch_route(bootstrap_addr: str, room: int, engine_rank: int = 0, timeout: float = 5.0,
                secret: bytes = b"") -> RankRoute:
    """Find the encode rank serving ``room`` (dp group ``room % dp_size``)."""
    base = bootstrap_addr if bootstrap_addr.startswith("http") else f"http://{bootstrap_addr}"
    headers = bearer(secret)
    try:
        sizes = requests.get(f"{base}/route", params={"engine_rank": -1, "target_dp_group": -1}, timeout=timeout,
                             headers=headers)
        sizes.raise_for_status()
        info = sizes.json()
        if info.get("embedding_dp_size") is None:
            raise ValueError("no rank registered yet")
        dp_group = room % int(info["embedding_dp_size"])
        resp = requests.get(f"{base}/route", params={"engine_rank": engine_rank, "target_dp_group": dp_group},
                            timeout=timeout, headers=headers)
        resp.raise_for_status()
        body = resp.json()
        return RankRoute(str(body["rank_ip"]), int(body["rank_port"]), resp.headers.get(INCARNATION_HEADER))
    except requests.HTTPError as exc:
        if exc.response is not None and exc.response.status_code == 401:
            # an encoder of this deployment with another secret (or this worker without one): said
            # as such to the client and the operator, a misconfiguration to fix on one side
            why = ("refused this worker's control secret (401): set the same --control-secret / "
                   "SGLANG_EMBEDDING_CONTROL_SECRET on every worker" if secret else
                   "needs a control secret (401) and this worker has none: set --control-secret / "
                   "SGLANG_EMBEDDING_CONTROL_SECRET as on the encoders")
            log.warning("route lookup at %s: %s", bootstrap_addr, why)
            raise ConnectionError(f"encode bootstrap {bootstrap_addr} {why}") from None
        log.warning("route lookup at %s failed: %s", bootstrap_addr, exc)
        raise ConnectionError(f"encode bootstrap {bootstrap_addr} unreachable or gave no valid route") from None
    except (requests.RequestException, ValueError, KeyError) as exc:
        # The client that named this address learns only that it gave no route: what the remote
        # end answered (a status, a banner, refused or silent) stays in this worker's log.
        log.warning("route lookup at %s failed: %s", bootstrap_addr, exc)
        raise ConnectionError(f"encode bootstrap {bootstrap_addr} unreachable or gave no valid route") from None
