"""The HTTP side of a worker: errors answered as JSON with their kind, strict request bodies, the
sleep routes, and the app our own workers serve (FastAPI, on uvicorn) until SIGINT/SIGTERM.
SGLang's server (the language worker) takes the errors and the sleep routes from here too."""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import signal
import socket
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from connector import CheckpointError, FailureKind, TransferFailure
from worker_infra.asgi import BodyLimit, CancelOnDisconnect

SHUTDOWN_GRACE_S = 2.0  # handlers still running at shutdown get this long, then are cancelled


class HTTPError(Exception):
    """A request refused before any transfer began; ``kind`` says its status (the message goes
    to the client as is)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def asleep_error(role: str) -> TransferFailure:
    return TransferFailure(FailureKind.ASLEEP, f"the {role} worker is asleep; retry after it wakes up")


def error_body(status: int, message: str, kind: FailureKind | None = None) -> dict:
    return {"error": message, "status": status, **({"kind": kind.value} if kind else {})}


def error_reply(exc: HTTPError | TransferFailure | CheckpointError
                ) -> tuple[int, str, dict[str, str], FailureKind]:
    """The status, message, headers and failure kind an error of ours is answered with."""
    if isinstance(exc, CheckpointError):  # a wake-up refused its checkpoint; nothing was loaded
        kind, message = FailureKind.BAD_CHECKPOINT, f"{exc}; fix or remove it, or wake with discard_checkpoint=true"
    else:
        kind, message = exc.kind, str(exc)
    return kind.http_status, message, kind.headers(), kind


class JSON(JSONResponse):
    """A JSON answer as Python's ``json`` writes it (a float that is not finite included)."""

    def render(self, content: object) -> bytes:
        return json.dumps(content).encode()


def json_error(status: int, message: str, headers: Mapping[str, str] | None = None,
               kind: FailureKind | None = None) -> JSON:
    return JSON(error_body(status, message, kind), status_code=status, headers=dict(headers or {}))


async def _our_error(_request: Request, exc: Exception) -> JSON:
    return json_error(*error_reply(exc))  # type: ignore[arg-type]


async def _starlettes_error(_request: Request, exc: Exception) -> JSON:
    assert isinstance(exc, StarletteHTTPException)  # an unknown route, a method it does not take
    return json_error(exc.status_code, str(exc.detail), exc.headers)


def answer_our_errors(app: FastAPI) -> None:
    """Our errors raised in ``app``'s handlers are answered with their status, ``Retry-After``
    where a retry can help, and a JSON body naming their kind."""
    for error in (HTTPError, TransferFailure, CheckpointError):
        app.add_exception_handler(error, _our_error)


def worker_app(worker, max_body_bytes: int, admin_api_key: str | None) -> FastAPI:  # noqa: ANN001
    """The app of one of our own workers (an EncodeWorker or a LanguageWorker), with the routes
    both have: ``GET /health``, ``GET /metrics`` and the sleep routes (behind ``admin_api_key``);
    every error a JSON body, bodies bounded by ``max_body_bytes``, a client that goes away
    cancelling its handler."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    answer_our_errors(app)
    app.add_exception_handler(StarletteHTTPException, _starlettes_error)
    app.add_middleware(CancelOnDisconnect)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, shape=error_body)  # outermost: before anything reads

    async def health() -> JSON:
        return JSON(worker.health())

    async def metrics() -> Response:
        return Response(worker.metrics.render(), media_type="text/plain")

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    add_sleep_routes(app, WorkerSleep(worker), admin_key_guard(admin_api_key))
    return app


# ---- request bodies --------------------------------------------------------------------------------

class StrictBody(BaseModel):
    """A request body: strict types (no ``"7"`` for 7, no ``true`` for 1), no NaN, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as ``model``; HTTPError 400 naming the first problem otherwise."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise HTTPError(FailureKind.BAD_REQUEST, _first_problem(exc, model)) from None


def _first_problem(exc: ValidationError, model: type[BaseModel]) -> str:
    errors = exc.errors()
    if unknown := [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden"]:
        return (f"unknown field(s) {', '.join(map(repr, unknown[:8]))}; this route takes "
                f"{', '.join(map(repr, model.model_fields))}")
    first = errors[0]
    if not first["loc"] or first["type"] == "json_invalid":  # not JSON, or not an object
        return "body must be a JSON object"
    name = str(first["loc"][0])
    return f"missing field {name!r}" if first["type"] == "missing" else f"field {name!r} has the wrong type"


def check_room(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_room must be an integer in [0, 2^63)")
    return value


# ---- sleep and wake -------------------------------------------------------------------------------

class Sleeper(Protocol):
    """What the sleep routes drive: a worker of ours (:class:`WorkerSleep`) or SGLang's server."""

    async def sleep(self, level: int, preserve_state: bool) -> dict: ...

    async def wake_up(self, discard_checkpoint: bool) -> dict: ...

    def is_sleeping(self) -> bool: ...


class WorkerSleep:
    """One of our workers' sleep and wake (blocking calls, run on a thread)."""

    def __init__(self, worker) -> None:  # noqa: ANN001 - an EncodeWorker or a LanguageWorker
        self.worker = worker

    async def sleep(self, level: int, preserve_state: bool) -> dict:
        return await asyncio.to_thread(self.worker.sleep, level, preserve_state)

    async def wake_up(self, discard_checkpoint: bool) -> dict:
        return await asyncio.to_thread(self.worker.wake_up, discard_checkpoint)

    def is_sleeping(self) -> bool:
        return self.worker.is_sleeping()


def sleep_params(query: Mapping[str, str]) -> tuple[int, bool]:
    """``level`` (1 or 2, default 1) and ``preserve_state`` (default false) of ``POST /sleep``."""
    level = query.get("level", "1")
    preserve = query.get("preserve_state", "false").lower()
    if level not in ("1", "2"):
        raise HTTPError(FailureKind.BAD_REQUEST, f"level must be 1 or 2, got {level!r}")
    if preserve not in ("true", "false", "1", "0"):
        raise HTTPError(FailureKind.BAD_REQUEST, f"preserve_state must be true or false, got {preserve!r}")
    return int(level), preserve in ("true", "1")


def wake_params(query: Mapping[str, str]) -> bool:
    """``discard_checkpoint`` (default false) of ``POST /wake_up``."""
    return query.get("discard_checkpoint", "false").lower() in ("true", "1")


Guard = Callable[[Callable], Callable]  # marks or wraps a route's endpoint (who may call it)


def add_sleep_routes(app: FastAPI, sleeper: Sleeper, admin: Guard) -> None:
    """``POST /sleep``, ``POST /wake_up`` (both behind ``admin``) and ``GET /is_sleeping``.
    A refusal is one of our errors: ``app`` answers them (:func:`answer_our_errors`)."""

    async def sleep(request: Request) -> JSON:
        level, preserve = sleep_params(request.query_params)
        return JSON(await sleeper.sleep(level, preserve))

    async def wake_up(request: Request) -> JSON:
        return JSON(await sleeper.wake_up(wake_params(request.query_params)))

    async def is_sleeping() -> JSON:
        return JSON({"is_sleeping": sleeper.is_sleeping()})

    app.add_api_route("/sleep", admin(sleep), methods=["POST"])
    app.add_api_route("/wake_up", admin(wake_up), methods=["POST"])
    app.add_api_route("/is_sleeping", is_sleeping, methods=["GET"])


def admin_key_guard(admin_api_key: str | None) -> Guard:
    """With ``admin_api_key`` (``--admin-api-key``, SGLang's flag) an endpoint needs it as a bearer
    token (401 otherwise), as SGLang's own admin routes do; without one it is open."""

    def guard(endpoint: Callable) -> Callable:
        @functools.wraps(endpoint)
        async def guarded(request: Request) -> object:
            check_admin(request.headers.get("Authorization"), admin_api_key)
            return await endpoint(request)

        return guarded

    return guard


def check_admin(authorization: str | None, admin_api_key: str | None) -> None:
    """HTTPError 401 unless ``authorization`` is ``Bearer <admin_api_key>`` (nothing to check
    without a key)."""
    if not admin_api_key:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), admin_api_key.encode()):
        raise HTTPError(FailureKind.UNAUTHORIZED, "this route needs the admin API key (Authorization: Bearer ...)")


# ---- serving ---------------------------------------------------------------------------------------

def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port) and listening; OSError when it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class AppServer:
    """``app`` served by uvicorn on a socket already bound, on the running event loop: ``start``,
    then ``run`` until ``should_stop``, then ``close`` (its handlers get :data:`SHUTDOWN_GRACE_S`)."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)

    async def start(self) -> None:
        await self._server.startup(sockets=[self.sock])
        if self._server.should_exit:
            raise RuntimeError(f"the HTTP server on port {self.port} did not start")

    def should_stop(self) -> None:
        self._server.should_exit = True

    async def run(self) -> None:
        """Until :meth:`should_stop` (uvicorn's ticks: its ``Date`` header, its limits)."""
        await self._server.main_loop()

    async def close(self) -> None:
        await self._server.shutdown(sockets=[self.sock])


def serve(app: FastAPI, host: str, port: int, banner: Callable[[int], None],
          stopping: Callable[[], None], on_shutdown: Callable[[], None]) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM; then ``stopping`` fails what is in
    flight (clients get a 503 at once), the server closes, and ``on_shutdown`` releases the rest."""
    try:
        sock = listening_socket(host, port)
    except OSError as exc:
        on_shutdown()
        raise SystemExit(f"error: the worker could not bind its HTTP port {host}:{port}: {exc}") from None

    async def main() -> None:
        server = AppServer(app, sock)
        await server.start()
        banner(server.port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.should_stop)
        await server.run()
        await asyncio.to_thread(stopping)
        await server.close()

    try:
        asyncio.run(main())
    finally:
        on_shutdown()
