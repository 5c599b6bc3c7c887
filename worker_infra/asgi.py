"""ASGI middlewares in front of every worker's app (our own workers' and SGLang's server).

* :class:`BodyLimit`: a request body is bounded: 413 from ``Content-Length`` before anything is
  read, or as soon as a body sent without one (chunked) passes the bound; nothing beyond the bound
  is held, nothing is parsed.
* :class:`CancelOnDisconnect`: a client that goes away cancels its request's handler
  (``asyncio.CancelledError`` in it), so the handler can cancel the request's work; uvicorn would
  leave it running to its end.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ErrorShape = Callable[[int, str], dict]  # a status and a message -> the JSON body answering them


def openai_error(status: int, message: str) -> dict:
    """SGLang's (and OpenAI's) error body."""
    return {"error": {"message": message, "code": status}, "object": "error", "message": message, "code": status}


async def answer(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """A JSON answer, the connection closed after it."""
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": raw})


class BodyLimit:
    def __init__(self, app, max_bytes: int, flag: str = "", shape: ErrorShape = openai_error) -> None:
        """``flag``: the option that sets ``max_bytes``, named in the answer; ``shape``: the app's
        error body."""
        self.app, self.max_bytes, self.flag, self.shape = app, max_bytes, flag, shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await answer(send, 413, self.shape(413, self._too_large(declared.decode("latin-1"))))
        received = 0
        refused = started = False

        async def bounded_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        await answer(send, 413, self.shape(413, self._too_large(f"more than {self.max_bytes}")))
                    return {"type": "http.disconnect"}  # the app stops reading; what it answers is dropped
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, bounded_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # the app failed on the disconnect it was handed (Starlette's ClientDisconnect): the
            # client has its 413

    def _too_large(self, size: str) -> str:
        flag = f" ({self.flag})" if self.flag else ""
        return f"request body of {size} bytes is over this server's limit of {self.max_bytes} bytes{flag}"


class CancelOnDisconnect:
    """The app runs as a task of its own while this reads what the client sends: the body goes
    to the app as it asks for it, and a disconnect before the answer is complete cancels the task."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        messages: asyncio.Queue[Message] = asyncio.Queue()  # at most the body (bounded outside this)
        answered = False

        async def sending(message: Message) -> None:
            nonlocal answered
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True

        handler = asyncio.ensure_future(self.app(scope, messages.get, sending))

        async def listen() -> None:
            while True:
                message = await receive()
                messages.put_nowait(message)
                if message["type"] == "http.disconnect":
                    if not answered:
                        handler.cancel()
                    return

        listener = asyncio.ensure_future(listen())
        try:
            await asyncio.shield(handler)
        except asyncio.CancelledError:
            if not handler.cancelled():  # this request's own task was cancelled (the server stops)
                handler.cancel()
                raise
            # the client went away: nobody to answer
        finally:
            listener.cancel()
