"""The transfer-only receiver's HTTP API: ``POST /generate`` receives one room's embedding and
answers its digest; ``POST /abort_request``, ``GET /health``, ``GET /metrics``, sleep and wake.

This is not a language server (SGLang's is: ``--disaggregation-mode language --model-path``).
It is the connector's language side alone, started by ``--disaggregation-mode language``
without a checkpoint: what ``scripts/transfer_large_image.py``, the reference fork's wire tests
and the connector's process tests drive.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import ConfigDict

from connector import FailureKind
from language_side.worker import LanguageWorker
from worker_infra.futures import wait_for_future
from worker_infra.http import JSON, HTTPError, StrictBody, check_room, read_body, worker_app
from worker_infra.trust import BootstrapAllowList, check_host

MAX_BODY_BYTES = 1 << 20  # a rid, a bootstrap address and a room


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


def build_app(worker: LanguageWorker, allowed: BootstrapAllowList, admin_api_key: str | None = None) -> FastAPI:
    """``allowed``: the encoders a request may name by bootstrap address; ``admin_api_key`` guards
    sleep and wake."""

    async def receive(request: Request) -> JSON:
        body = await read_body(request, TransferIn)
        room, port, rid = check_room(body.bootstrap_room), body.bootstrap_port, body.rid
        if not 0 < port < 65536:
            raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_port must be in 1..65535")
        host = check_host(body.bootstrap_host)
        allowed.check(host, port)
        future = worker.submit(rid, f"{host}:{port}", room, named_by_client=True)
        return JSON(await wait_for_future(future, lambda: worker.cancel(rid, "the client went away")))

    async def abort_request(request: Request) -> JSON:
        rid = (await read_body(request, AbortIn)).rid
        return JSON({"rid": rid, "aborted": worker.cancel(rid, "aborted by /abort_request")})

    app = worker_app(worker, MAX_BODY_BYTES, admin_api_key)
    app.add_api_route("/generate", receive, methods=["POST"])
    app.add_api_route("/abort_request", abort_request, methods=["POST"])
    return app
