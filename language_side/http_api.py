"""Language worker HTTP API: ``POST /generate``, ``GET /health``, ``GET /metrics``."""

from __future__ import annotations

import asyncio

from aiohttp import web

from connector.http_util import HTTPError, add_sleep_routes, check_room, errors_as_json, read_json
from language_side.worker import LanguageWorker


def build_app(worker: LanguageWorker) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await read_json(request, {"rid": str, "bootstrap_host": str, "bootstrap_port": int,
                                         "bootstrap_room": int})
        room = check_room(body["bootstrap_room"])
        port = body["bootstrap_port"]
        if not 0 < port < 65536:
            raise HTTPError(400, "bootstrap_port must be in 1..65535")
        future = worker.submit(body["rid"], f"{body['bootstrap_host']}:{port}", room)
        return web.json_response(await asyncio.wrap_future(future))

    async def health(_request: web.Request) -> web.Response:
        return web.json_response(worker.health())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=worker.metrics.render(), content_type="text/plain")

    app = web.Application(middlewares=[errors_as_json])
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_sleep_routes(app, worker)
    return app
