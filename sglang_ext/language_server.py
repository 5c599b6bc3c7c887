"""``--disaggregation-mode language`` as SGLang's own server, fed by the resumable connector.

``python -m sglang.launch_server --disaggregation-mode language --encoder-urls ...`` (and
``--language-only``, and ``sglang serve``) starts SGLang's HTTP server, tokenizer manager,
scheduler and detokenizer on ``--model-path`` unchanged, in SGLang's language-only mode (no
vision tower loaded) with the ``zmq_to_tokenizer`` transfer backend. :func:`sglang_argv` turns
our mode into SGLang's flags (the plugin re-parses them, so SGLang validates its own
configuration); then four hooks on SGLang's ``TokenizerManager``, acting only in the process
where :func:`arm` was called (the one that runs it):

* around ``init_disaggregation``: SGLang's own set-up runs without its encoder side (no
  bootstrap registry, no upstream receiver), then its ``mm_receiver`` becomes ours
  (:class:`sglang_ext.mm_receiver.ResumableReceiver`): the connector's language worker (pool,
  Mooncake, ZMQ) and the encoder dispatch;
* after ``abort_request``: a request still waiting for its embedding is cancelled;
* around ``pause_generation`` / ``continue_generation``: the connector sleeps after SGLang
  pauses and wakes before it continues.

The connector's routes are added to SGLang's app beside its own: ``/sleep`` and ``/wake_up``
(the connector's transfers) and ``/epd/health`` and ``/epd/metrics`` (rooms, pool, parts).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from fastapi import Request  # SGLang's server is FastAPI; this module runs only where it is installed

if TYPE_CHECKING:
    from language_side.worker import LanguageWorker

log = logging.getLogger(__name__)

# Our mode's flags that SGLang's language-only mode is given instead.
OUR_MODE_FLAGS = ("--disaggregation-mode", "--language-only", "--encoder-transfer-backend")
SGLANG_FLAGS = ("--language-only", "--encoder-transfer-backend", "zmq_to_tokenizer")

_pending: argparse.Namespace | None = None  # our flags, until this process's tokenizer manager starts
_connector: LanguageWorker | None = None  # the connector's language worker, once started here
_last_sleep: dict = {}  # what the connector reported of its last sleep (our /sleep answers it)


def sglang_argv(argv: list[str]) -> list[str]:
    """``argv`` with our language mode written as SGLang's language-only mode; on a CPU device,
    SGLang's portable attention backend unless one is named."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in OUR_MODE_FLAGS:
            skip = "=" not in arg and name != "--language-only"
            continue
        out.append(arg)
    out += SGLANG_FLAGS
    device = _flag_value(argv, "--device")
    if (device or "cpu") == "cpu" and _flag_value(argv, "--attention-backend") is None:
        out += ["--attention-backend", "torch_native"]
    if device is None:
        out += ["--device", "cpu"] if not _has_gpu() else []
    return out


def arm(ours: argparse.Namespace) -> None:
    """Our flags, for the tokenizer manager this process is about to start."""
    global _pending
    _pending = ours


def around_init_disaggregation(original, manager, *args, **kwargs):
    if _pending is None:  # another mode, or another process
        return original(manager, *args, **kwargs)
    from sglang.srt.runtime_context import get_disagg

    with get_disagg().override(language_only=False):  # SGLang's part without its encoder side
        result = original(manager, *args, **kwargs)
    manager.mm_receiver = _start_receiver(_pending, manager)
    return result


async def around_pause_generation(original, manager, obj, *args, **kwargs):
    """SGLang pauses first (no token after this), then the connector sleeps: its transfers are
    kept unless the pause aborts everything (``mode="abort"``), and its pool is released."""
    result = await original(manager, obj, *args, **kwargs)
    if _connector is not None:
        _last_sleep.clear()
        _last_sleep.update(await asyncio.to_thread(_connector.sleep, 1, obj.mode != "abort"))
    return result


async def around_continue_generation(original, manager, obj, *args, **kwargs):
    """The connector wakes first (its pool back, kept transfers resumed), then SGLang continues."""
    if _connector is not None:
        await asyncio.to_thread(_connector.wake_up)
    return await original(manager, obj, *args, **kwargs)


def after_abort_request(result, manager, rid: str = "", *args, **kwargs):
    receiver = getattr(manager, "mm_receiver", None)
    if rid and hasattr(receiver, "abort"):
        receiver.abort(rid)
    return result


def _start_receiver(ours: argparse.Namespace, manager):
    from language_side.consumers import EmbeddingCopy
    from language_side.dispatch import EncoderDispatch
    from language_side.embedding_cache import EmbeddingCache
    from language_side.worker import LanguageWorker
    from sglang_ext.args import connector_config
    from sglang_ext.mm_receiver import ResumableReceiver

    global _connector
    config = connector_config(ours)
    worker = _connector = LanguageWorker(config, checkpoint_dir=ours.checkpoint_dir, consumer=EmbeddingCopy(),
                                         queue_while_sleeping=ours.queue_while_sleeping)
    dispatch = EncoderDispatch(ours.encoder_urls or [], worker, EmbeddingCache(ours.image_embedding_cache_bytes))
    _add_routes(manager, worker, dispatch)
    log.info("epd-resume: SGLang's server is the language worker; embeddings arrive through the resumable connector "
             "(zmq=tcp://%s:%d mooncake=%s pool=%dx%d tokens, encoders=%s)", config.host, worker.receivers.rank_port,
             worker.transport.session_id, config.num_blocks, config.block_size, ",".join(ours.encoder_urls or []))
    return ResumableReceiver(dispatch, manager.model_config.dtype)


def _add_routes(manager, worker, dispatch) -> None:
    """Our sleep routes and the connector's state on SGLang's FastAPI app, with the same
    parameters and errors as our own workers' (``connector.http_util``).

    ``/sleep?level=1|2&preserve_state=...`` is SGLang's ``pause_generation``, which the hook above
    extends to the connector: level 1 pauses ``in_place`` (running requests keep their KV and go on
    exactly where they stood), level 2 ``retract``s them (KV freed, recomputed from prompt and
    tokens on continue) and releases SGLang's memory occupation (KV cache and weights where its
    memory saver can; on CPU its cache is flushed); ``preserve_state=false`` aborts every request
    (``abort``). ``/wake_up`` is the reverse."""
    from fastapi.responses import ORJSONResponse, Response
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        PauseGenerationReqInput,
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
    )

    from connector.checkpoint import CheckpointError
    from connector.failures import TransferFailure
    from connector.http_util import HTTPError, error_body, error_reply, sleep_params

    released = False  # SGLang's memory occupation, by a level-2 sleep

    def refused(exc: Exception) -> ORJSONResponse:
        status, message, headers, kind = error_reply(exc)
        return ORJSONResponse(error_body(status, message, kind), status_code=status, headers=headers)

    async def sleep(request: Request):
        nonlocal released
        try:
            level, preserve = sleep_params(request.query_params)
        except HTTPError as exc:
            return refused(exc)
        if worker.is_sleeping():
            return ORJSONResponse({"changed": False, "is_sleeping": True})
        try:
            mode = ("in_place" if level == 1 else "retract") if preserve else "abort"
            await manager.pause_generation(PauseGenerationReqInput(mode=mode))
        except (HTTPError, TransferFailure, CheckpointError) as exc:  # the connector stayed awake
            await manager.continue_generation(ContinueGenerationReqInput())
            return refused(exc)
        if level == 2 and not released:
            await manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
            released = True
        return ORJSONResponse(dict(_last_sleep) | {"level": level})

    async def wake_up(request: Request):
        nonlocal released
        if released:
            await manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)
            released = False
        try:
            await manager.continue_generation(ContinueGenerationReqInput())
        except (HTTPError, TransferFailure, CheckpointError) as exc:
            return refused(exc)
        return ORJSONResponse({"changed": True, "is_sleeping": worker.is_sleeping()})

    async def health():
        return ORJSONResponse(worker.health())

    async def metrics():
        return Response(worker.metrics.render() + dispatch.render_metrics(), media_type="text/plain")

    app.add_api_route("/sleep", sleep, methods=["POST"])
    app.add_api_route("/wake_up", wake_up, methods=["POST"])
    app.add_api_route("/epd/health", health, methods=["GET"])
    app.add_api_route("/epd/metrics", metrics, methods=["GET"])


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
