"""aiohttp pieces both workers use: JSON errors, body validation, serving until stopped."""

from __future__ import annotations

import asyncio
import ipaddress
import re
import secrets
import signal
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import TypeVar
from urllib.parse import urlsplit

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from connector import CheckpointError, FailureKind, TransferFailure


class HTTPError(Exception):
    """A request refused before any transfer began; ``kind`` says its status (the message goes
    to the client as is)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def asleep_error(role: str) -> TransferFailure:
    return TransferFailure(FailureKind.ASLEEP, f"the {role} worker is asleep; retry after it wakes up")


def json_error(status: int, message: str, headers: dict[str, str] | None = None,
               kind: FailureKind | None = None) -> web.Response:
    return web.json_response(error_body(status, message, kind), status=status, headers=headers)


def error_body(status: int, message: str, kind: FailureKind | None = None) -> dict:
    return {"error": message, "status": status, **({"kind": kind.value} if kind else {})}


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


def add_sleep_routes(app: web.Application, worker, admin_api_key: str | None = None) -> None:
    """``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping`` over a worker's methods. With
    ``admin_api_key`` (``--admin-api-key``, SGLang's flag), sleep and wake need it as a bearer
    token (401 otherwise), as SGLang's own admin routes do."""

    async def sleep(request: web.Request) -> web.Response:
        check_admin(request.headers.get("Authorization"), admin_api_key)
        level, preserve = sleep_params(request.query)
        return web.json_response(await asyncio.to_thread(worker.sleep, level, preserve))

    async def wake_up(request: web.Request) -> web.Response:
        check_admin(request.headers.get("Authorization"), admin_api_key)
        discard = wake_params(request.query)
        return web.json_response(await asyncio.to_thread(worker.wake_up, discard))

    async def is_sleeping(_request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": worker.is_sleeping()})

    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake_up", wake_up)
    app.router.add_get("/is_sleeping", is_sleeping)


def check_admin(authorization: str | None, admin_api_key: str | None) -> None:
    """HTTPError 401 unless ``authorization`` is ``Bearer <admin_api_key>`` (nothing to check
    without a key)."""
    if not admin_api_key:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), admin_api_key.encode()):
        raise HTTPError(FailureKind.UNAUTHORIZED, "this route needs the admin API key (Authorization: Bearer ...)")


@web.middleware
async def errors_as_json(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except (HTTPError, TransferFailure, CheckpointError) as exc:
        return json_error(*error_reply(exc))
    except web.HTTPException as exc:
        return json_error(exc.status, exc.reason or "error")


def error_reply(exc: HTTPError | TransferFailure | CheckpointError
                ) -> tuple[int, str, dict[str, str], FailureKind]:
    """The status, message, headers and failure kind an error of ours is answered with."""
    if isinstance(exc, CheckpointError):  # a wake-up refused its checkpoint; nothing was loaded
        kind, message = FailureKind.BAD_CHECKPOINT, f"{exc}; fix or remove it, or wake with discard_checkpoint=true"
    else:
        kind, message = exc.kind, str(exc)
    return kind.http_status, message, kind.headers(), kind


class StrictBody(BaseModel):
    """A request body: strict types (no ``"7"`` for 7, no ``true`` for 1), no NaN, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: web.Request, model: type[Body]) -> Body:
    """The request's JSON body as ``model``; HTTPError 400 naming the first problem otherwise."""
    try:
        return model.model_validate_json(await request.read())
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


async def wait_for_future(future: Future, on_cancel: Callable[[], object]) -> object:
    """Await a worker's future without cancelling it when the client goes away (the worker
    still completes it); ``on_cancel`` is called then, to cancel the work instead."""
    wrapped = asyncio.wrap_future(future)
    wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if nobody awaits it
    try:
        return await asyncio.shield(wrapped)
    except asyncio.CancelledError:
        on_cancel()
        raise


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def check_host(value: str) -> str:
    """A host name or IP address, as it goes into a URL (IPv6 in brackets); HTTPError 400 for
    anything else (a port, a path, a query)."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        labels = value.removesuffix(".").split(".")
        if len(value) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
            raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_host must be a host name or an IP address") from None
        return value
    return f"[{address}]" if address.version == 6 else str(address)


def encoder_host(url: str) -> str:
    """The host of an ``--encoder-urls`` entry; ValueError for anything but ``http://host:port``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"--encoder-urls: {url!r} is not http://host:port")
    return parts.hostname


class BootstrapAllowList:
    """The encoders a request may name by ``bootstrap_host``/``bootstrap_port`` (the two-request
    flow): the entries of ``--allowed-bootstrap-hosts`` (``host`` for any port of it, or
    ``host:port``), and nothing else: being in ``--encoder-urls`` does not open the flow, whose
    rooms a client names. Anything else is refused with 403 before this worker contacts it, so
    a client cannot make it fetch or probe a host of its choosing."""

    def __init__(self, entries: list[str]) -> None:
        self._hosts: set[str] = set()
        self._addrs: set[tuple[str, int]] = set()
        for entry in entries:
            host, port = _host_and_port(entry)
            if port is None:
                self._hosts.add(_canonical_host(host))
            else:
                self._addrs.add((_canonical_host(host), port))

    def check(self, host: str, port: int) -> None:
        """HTTPError 403 unless ``host:port`` (``host`` as :func:`check_host` returned it) is allowed."""
        name = _canonical_host(host.strip("[]"))
        if name not in self._hosts and (name, port) not in self._addrs:
            raise HTTPError(FailureKind.FORBIDDEN,
                            f"bootstrap_host {host}:{port} is not an encoder this worker may contact (the "
                            f"two-request flow needs --allowed-bootstrap-hosts {host})")


def _host_and_port(entry: str) -> tuple[str, int | None]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port`` (a bare IPv6 address has no port)."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    else:
        host, port = entry, ""
    if not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(f"--allowed-bootstrap-hosts: {entry!r} is not host, host:port or [IPv6]:port")
    return host, int(port) if port else None


def _canonical_host(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        return value.lower().removesuffix(".")


def check_room(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_room must be an integer in [0, 2^63)")
    return value


def serve(app: web.Application, host: str, port: int, banner: Callable[[int], None],
          stopping: Callable[[], None], on_shutdown: Callable[[], None]) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM; then ``stopping`` fails what is in
    flight (clients get a 503 at once), the server closes, and ``on_shutdown`` releases the rest.

    A client that disconnects cancels its handler (``asyncio.CancelledError`` in it), so a
    handler can cancel the request's work.
    """

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        banner(runner.addresses[0][1])
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await asyncio.to_thread(stopping)
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        on_shutdown()
