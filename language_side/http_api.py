"""Language worker HTTP API: ``POST /generate``, ``POST /abort_request``, ``GET /health``,
``GET /metrics``, sleep and wake, and the OpenAI-compatible routes (``openai_api.py``).

With a language model, ``/generate`` takes SGLang's native body (``text`` or ``messages``,
``sampling_params``, ``stream``, and either the encoder's ``bootstrap_*`` when the prompt has
images, or ``image_data`` that this worker sends to its ``--encoder-urls`` itself): the
embedding is received, the prompt built around it, and the engine generates. Without one
(``--language-model none``) it receives the embedding and answers its digest.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

from aiohttp import web
from pydantic import ConfigDict

from connector.failures import FailureKind, TransferFailure
from language_side.dispatch import EncoderDispatch, ImageRefused
from language_side.engine import SamplingParams
from language_side.openai_api import add_openai_routes, openai_errors
from language_side.prompt import PromptError, build_prompt, grids_from_positions, render_chat
from language_side.schemas import BodyError, GenerateIn, parse
from language_side.serving import Event, Generation, GenerationService, TextStream
from language_side.worker import LanguageWorker
from worker_infra.http import (
    BootstrapAllowList,
    HTTPError,
    StrictBody,
    add_sleep_routes,
    check_host,
    check_room,
    errors_as_json,
    read_body,
    wait_for_future,
)

IMAGE_PAD = "<|image_pad|>"
MAX_BODY_BYTES = 96 << 20  # data: URIs of large images (each image's own bound is in the schemas)


@dataclass
class _Client:
    """A ``/generate`` in progress, so ``/abort_request`` can reach it between its phases."""

    aborted: bool = False
    encoding: asyncio.Task | None = None  # its images at its encoders (--encoder-urls)


class TransferIn(StrictBody):
    """``POST /generate`` of a transfer-only worker: receive one room's embedding."""

    rid: str
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


class AbortIn(StrictBody):
    """``POST /abort_request``; SGLang's other fields (``abort_all``, ...) are let through and unused."""

    model_config = ConfigDict(extra="ignore", strict=True)
    rid: str


def build_app(worker: LanguageWorker, allowed: BootstrapAllowList, service: GenerationService | None = None,
              dispatch: EncoderDispatch | None = None, model_name: str = "",
              admin_api_key: str | None = None) -> web.Application:
    """``allowed``: the encoders a request may name by bootstrap address; ``dispatch``: the
    encoders of ``--encoder-urls`` (images named in a request); with a ``service``, the
    OpenAI-compatible routes serve ``model_name`` too; ``admin_api_key`` guards sleep and wake."""
    clients: dict[str, _Client] = {}

    async def transfer_only(request: web.Request) -> web.Response:
        body = await read_body(request, TransferIn)
        room, port, rid = check_room(body.bootstrap_room), body.bootstrap_port, body.rid
        if not 0 < port < 65536:
            raise HTTPError(400, "bootstrap_port must be in 1..65535")
        host = check_host(body.bootstrap_host)
        allowed.check(host, port)
        future = worker.submit(rid, f"{host}:{port}", room)
        return web.json_response(await wait_for_future(future, lambda: worker.cancel(rid, "the client went away")))

    async def generate(request: web.Request) -> web.StreamResponse:
        assert service is not None
        arrived = time.monotonic()
        try:
            body: GenerateIn = await asyncio.to_thread(parse, GenerateIn, await request.read())  # up to 96 MiB
            params = body.sampling_params.params()
        except BodyError as exc:
            raise HTTPError(400, str(exc)) from None
        rid = body.rid or uuid.uuid4().hex
        if rid in clients:
            raise HTTPError(409, f"request {rid!r} is already in progress")
        client = clients[rid] = _Client()
        try:
            return await _generate(request, body, params, rid, client, arrived)
        finally:
            clients.pop(rid, None)

    async def _generate(request: web.Request, body: GenerateIn, params, rid: str, client: _Client,
                        arrived: float) -> web.StreamResponse:
        assert service is not None
        if body.rid is not None and (restored := service.claim(rid)) is not None:
            # restored from a disk checkpoint after a restart: its whole output, then the rest
            return await _answer(request, restored, body.stream, {}, arrived)
        text = body.text if body.text is not None else await asyncio.to_thread(
            render_chat, service.tokenizer, [m.for_template() for m in body.messages or []])
        if body.image_data is not None:  # this worker asks its encoders
            gen, transfer = await _start(rid, client, text, body.images, params)
            return await _answer(request, gen, body.stream, transfer, arrived)
        images = text.count(IMAGE_PAD)
        addr = ""
        if body.has_peer:
            host = check_host(body.bootstrap_host)
            allowed.check(host, body.bootstrap_port)
            addr = f"{host}:{body.bootstrap_port}"
        if images and not body.has_peer:
            raise HTTPError(400, f"the prompt has {images} image placeholders but no bootstrap_room names the "
                                 f"encoder that holds their embedding")
        if body.has_peer and not images:
            worker.receivers.abandon(addr, body.bootstrap_room)  # the encoder's room ends too
            raise HTTPError(400, "bootstrap_room names an image embedding but the prompt has no image placeholder "
                                 "(<|vision_start|><|image_pad|><|vision_end|> or an image part)")
        transfer: dict = {}
        rows, grids = None, []
        try:
            service.check_room_for(rid)  # before the embedding is fetched for nothing
        except TransferFailure:
            if body.has_peer:
                worker.receivers.abandon(addr, body.bootstrap_room)
            raise
        if body.has_peer:
            future = worker.submit(rid, addr, body.bootstrap_room)
            transfer = await wait_for_future(future, lambda: worker.cancel(rid, "the client went away"))
            rows, positions = transfer.pop("embedding"), transfer.pop("mrope_positions")
            try:
                grids = grids_from_positions(positions)
            except PromptError as exc:
                raise HTTPError(400, f"the embedding from {addr} cannot be placed: {exc}") from None
        gen = await _submit(rid, client, text, rows, grids, params)
        return await _answer(request, gen, body.stream, transfer, arrived)

    async def _start(rid: str, client: _Client, text: str, images: list[str],
                     params: SamplingParams) -> tuple[Generation, dict]:
        """A prompt whose images (sources, in placeholder order) this worker sends to its
        encoders: received, then generating; the generation and the transfer's fields."""
        assert service is not None
        if (placeholders := text.count(IMAGE_PAD)) != len(images):
            raise HTTPError(400, f"the prompt has {placeholders} image placeholders and {len(images)} images")
        if not images:
            return await _submit(rid, client, text, None, [], params), {}
        if dispatch is None:
            raise HTTPError(400, "this language worker has no --encoder-urls: send the images to an encode worker "
                                 "and name its bootstrap_room in /generate (the two-request flow)")
        service.check_room_for(rid)  # before the images are encoded for nothing
        await worker.gate.wait_awake()  # 503 while asleep, or wait with --queue-while-sleeping
        client.encoding = asyncio.ensure_future(dispatch.embed(rid, images))
        try:
            embedded = await client.encoding
        except ImageRefused as exc:
            raise HTTPError(exc.status, str(exc)) from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this handler is cancelled: the client went away
                raise
            raise TransferFailure(FailureKind.CANCELLED, f"request {rid}: aborted by /abort_request") from None
        finally:
            client.encoding = None
        return await _submit(rid, client, text, embedded.rows, embedded.grids, params), embedded.meta

    async def _submit(rid: str, client: _Client, text: str, rows, grids: list, params: SamplingParams) -> Generation:
        """The prompt around the received embedding (``rows`` None: text only), to the engine."""
        assert service is not None
        if client.aborted:
            raise TransferFailure(FailureKind.CANCELLED, f"request {rid}: aborted by /abort_request")
        try:
            prompt = await asyncio.to_thread(build_prompt, service.tokenizer, text, grids, service.model.max_length)
        except ValueError as exc:  # PromptError: counts, context length
            raise HTTPError(400, str(exc)) from None
        if rows is not None:  # admitted before a sleep, which kept its transfer: it goes on after the wake-up
            deadline = time.monotonic() + worker.gate.max_wait
            while worker.gate.is_sleeping():
                if client.aborted or time.monotonic() > deadline:
                    raise TransferFailure(FailureKind.CANCELLED if client.aborted else FailureKind.ASLEEP,
                                          f"request {rid}: " + ("aborted by /abort_request" if client.aborted else
                                                                "the language worker slept longer than --max-sleep"))
                await asyncio.sleep(0.05)
        else:
            await worker.gate.wait_awake()  # 503 while asleep, or wait with --queue-while-sleeping
        try:
            gen = service.submit(rid, prompt, rows, params, admit=worker.gate.require_awake)
        except ValueError as exc:  # over the KV budget
            raise HTTPError(400, str(exc)) from None
        del rows  # the engine holds the embedding now
        if client.aborted:  # /abort_request came while the prompt was built
            service.abort(rid, "aborted by /abort_request")
        return gen

    async def _answer(request: web.Request, gen: Generation, stream: bool, transfer: dict,
                      arrived: float) -> web.StreamResponse:
        """The generation's events as one reply, or as a stream."""
        assert service is not None
        texts = TextStream(service.tokenizer, gen.request.params.stop)
        try:
            if stream:
                return await _stream(request, gen, texts, transfer, arrived)
            ids, event = [], None
            while event is None or event.finish_reason is None:
                event = await gen.events.get()
                ids += event.token_ids
            await asyncio.to_thread(texts.push, ids, True)
            return web.json_response({"rid": gen.rid, "text": texts.answer(), "output_ids": ids, **transfer,
                                      "meta_info": _meta(gen, ids, event, transfer, arrived)})
        finally:  # ended, or the client went away (cancelled, reset): a no-op once it has ended
            service.abort(gen.rid, "the client went away")

    async def _stream(request: web.Request, gen: Generation, texts: TextStream, transfer: dict,
                      arrived: float) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        ids: list[int] = []
        while True:
            event = await gen.events.get()
            ids += event.token_ids
            chunk = {"rid": gen.rid, "text": texts.push(event.token_ids, final=event.finish_reason is not None),
                     "output_ids": event.token_ids}
            if event.finish_reason is not None:
                meta = _meta(gen, ids, event, transfer, arrived)
                chunk |= {"finish_reason": meta["finish_reason"], "meta_info": meta, **transfer,
                          "usage": {"prompt_tokens": meta["prompt_tokens"], "completion_tokens": len(ids),
                                    "total_tokens": meta["prompt_tokens"] + len(ids)}}
            try:
                await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if event.finish_reason is not None:
                    await response.write(b"data: [DONE]\n\n")
                    await response.write_eof()
                    return response
            except ConnectionResetError:  # the client went away: the caller lets the engine go
                return response

    def _meta(gen: Generation, ids: list[int], last: Event, transfer: dict, arrived: float) -> dict:
        finish = {"type": last.finish_reason} | ({"length": len(ids)} if last.finish_reason == "length" else {}) | (
            {"message": last.error} if last.error else {})
        engine = gen.timings()
        return {"id": gen.rid, "prompt_tokens": len(gen.request.prompt.input_ids),
                "image_tokens": gen.request.prompt.image_tokens, "completion_tokens": len(ids),
                "finish_reason": finish, "e2e_latency": round(time.monotonic() - arrived, 6),
                "queue_ms": transfer.get("queue_ms", 0.0), "encoder_wait_ms": transfer.get("encoder_wait_ms", 0.0),
                "transfer_ms": transfer.get("transfer_ms", 0.0),
                "resume_rounds": transfer.get("resume_rounds", 0), "kv_wait_ms": engine["kv_wait_ms"],
                "prefill_ms": engine["prefill_ms"], "decode_ms": engine["decode_ms"],
                "first_token_ms": round((gen.first_token_at - arrived) * 1e3, 3) if gen.first_token_at else None}

    async def abort_request(request: web.Request) -> web.Response:
        rid = (await read_body(request, AbortIn)).rid
        client = clients.get(rid)
        if client is not None:
            client.aborted = True
            if client.encoding is not None:
                client.encoding.cancel()  # each part's room is aborted, so its encoder is told
        aborted = worker.cancel(rid, "aborted by /abort_request")
        if service is not None:
            aborted = service.abort(rid, "aborted by /abort_request") or aborted
        return web.json_response({"rid": rid, "aborted": aborted or client is not None})

    async def health(_request: web.Request) -> web.Response:
        extra = {"generating": service.active()} if service is not None else {}
        return web.json_response(worker.health() | extra)

    async def metrics(_request: web.Request) -> web.Response:
        extra = service.render_metrics() if service is not None else b""
        extra += dispatch.render_metrics() if dispatch is not None else b""
        return web.Response(body=worker.metrics.render() + extra, content_type="text/plain")

    app = web.Application(middlewares=[errors_as_json, openai_errors], client_max_size=MAX_BODY_BYTES)
    if dispatch is not None:
        app.on_cleanup.append(lambda _app: dispatch.close())
    if service is not None:
        add_openai_routes(app, service, lambda rid, text, images, params: _start(rid, _Client(), text, images, params),
                          model_name)
    app.router.add_post("/generate", generate if service is not None else transfer_only)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_sleep_routes(app, worker, admin_api_key)
    return app
