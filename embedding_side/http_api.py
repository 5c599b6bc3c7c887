"""Encode worker HTTP API: ``POST /encode``, ``GET /health``, ``GET /metrics``, sleep and wake."""

from __future__ import annotations

from aiohttp import web

from embedding_side.worker import EncodeWorker
from worker_infra.http import StrictBody, add_sleep_routes, check_room, errors_as_json, read_body


class EncodeIn(StrictBody):
    """``POST /encode``: images, or videos, or audio clips (an encoder whose /health lists that
    modality); the worker checks them itself (and fails the room if they are bad)."""

    rid: str
    bootstrap_room: int
    images: list = []
    videos: list = []
    audios: list = []
    wait_for_delivery: bool = True
    text: str | None = None  # the prompt, sent along by some routers; not used here


def build_app(worker: EncodeWorker, admin_api_key: str | None = None) -> web.Application:
    async def encode(request: web.Request) -> web.Response:
        body = await read_body(request, EncodeIn)
        room = check_room(body.bootstrap_room)
        return web.json_response(await worker.encode(body.rid, room, body.images, body.wait_for_delivery,
                                                    body.videos, body.audios))

    async def health(_request: web.Request) -> web.Response:
        return web.json_response(worker.health())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=worker.metrics.render(), content_type="text/plain")

    app = web.Application(middlewares=[errors_as_json], client_max_size=96 << 20)
    app.router.add_post("/encode", encode)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_sleep_routes(app, worker, admin_api_key)
    return app
