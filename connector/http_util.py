"""aiohttp pieces both workers use: JSON errors, body validation, serving until stopped."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web


class HTTPError(Exception):
    """An error with the HTTP status it maps to; the message goes to the client as is."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


@web.middleware
async def errors_as_json(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    try:
        return await handler(request)
    except HTTPError as exc:
        return json_error(exc.status, exc.message)
    except web.HTTPException as exc:
        return json_error(exc.status, exc.reason or "error")


async def read_json(request: web.Request, required: dict[str, type | tuple[type, ...]]) -> dict:
    """The request's JSON object with ``required`` fields checked; HTTPError 400 otherwise."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPError(400, "body must be a JSON object") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "body must be a JSON object")
    for name, kind in required.items():
        if name not in body:
            raise HTTPError(400, f"missing field {name!r}")
        if not isinstance(body[name], kind) or isinstance(body[name], bool):
            raise HTTPError(400, f"field {name!r} has the wrong type")
    return body


def check_room(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise HTTPError(400, "bootstrap_room must be an integer in [0, 2^63)")
    return value


def serve(app: web.Application, host: str, port: int, banner: Callable[[int], None],
          on_shutdown: Callable[[], None]) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT/SIGTERM, then call ``on_shutdown``."""

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        banner(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        on_shutdown()
