"""OpenAI-compatible routes of the language worker: ``POST /v1/chat/completions``,
``POST /v1/completions`` and ``GET /v1/models``.

Bodies are pydantic models (strict types, unknown fields refused, sizes bounded). Chat images
(``image_url`` parts: ``data:`` URIs, ``http(s)://`` URLs, local paths where the encoders allow
them) go to the encoders of ``--encoder-urls``; the answer is OpenAI's ``chat.completion`` (or
``text_completion``) with ``usage``, or SSE chunks ending with ``data: [DONE]``. Errors have
OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, also inside a stream that
already started.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

from aiohttp import web
from pydantic import Field, model_validator

from connector.failures import TransferFailure
from language_side.engine import SamplingParams
from language_side.prompt import IMAGE_PLACEHOLDER, render_chat
from language_side.schemas import (
    MAX_IMAGE_SOURCE_CHARS,
    MAX_IMAGES,
    MAX_MESSAGES,
    MAX_TEXT_CHARS,
    BodyError,
    parse,
)
from language_side.serving import Event, Generation, GenerationService, TextStream
from worker_infra.http import HTTPError, StrictBody

MAX_PARTS = 256  # per message
# (rid, prompt text, image sources in order, sampling) -> the generation and its transfer's fields
StartGeneration = Callable[[str, str, list[str], SamplingParams], Awaitable[tuple[Generation, dict]]]


class ImageURL(StrictBody):
    url: str = Field(min_length=1, max_length=MAX_IMAGE_SOURCE_CHARS)
    detail: Literal["auto", "low", "high"] | None = None


class ChatTextPart(StrictBody):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ChatImagePart(StrictBody):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(StrictBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ChatTextPart | ChatImagePart], Field(max_length=MAX_PARTS)] = Field(
        max_length=MAX_TEXT_CHARS)
    name: str | None = Field(None, max_length=256)


class StreamOptions(StrictBody):
    include_usage: bool = False


class _Sampling(StrictBody):
    """The fields chat and completions share."""

    model: str = Field(max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # SGLang's extension; -1 or 0: all tokens
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    user: str | None = Field(None, max_length=256)

    def params(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(max_tokens, self.temperature, self.top_p, max(self.top_k, 0), self.seed, stop)
        try:
            params.check()
        except ValueError as exc:
            raise BodyError(str(exc)) from None
        return params


class ChatIn(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_limit(self) -> ChatIn:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        images = sum(isinstance(p, ChatImagePart) for m in self.messages if isinstance(m.content, list)
                     for p in m.content)
        if images > MAX_IMAGES:
            raise ValueError(f"at most {MAX_IMAGES} images per request, got {images}")
        return self

    def for_template(self) -> tuple[list[dict], list[str]]:
        """Messages as the chat template takes them, and the image sources in order."""
        messages, images = [], []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            if isinstance(m.content, str):
                messages.append({"role": role, "content": m.content})
                continue
            parts = []
            for p in m.content:
                if isinstance(p, ChatTextPart):
                    parts.append({"type": "text", "text": p.text})
                else:
                    parts.append({"type": "image"})
                    images.append(p.image_url.url)
            messages.append({"role": role, "content": parts})
        return messages, images


class CompletionIn(_Sampling):
    prompt: str | list[str] = Field(min_length=1, max_length=MAX_TEXT_CHARS)
    max_tokens: int = Field(16, ge=1)  # OpenAI's default for completions

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionIn:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError("prompt: one prompt per request (a list of one string at most)")
        return self

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def error_body(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Under ``/v1/``: every error in OpenAI's shape (its status and headers kept)."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    try:
        return await handler(request)
    except HTTPError as exc:
        return web.json_response(error_body(exc.status, exc.message), status=exc.status, headers=exc.headers)
    except TransferFailure as exc:
        status = exc.kind.http_status
        return web.json_response(error_body(status, str(exc)), status=status, headers=exc.kind.headers())


def add_openai_routes(app: web.Application, service: GenerationService, start: StartGeneration,
                      model_name: str) -> None:
    created = int(time.time())

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "epd-resume",
             "max_model_len": service.model.max_length}]})

    async def chat(request: web.Request) -> web.StreamResponse:
        try:
            body: ChatIn = await asyncio.to_thread(parse, ChatIn, await request.read())  # up to 96 MiB
            params = body.params(body.max_completion_tokens or body.max_tokens or 128)
        except BodyError as exc:
            raise HTTPError(400, str(exc)) from None
        messages, images = body.for_template()
        text = await asyncio.to_thread(render_chat, service.tokenizer, messages)
        return await _complete(request, body, text, images, params, chat=True)

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body: CompletionIn = await asyncio.to_thread(parse, CompletionIn, await request.read())
            params = body.params(body.max_tokens)
        except BodyError as exc:
            raise HTTPError(400, str(exc)) from None
        if IMAGE_PLACEHOLDER in body.text:
            raise HTTPError(400, "prompt: /v1/completions takes text only; send images as image_url parts to "
                                 "/v1/chat/completions")
        return await _complete(request, body, body.text, [], params, chat=False)

    async def _complete(request: web.Request, body: _Sampling, text: str, images: list[str],
                        params: SamplingParams, chat: bool) -> web.StreamResponse:
        rid = uuid.uuid4().hex
        gen, _ = await start(rid, text, images, params)
        texts = TextStream(service.tokenizer, params.stop)
        head = {"id": ("chatcmpl-" if chat else "cmpl-") + rid,
                "object": "chat.completion.chunk" if chat and body.stream else "chat.completion" if chat
                else "text_completion", "created": int(time.time()), "model": body.model}
        try:
            if body.stream:
                return await _stream(request, gen, texts, head, chat,
                                     body.stream_options is not None and body.stream_options.include_usage)
            ids, event = [], None
            while event is None or event.finish_reason is None:
                event = await gen.events.get()
                ids += event.token_ids
            if event.finish_reason == "abort":  # not an OpenAI finish reason: the request failed
                raise HTTPError(500 if event.error else 503, event.error or "the request was aborted")
            answer = await asyncio.to_thread(lambda: (texts.push(ids, True), texts.answer())[1])
            choice = {"index": 0, "finish_reason": _finish(event), "logprobs": None}
            choice |= {"message": {"role": "assistant", "content": answer}} if chat else {"text": answer}
            return web.json_response(head | {"choices": [choice], "usage": _usage(gen, len(ids))})
        finally:  # ended, or the client went away: a no-op once it has ended
            service.abort(gen.rid, "the client went away")

    async def _stream(request: web.Request, gen: Generation, texts: TextStream, head: dict, chat: bool,
                      include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        first, count = True, 0
        try:
            while True:
                event = await gen.events.get()
                count += len(event.token_ids)
                piece = texts.push(event.token_ids, final=event.finish_reason is not None)
                if event.finish_reason == "abort":  # the request failed: an error, not a finish reason
                    await send(error_body(500 if event.error else 503, event.error or "the request was aborted"))
                    break
                if piece or first or event.finish_reason is not None:
                    delta = ({"role": "assistant", "content": piece} if first else {"content": piece}) if chat \
                        else {"text": piece}
                    choice = {"index": 0, "finish_reason": _finish(event) if event.finish_reason else None,
                              "logprobs": None}
                    await send(head | {"choices": [choice | ({"delta": delta} if chat else delta)]})
                    first = False
                if event.finish_reason is not None:
                    if include_usage:
                        await send(head | {"choices": [], "usage": _usage(gen, count)})
                    break
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:  # the client went away: the caller lets the engine go
            pass
        return response

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)


def _finish(event: Event) -> str:
    return event.finish_reason or "stop"


def _usage(gen: Generation, completion_tokens: int) -> dict:
    prompt = len(gen.request.prompt.input_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}
