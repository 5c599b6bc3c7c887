"""Encode worker HTTP API: ``POST /encode``, ``GET /health``, ``GET /metrics``, sleep and wake."""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import Field

from embedding_side.worker import EncodeWorker
from worker_infra.embedding_store import MAX_CACHE_SALT_CHARS
from worker_infra.http import JSON, StrictBody, check_room, read_body, worker_app

# A body holds its images as data: URIs: room for what a language server takes in one request
# (its --max-request-body-bytes, 64 MiB by default) and the JSON around it
MAX_BODY_BYTES = 96 << 20


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
    # SGLang's field: entries of the cluster's cache are kept apart per salt (a tenant's own)
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)


def build_app(worker: EncodeWorker, admin_api_key: str | None = None) -> FastAPI:
    async def encode(request: Request) -> JSON:
        body = await read_body(request, EncodeIn)
        room = check_room(body.bootstrap_room)
        return JSON(await worker.encode(body.rid, room, body.images, body.wait_for_delivery, body.videos,
                                        body.audios, body.cache_salt))

    app = worker_app(worker, MAX_BODY_BYTES, admin_api_key)
    app.add_api_route("/encode", encode, methods=["POST"])
    return app
