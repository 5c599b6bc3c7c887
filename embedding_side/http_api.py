"""Encode worker HTTP API: ``POST /encode``, ``GET /health``, ``GET /metrics``."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from connector.http_util import HTTPError, add_sleep_routes, check_room, errors_as_json, read_json
from embedding_side.worker import EncodeWorker


def build_app(worker: EncodeWorker) -> web.Application:
    executor = ThreadPoolExecutor(4, thread_name_prefix="encode-request")

    async def encode(request: web.Request) -> web.Response:
        body = await read_json(request, {"rid": str, "bootstrap_room": int, "images": list})
        room = check_room(body["bootstrap_room"])
        if not all(isinstance(ref, str) for ref in body["images"]):
            raise HTTPError(400, "images must be strings (path, file://, http(s):// or data: URI)")
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(executor, worker.encode, body["rid"], room, body["images"])
        return web.json_response(result)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response(worker.health())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=worker.metrics.render(), content_type="text/plain")

    app = web.Application(middlewares=[errors_as_json], client_max_size=96 << 20)
    app.router.add_post("/encode", encode)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_sleep_routes(app, worker)
    app.on_cleanup.append(lambda _app: asyncio.to_thread(executor.shutdown, True))
    return app
