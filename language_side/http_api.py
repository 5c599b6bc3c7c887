"""Language worker HTTP API: ``POST /generate``, ``POST /abort_request``, ``GET /health``,
``GET /metrics``, sleep and wake."""

from __future__ import annotations

from aiohttp import web

from connector.http_util import (
    HTTPError,
    add_sleep_routes,
    check_host,
    check_room,
    errors_as_json,
    read_json,
    wait_for_future,
)
from language_side.worker import LanguageWorker


def build_app(worker: LanguageWorker) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = await read_json(request, {"rid": str, "bootstrap_host": str, "bootstrap_port": int,
                                         "bootstrap_room": int})
        room = check_room(body["bootstrap_room"])
        port = body["bootstrap_port"]
        if not 0 < port < 65536:
            raise HTTPError(400, "bootstrap_port must be in 1..65535")
        rid = body["rid"]
        future = worker.submit(rid, f"{check_host(body['bootstrap_host'])}:{port}", room)
        return web.json_response(await wait_for_future(future, lambda: worker.cancel(rid, "the client went away")))

    async def abort_request(request: web.Request) -> web.Response:
        body = await read_json(request, {"rid": str})
        return web.json_response({"rid": body["rid"], "aborted": worker.cancel(body["rid"], "aborted by /abort_request")})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response(worker.health())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=worker.metrics.render(), content_type="text/plain")

    app = web.Application(middlewares=[errors_as_json])
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_sleep_routes(app, worker)
    return app
