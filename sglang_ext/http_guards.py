"""ASGI middlewares our language mode puts in front of SGLang's FastAPI app (with
``worker_infra.asgi``'s, which every worker's app has).

* :class:`ScrubErrors`: an error answer never carries a server path or a stack frame (FastAPI's
  validation errors quote the endpoint's file and line; exceptions' texts may name files).
* :class:`RetryAfter`: a 429 or 503 without ``Retry-After`` gets the connector's.
* :class:`AsleepHealth`: while the worker sleeps, SGLang's ``/health`` and ``/health_generate``
  answer 503 at once (SGLang's own handler would send a one-token generation that the paused
  scheduler never runs, answer 503 after its 20 s timeout and mark the server unhealthy).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import TYPE_CHECKING

from connector import FailureKind
from worker_infra.asgi import Message, Receive, Scope, Send, answer, openai_error
from worker_infra.http import asleep_error

if TYPE_CHECKING:
    from language_side.worker import LanguageWorker

# a Python stack frame's line ('File "/x/y.py", line 3, in f'), raw or inside a JSON string
_FRAME = re.compile(r'(\\n|\n)?[ \t]*File \\?"[^"\\]+\\?", line \d+(, in [\w<>.]+)?')
_SOURCE_PATH = re.compile(r"(?<![\w.])/(?:[\w.+-]+/)+[\w.+-]+\.py\b")
# The workers' addresses in a reason (an encoder's URL, a peer's ZMQ or bootstrap endpoint):
# the client gets the reason, the logs keep the addresses
_ADDRESS = re.compile(r"\b(?:https?|tcp)://[^\s\"'\\/),]+"
                      r"|(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?(?![\w.])"
                      r"|\[[0-9A-Fa-f:.]+\](?::\d{1,5})?"
                      r"|(?<![\w.-])(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+):\d{1,5}\b")


class ScrubErrors:
    """Error answers (4xx, 5xx) with JSON or text bodies lose stack frames, source paths and the
    workers' addresses."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        held: Message | None = None  # an error's response start, until its body is known
        chunks: list[bytes] = []

        async def scrubbing_send(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                if message["status"] >= 400 and _declares_length(message):  # a body the app holds whole
                    held = message
                    return
                return await send(message)
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = scrub(b"".join(chunks))
            headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
            await send({**held, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            held = None
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, scrubbing_send)


def _declares_length(start: Message) -> bool:
    """Whether a response says its length (a stream does not: it passes as it is)."""
    return any(name.lower() == b"content-length" for name, _ in start.get("headers", []))


def scrub(body: bytes) -> bytes:
    """``body`` without stack frames, paths of Python source files and network addresses."""
    text = body.decode("utf-8", errors="replace")
    cleaned = _ADDRESS.sub("<address>", _SOURCE_PATH.sub("<server file>", _FRAME.sub("", text)))
    return cleaned.encode() if cleaned != text else body


class RetryAfter:
    """A 429 or 503 without ``Retry-After`` (SGLang answers the connector's refusals, and its own,
    without one) gets the connector's: 5 s while it sleeps, else 2 s."""

    def __init__(self, app, connector: LanguageWorker) -> None:
        self.app, self.connector = app, connector

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (429, 503):
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    kind = FailureKind.ASLEEP if self.connector.is_sleeping() else FailureKind.OVERLOADED
                    message = {**message, "headers": headers + [(b"retry-after", kind.retry_after.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)


# SGLang's health routes: each one generates a token, which a sleeping server does not
HEALTH_ROUTES = ("/health", "/health_generate")


class AsleepHealth:
    """While ``connector`` sleeps, ``GET /health`` and ``/health_generate`` answer at once: 503,
    ``{"sleeping": true}`` and the reason, with ``Retry-After``. Not ready to serve is what a
    readiness probe or a gateway should read; ``/is_sleeping`` tells a sleeping server from a
    broken one."""

    def __init__(self, app, connector: LanguageWorker) -> None:
        self.app, self.connector = app, connector

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in HEALTH_ROUTES and self.connector.is_sleeping():
            asleep = asleep_error("language")
            return await answer(send, asleep.kind.http_status,
                                openai_error(asleep.kind.http_status, str(asleep)) | {"sleeping": True},
                                [(b"retry-after", asleep.kind.retry_after.encode())])
        await self.app(scope, receive, send)


class FreezeGcAfterWake:
    """SGLang's launcher calls ``/freeze_gc`` once the server is warm; it asks the scheduler, which
    a server booted asleep (from ``--checkpoint-dir``) has paused, so it timed out after 10 s and
    logged a traceback. While ``connector`` sleeps the route answers at once (200, ``{"deferred":
    true}``) and ``pending`` is set: the wake-up freezes then."""

    def __init__(self, app, connector: LanguageWorker, pending: asyncio.Event) -> None:
        self.app, self.connector, self.pending = app, connector, pending

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/freeze_gc" and self.connector.is_sleeping():
            self.pending.set()
            body = json.dumps({"deferred": True, "is_sleeping": True}).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        await self.app(scope, receive, send)
