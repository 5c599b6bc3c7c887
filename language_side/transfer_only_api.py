"""The transfer-only receiver's HTTP API: ``POST /generate`` receives one room's embedding and
answers its digest; ``POST /abort_request``, ``GET /health``, ``GET /metrics``, sleep and wake.

This is not a language server (SGLang's is: ``--disaggregation-mode language --model-path``).
It is the connector's language side alone, started by ``--disaggregation-mode language``
without a checkpoint: what ``scripts/transfer_large_image.py``, the reference fork's wire tests
and the connector's process tests drive.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import ConfigDict

from connector import FailureKind
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


class TransferIn(StrictBody):
    """``POST /generate``: receive one room's embedding from the encoder it names."""

    rid: str
    bootstrap_host: str
    bootstrap_port: int
    bootstrap_room: int


class AbortIn(StrictBody):
    """``POST /abort_request``; SGLang's other fields (``abort_all``, ...) are let through and unused."""

    model_config = ConfigDict(extra="ignore", strict=True)
    rid: str


def build_app(worker: LanguageWorker, allowed: BootstrapAllowList, admin_api_key: str | None = None) -> web.Application:
    """``allowed``: the encoders a request may name by bootstrap address; ``admin_api_key`` guards
    sleep and wake."""

    async def receive(request: web.Request) -> web.Response:
        body = await read_body(request, TransferIn)
        room, port, rid = check_room(body.bootstrap_room), body.bootstrap_port, body.rid
        if not 0 < port < 65536:
            raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_port must be in 1..65535")
        host = check_host(body.bootstrap_host)
        allowed.check(host, port)
        future = worker.submit(rid, f"{host}:{port}", room, named_by_client=True)
        return web.json_response(await wait_for_future(future, lambda: worker.cancel(rid, "the client went away")))

    async def abort_request(request: web.Request) -> web.Response:
        rid = (await read_body(request, AbortIn)).rid
        return web.json_response({"rid": rid, "aborted": worker.cancel(rid, "aborted by /abort_request")})

    async def health(_request: web.Request) -> web.Response:
        return web.json_response(worker.health())

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=worker.metrics.render(), content_type="text/plain")

    app = web.Application(middlewares=[errors_as_json])
    app.router.add_post("/generate", receive)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    add_sleep_routes(app, worker, admin_api_key)
    return app
