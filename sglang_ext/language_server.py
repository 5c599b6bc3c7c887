"""``--disaggregation-mode language`` as SGLang's own server, fed by the resumable connector.

``python -m sglang.launch_server --disaggregation-mode language --encoder-urls ...`` (and
``--language-only``, and ``sglang serve``) starts SGLang's HTTP server, tokenizer manager,
scheduler and detokenizer on ``--model-path`` unchanged, in SGLang's language-only mode (no
vision tower loaded) with the ``zmq_to_tokenizer`` transfer backend. :func:`sglang_argv` turns
our mode into SGLang's flags (the plugin re-parses them, so SGLang validates its own
configuration); then five hooks on SGLang's ``TokenizerManager``, acting only in the process
where :func:`arm` was called (the one that runs it):

* around ``init_disaggregation``: SGLang's own set-up runs without its encoder side (no
  bootstrap registry, no upstream receiver), then its ``mm_receiver`` becomes ours
  (:class:`sglang_ext.mm_receiver.ResumableReceiver`): the connector's language worker (pool,
  Mooncake, ZMQ) and the encoder dispatch;
* around ``generate_request``: a client asking again for a generation restored from disk gets
  its whole output (:mod:`sglang_ext.generations`); while the connector sleeps a new request
  gets 503 at once; every other response gets its image transfer (``resume_rounds``, timings)
  in ``meta_info``;
* around ``abort_request``: a request still waiting for its embedding is cancelled;
* around ``pause_generation`` / ``continue_generation``: the connector sleeps after SGLang
  pauses (and, with ``--checkpoint-dir``, SGLang's unfinished generations are written beside its
  checkpoint) and wakes before SGLang continues (a server started on such a checkpoint then
  submits the generations again).

A 429 or 503 gets ``Retry-After`` (:class:`RetryAfter`). The connector's routes are added to
SGLang's app beside its own: ``/sleep`` and ``/wake_up``, ``/epd/health`` (rooms, pool, parts)
and ``/metrics`` (SGLang's metrics and the connector's ``epd_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import signal
from typing import TYPE_CHECKING

from fastapi import Request  # SGLang's server is FastAPI; this module runs only where it is installed

from connector.failures import FailureKind, TransferFailure
from worker_infra.http import HTTPError, asleep_error, error_body, error_reply, sleep_params

if TYPE_CHECKING:
    from language_side.worker import LanguageWorker
    from sglang_ext.generations import Restored
    from sglang_ext.mm_receiver import ResumableReceiver

log = logging.getLogger(__name__)

# Our mode's flags that SGLang's language-only mode is given instead.
OUR_MODE_FLAGS = ("--disaggregation-mode", "--language-only", "--encoder-transfer-backend")
SGLANG_FLAGS = ("--language-only", "--encoder-transfer-backend", "zmq_to_tokenizer")

_pending: argparse.Namespace | None = None  # our flags, until this process's tokenizer manager starts


@dataclasses.dataclass
class Connected:
    """What runs beside SGLang in this process once its tokenizer manager has started."""

    ours: argparse.Namespace
    worker: LanguageWorker  # the connector's language side
    receiver: ResumableReceiver
    # started on a disk checkpoint of SGLang's generations: the first wake-up submits them again
    restore_on_wake: bool
    restored: Restored | None = None
    last_sleep: dict = dataclasses.field(default_factory=dict)  # the connector's report of its last sleep

    def geometry(self, manager) -> dict:
        """What a checkpoint of SGLang's generations must match to be loaded here."""
        return {"hidden_size": self.worker.config.hidden_size, "vocab_size": manager.model_config.vocab_size}


_here: Connected | None = None


def sglang_argv(argv: list[str]) -> list[str]:
    """``argv`` with our language mode written as SGLang's language-only mode; on a CPU device,
    SGLang's portable attention backend unless one is named, and the scheduling flags of
    :func:`_cpu_scheduling`."""
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
        device = "cuda" if _has_gpu() else "cpu"
        out += ["--device", "cpu"] if device == "cpu" else []
    if device == "cpu":
        out += _cpu_scheduling(argv)
    return out


def _cpu_scheduling(argv: list[str]) -> list[str]:
    """SGLang's scheduling flags for a CPU (docs/scheduling.md), each unless the command line
    names it: the scheduler sleeps while idle (else it busy-polls a whole core, one the encoders
    on the same host need while it waits for their embeddings), and running requests decode
    within every prefill chunk (else each of them waits out every chunk of a long prompt, and
    every answer waits for the last prefill)."""
    return [flag for flag in ("--sleep-on-idle", "--enable-mixed-chunk") if flag not in argv]


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
    kept unless the pause aborts everything (``mode="abort"``), and its pool is released; with
    ``--checkpoint-dir``, SGLang's unfinished generations are written beside its checkpoint."""
    result = await original(manager, obj, *args, **kwargs)
    if _here is None:
        return result
    preserve = obj.mode != "abort"
    report = await asyncio.to_thread(_here.worker.sleep, 1, preserve)
    if preserve and _here.ours.checkpoint_dir and report.get("changed"):
        report |= await _write_generations(manager)
    _here.last_sleep = report
    return result


async def _write_generations(manager) -> dict:
    from connector.checkpoint import save_or_explain
    from sglang_ext import generations

    saved = generations.snapshot(manager, _here.receiver)
    written, why = await asyncio.to_thread(save_or_explain, _here.ours.checkpoint_dir, lambda: generations.save(
        _here.ours.checkpoint_dir, saved, _here.geometry(manager)))
    if written is None:
        return {"generations_checkpoint_error": why}
    log.info("%d unfinished generations written to %s (%d bytes): %s", len(saved), _here.ours.checkpoint_dir, written,
             ", ".join(f"{g.rid} ({len(g.output_ids)} ids{', embedded' if g.rows is not None else ''})"
                       for g in saved))
    return {"checkpointed_generations": len(saved), "generations_checkpoint_bytes": written}


async def around_continue_generation(original, manager, obj, *args, **kwargs):
    """The connector wakes first (its pool back, kept transfers resumed), then SGLang continues;
    a server started on a disk checkpoint of SGLang's generations then submits them again (read
    and checked before anything wakes: a bad file leaves everything asleep, 422). That file is
    gone after a wake-up: SGLang goes on with its own requests."""
    if _here is None:
        return await original(manager, obj, *args, **kwargs)
    from connector import checkpoint
    from sglang_ext import generations

    folder = _here.ours.checkpoint_dir
    saved = None
    if _here.restore_on_wake and checkpoint.exists(folder, generations.ROLE):
        saved = await asyncio.to_thread(generations.load, folder, _here.geometry(manager))  # CheckpointError
    await asyncio.to_thread(_here.worker.wake_up)
    result = await original(manager, obj, *args, **kwargs)
    if saved is not None:
        _here.restored = generations.Restored(manager, _here.receiver)
        _here.restored.start(saved)
    _here.restore_on_wake = False
    if folder:
        checkpoint.remove(folder, generations.ROLE)
    return result


def around_generate_request(original, manager, obj, *args, **kwargs):
    """A client asking again for a generation restored from disk gets its whole output; while the
    connector sleeps, a new request is refused at once (503, ``Retry-After``) instead of waiting
    in SGLang's pause without a bound (with ``--queue-while-sleeping`` it waits); every other
    request is SGLang's, with its image transfer in ``meta_info``."""
    if _here is None:
        return original(manager, obj, *args, **kwargs)
    if _here.restored is not None and _here.restored.claims(obj):
        return _here.restored.answer(obj.rid)
    if _here.worker.is_sleeping() and not _here.worker.gate.queue_while_sleeping:
        return _refused(asleep_error("language"))
    return _here.receiver.annotated(obj, original(manager, obj, *args, **kwargs))


async def _refused(failure: TransferFailure):
    from sglang_ext.mm_receiver import EmbeddingUnavailable

    raise EmbeddingUnavailable(failure.kind.http_status, str(failure))
    yield  # an async generator, as SGLang's generate_request is


def around_abort_request(original, manager, rid: str = "", *args, **kwargs):
    result = original(manager, rid, *args, **kwargs)
    if rid and _here is not None:
        _here.receiver.abort(rid)
    return result


def _start_receiver(ours: argparse.Namespace, manager):
    from connector import checkpoint
    from language_side.consumers import EmbeddingCopy
    from language_side.dispatch import EncoderDispatch
    from language_side.embedding_cache import EmbeddingCache
    from language_side.worker import LanguageWorker
    from sglang_ext import generations
    from sglang_ext.args import connector_config
    from sglang_ext.mm_receiver import ResumableReceiver

    global _here
    # `kill -USR1 <pid>` writes every thread's stack to the log, as our own workers do (without
    # a handler the signal would end SGLang's server)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    config = connector_config(ours)
    worker = LanguageWorker(config, checkpoint_dir=ours.checkpoint_dir, consumer=EmbeddingCopy(),
                            queue_while_sleeping=ours.queue_while_sleeping)
    dispatch = EncoderDispatch(ours.encoder_urls or [], worker, EmbeddingCache(ours.image_embedding_cache_bytes))
    receiver = ResumableReceiver(dispatch, manager.model_config.dtype, keep_inputs=bool(ours.checkpoint_dir))
    from_disk = bool(ours.checkpoint_dir) and checkpoint.exists(ours.checkpoint_dir, generations.ROLE)
    if from_disk and not worker.is_sleeping():  # SGLang's generations wait for a wake-up, like the connector's
        worker.sleep(1, True)
    _here = Connected(ours, worker, receiver, restore_on_wake=from_disk)
    _add_routes(manager, worker, dispatch)
    log.info("epd-resume: SGLang's server is the language worker; embeddings arrive through the resumable connector "
             "(zmq=tcp://%s:%d mooncake=%s pool=%dx%d tokens, encoders=%s)", config.host, worker.receivers.rank_port,
             worker.transport.session_id, config.num_blocks, config.block_size, ",".join(ours.encoder_urls or []))
    return receiver


def _add_routes(manager, worker, dispatch) -> None:
    """Our sleep routes and the connector's state on SGLang's FastAPI app, with the same
    parameters and errors as our own workers' (``worker_infra.http``).

    ``/sleep?level=1|2&preserve_state=...`` is SGLang's ``pause_generation``, which the hook above
    extends to the connector: level 1 pauses ``in_place`` (running requests keep their KV and go on
    exactly where they stood), level 2 ``retract``s them (KV freed, recomputed from prompt and
    tokens on continue) and releases SGLang's memory occupation (KV cache and weights where its
    memory saver can; on CPU its cache is flushed); ``preserve_state=false`` aborts every request
    (``abort``). ``/wake_up`` is the reverse."""
    from fastapi.responses import ORJSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        PauseGenerationReqInput,
        ReleaseMemoryOccupationReqInput,
        ResumeMemoryOccupationReqInput,
    )
    from sglang.srt.runtime_context import get_observability
    from sglang.srt.utils.auth import AuthLevel, auth_level

    from connector.checkpoint import CheckpointError

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
        return ORJSONResponse(_here.last_sleep | {"level": level})

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
        """SGLang's own metrics (with ``--enable-metrics``) and the connector's ``epd_*`` ones;
        registered before SGLang mounts its ``/metrics``, so this route answers it."""
        text = b""
        if get_observability().enable_metrics:
            sglang_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(sglang_registry)
            text = generate_latest(sglang_registry)
        return Response(text + worker.metrics.render() + dispatch.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(RetryAfter, connector=worker)
    # SGLang's API-key middleware (--admin-api-key, else --api-key) guards them as it does its own
    # /pause_generation; with no key configured they are open, as SGLang's are
    app.add_api_route("/sleep", auth_level(AuthLevel.ADMIN_OPTIONAL)(sleep), methods=["POST"])
    app.add_api_route("/wake_up", auth_level(AuthLevel.ADMIN_OPTIONAL)(wake_up), methods=["POST"])
    app.add_api_route("/epd/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])


class RetryAfter:
    """ASGI middleware: a 429 or 503 without ``Retry-After`` (SGLang answers the connector's
    refusals, and its own, without one) gets the connector's: 5 s while it sleeps, else 2 s."""

    def __init__(self, app, connector: LanguageWorker) -> None:
        self.app, self.connector = app, connector

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_retry_after(message) -> None:
            if message["type"] == "http.response.start" and message["status"] in (429, 503):
                headers = list(message.get("headers", []))
                if not any(name.lower() == b"retry-after" for name, _ in headers):
                    kind = FailureKind.ASLEEP if self.connector.is_sleeping() else FailureKind.OVERLOADED
                    message = {**message, "headers": headers + [(b"retry-after", kind.retry_after.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_retry_after)


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
