"""``--disaggregation-mode language`` as SGLang's own server, fed by the resumable connector.

``python -m sglang.launch_server --disaggregation-mode language --encoder-urls ...`` (and
``--language-only``, and ``sglang serve``) starts SGLang's HTTP server, tokenizer manager,
scheduler and detokenizer on ``--model-path`` unchanged, in SGLang's language-only mode with the
``zmq_to_tokenizer`` transfer backend (the model is built without its vision or audio tower:
:mod:`sglang_ext.no_encoder_tower`).
:func:`sglang_ext.language_flags.sglang_argv` turns our mode into SGLang's flags (the plugin
re-parses them, so SGLang validates its own configuration); then these hooks, mostly on SGLang's
``TokenizerManager``, acting only in the process where :func:`arm` was called (the one that runs
it):

* around ``init_disaggregation``: SGLang's own set-up runs without its encoder side (no
  bootstrap registry, no upstream receiver), then its ``mm_receiver`` becomes ours
  (:class:`sglang_ext.mm_receiver.ResumableReceiver`): the connector's language worker (pool,
  Mooncake, ZMQ) and the encoder dispatch;
* around ``generate_request``: a client asking again for a generation restored from disk gets
  its whole output (:mod:`sglang_ext.generations`); while the connector sleeps a new request
  gets 503 at once; every other response gets its image transfer (``resume_rounds``, timings)
  in ``meta_info``;
* around ``abort_request``: a request still waiting for its embedding is cancelled;
* (on SGLang's ``OpenAIServingBase.handle_request``) a prompt too long for any context is
  refused before SGLang's OpenAI routes tokenize it (:mod:`sglang_ext.prompt_bounds`);
* around ``pause_generation`` / ``continue_generation``: the connector sleeps after SGLang
  pauses (and, with ``--checkpoint-dir``, SGLang's unfinished generations are written beside its
  checkpoint) and wakes before SGLang continues (a server started on such a checkpoint then
  submits the generations again).

In front of SGLang's app: the body bound, error scrubbing and ``Retry-After`` on 429/503
(:mod:`sglang_ext.http_guards`); SGLang's admin routes that act on a path, host or object the
client names need the admin key (:data:`CLIENT_NAMED_TARGETS`). The connector's routes are added
to SGLang's app beside its own: ``/sleep``, ``/wake_up`` and ``/is_sleeping``, ``/epd/health``
(rooms, pool, parts) and ``/metrics`` (SGLang's metrics and the connector's ``epd_*``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import os
import signal
from typing import TYPE_CHECKING

from connector import CheckpointError, FailureKind, TransferFailure
from sglang_ext.http_guards import AsleepHealth, FreezeGcAfterWake, RetryAfter, ScrubErrors
from sglang_ext.prompt_bounds import too_long
from worker_infra.asgi import BodyLimit
from worker_infra.http import HTTPError, add_sleep_routes, answer_our_errors, asleep_error, check_room
from worker_infra.trust import BootstrapAllowList, check_host, encoder_host

if TYPE_CHECKING:
    from language_side.worker import LanguageWorker
    from sglang_ext.generations import Restored
    from sglang_ext.mm_receiver import ResumableReceiver

log = logging.getLogger(__name__)

_pending: argparse.Namespace | None = None  # our flags, until this process's tokenizer manager starts
PRECOMPUTE_HASH_ENV = "SGLANG_MM_PRECOMPUTE_HASH"  # SGLang's: where an item's embedding is hashed (see arm)


@dataclasses.dataclass
class Connected:
    """What runs beside SGLang in this process once its tokenizer manager has started."""

    ours: argparse.Namespace
    worker: LanguageWorker  # the connector's language side
    receiver: ResumableReceiver
    allowed: BootstrapAllowList  # the encoders a two-request /generate may name
    # started on a disk checkpoint of SGLang's generations: the first wake-up submits them again
    restore_on_wake: bool
    restored: Restored | None = None
    last_sleep: dict = dataclasses.field(default_factory=dict)  # the connector's report of its last sleep
    discard_on_wake: bool = False  # the coming wake-up was asked to drop the disk checkpoints

    def geometry(self, manager) -> dict:
        """What a checkpoint of SGLang's generations must match to be loaded here."""
        return {"hidden_size": self.worker.config.hidden_size, "vocab_size": manager.model_config.vocab_size}


_here: Connected | None = None


def arm(ours: argparse.Namespace) -> None:
    """Our flags, for the tokenizer manager this process is about to start; the encoders they
    name are checked now (a clear error before SGLang starts, not a traceback after). Nothing
    that imports ``prometheus_client`` may be imported here: it picks its multiprocess mode at
    import, before SGLang has set ``PROMETHEUS_MULTIPROC_DIR``, and SGLang's own tokenizer
    metrics would then never reach ``/metrics``."""
    global _pending
    try:
        BootstrapAllowList(ours.allowed_bootstrap_hosts)
        for url in ours.encoder_urls or []:
            encoder_host(url)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    # SGLang hashes each item's embedding (its radix-cache key) in the scheduler's loop unless
    # this is set: there a 3840x2160 image's 75.6 MB held up every decoding stream for the hash's
    # time. Set, the tokenizer manager hashes in its own threads before it sends the request on
    # (the same hash); a value the user set is kept.
    os.environ.setdefault(PRECOMPUTE_HASH_ENV, "1")
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
    from connector import checkpoint
    from sglang_ext import generations

    saved = generations.snapshot(manager, _here.receiver)
    written, why = await asyncio.to_thread(checkpoint.save_or_explain, _here.ours.checkpoint_dir, lambda: generations.save(
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

    folder, discard = _here.ours.checkpoint_dir, _here.discard_on_wake
    saved = None
    if _here.restore_on_wake and not discard and checkpoint.exists(folder, generations.ROLE):
        saved = await asyncio.to_thread(generations.load, folder, _here.geometry(manager))  # CheckpointError
    await asyncio.to_thread(_here.worker.wake_up, discard)
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
    in SGLang's pause without a bound (with ``--queue-while-sleeping`` it waits); a request naming
    its encoder by ``bootstrap_*`` (the two-request flow) is checked and marked for the receiver
    (:func:`name_room`); every request is then SGLang's, with its image transfer in ``meta_info``.
    A refusal keeps its status on every route (see :func:`with_status`)."""
    if _here is None:
        return original(manager, obj, *args, **kwargs)
    request = kwargs.get("request", args[0] if args else None)
    if _here.restored is not None and _here.restored.claims(obj):
        return _here.restored.answer(obj.rid)
    if _here.worker.is_sleeping() and not _here.worker.gate.queue_while_sleeping:
        asleep = asleep_error("language")
        stream = _refused(asleep.kind, str(asleep))
    elif (why := too_long(obj, manager.context_len)) is not None:
        stream = _refused(FailureKind.BAD_REQUEST, why)
    else:
        try:
            # on a PD prefill, bootstrap_* name the prefill's own KV bootstrap for its decode (SGLang's)
            if (_here.ours.pd_role is None and name_room(obj, _here.allowed, _here.receiver.room_marker)
                    and request is not None):
                from sglang_ext.mm_receiver import CLIENT_ATTRIBUTE

                setattr(obj, CLIENT_ATTRIBUTE, request)  # its room ends if the client goes away
            stream = _here.receiver.annotated(obj, original(manager, obj, *args, **kwargs))
        except HTTPError as exc:
            stream = _refused(exc.kind, exc.message)
    return with_status(stream, _openai_route(request))


def name_room(obj, allowed: BootstrapAllowList, marker: str) -> bool:
    """The two-request flow: a ``/generate`` whose images a router sent to an encoder, naming that
    encoder's bootstrap address and the room by ``bootstrap_host``/``bootstrap_port``/
    ``bootstrap_room``, and its prompt's image placeholders in ``text`` or ``input_ids``. Checked
    here (HTTPError 400; 403 for an encoder not allowed, before it is contacted); ``image_data``
    becomes ``[marker]``, so SGLang hands the request to the receiver, which receives the room.
    A request naming no encoder is left as it is (False)."""
    named = {name: getattr(obj, f"bootstrap_{name}", None) for name in ("host", "port", "room")}
    if all(value is None for value in named.values()):
        return False
    if any(value is None for value in named.values()):
        raise HTTPError(FailureKind.BAD_REQUEST,
                        "bootstrap_host, bootstrap_port and bootstrap_room go together (the two-request flow)")
    if any(isinstance(value, list) for value in named.values()) or not isinstance(obj.text, str | None) or (
            obj.input_ids and isinstance(obj.input_ids[0], list)):
        raise HTTPError(FailureKind.BAD_REQUEST,
                        "a batch cannot name encoders by bootstrap_*: send one /generate per prompt")
    if any(getattr(obj, f"{kind}_data", None) is not None for kind in ("image", "video", "audio")):
        raise HTTPError(FailureKind.BAD_REQUEST,
                        "a request names its media in image_data (video_data, audio_data) or by the encoder's "
                        "bootstrap_room, not both")
    host, port = named["host"], named["port"]
    if not isinstance(host, str):
        raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_host must be a host name or address")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise HTTPError(FailureKind.BAD_REQUEST, "bootstrap_port must be in 1..65535")
    check_room(named["room"])
    allowed.check(check_host(host), port)
    obj.image_data = [marker]
    return True


async def around_openai_request(original, serving, request, *args, **kwargs):
    """SGLang's OpenAI routes tokenize a chat before it reaches ``generate_request``: a prompt too
    long for any context is refused before that (:mod:`sglang_ext.prompt_bounds`)."""
    if _here is not None and (why := too_long(request, serving.tokenizer_manager.context_len)) is not None:
        return serving.create_error_response(why, status_code=400)
    return await original(serving, request, *args, **kwargs)


async def _no_local_media(*args, **kwargs):
    """In place of SGLang's own media processing, which it falls back to when the receiver has
    nothing for a request it thinks has media: this server runs no vision tower."""
    from sglang_ext.mm_receiver import EmbeddingUnavailable

    raise EmbeddingUnavailable(FailureKind.BAD_REQUEST,
                               "no image, video or audio reference could be read from this request (each must "
                               "be a path, URL or data: URI); this server does not process media itself")


async def _refused(kind: FailureKind, message: str):
    from sglang_ext.mm_receiver import EmbeddingUnavailable

    raise EmbeddingUnavailable(kind, message)
    yield  # an async generator, as SGLang's generate_request is


def _openai_route(request) -> bool:
    url = getattr(request, "url", None)
    return url is not None and url.path.startswith("/v1/")


async def with_status(stream, openai: bool):
    """``stream`` with a refusal (:class:`EmbeddingUnavailable`, a ``ValueError``) raised as is
    for SGLang's native routes, which answer a ``ValueError`` with its ``status_code``, and as an
    ``HTTPException`` for its OpenAI routes, which answer every ``ValueError`` with 400."""
    from fastapi import HTTPException

    from sglang_ext.mm_receiver import EmbeddingUnavailable

    try:
        async for out in stream:
            yield out
    except EmbeddingUnavailable as exc:
        if not openai:
            raise
        raise HTTPException(exc.status_code, str(exc), exc.kind.headers() or None) from None
    finally:
        await stream.aclose()


def around_abort_request(original, manager, rid: str = "", *args, **kwargs):
    result = original(manager, rid, *args, **kwargs)
    if rid and _here is not None:
        _here.receiver.abort(rid)
    return result


def _start_receiver(ours: argparse.Namespace, manager):
    from language_side.consumers import EmbeddingCopy
    from language_side.dispatch import EncoderDispatch
    from language_side.embedding_cache import EmbeddingCache
    from language_side.worker import LanguageWorker
    from sglang_ext.args import connector_config, global_cache
    from sglang_ext.language_flags import starts_asleep
    from sglang_ext.mm_receiver import ResumableReceiver

    global _here
    # `kill -USR1 <pid>` writes every thread's stack to the log, as our own workers do (without
    # a handler the signal would end SGLang's server)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    config = connector_config(ours)
    worker = LanguageWorker(config, checkpoint_dir=ours.checkpoint_dir, consumer=EmbeddingCopy(),
                            queue_while_sleeping=ours.queue_while_sleeping)
    store = global_cache(ours, config)
    if store is not None:
        store.connect(worker.transport)  # bounded; a master not answering now is tried again later
    dispatch = EncoderDispatch(ours.encoder_urls or [], worker, EmbeddingCache(ours.image_embedding_cache_bytes),
                               store=store)
    receiver = ResumableReceiver(dispatch, manager.model_config.dtype, keep_inputs=bool(ours.checkpoint_dir),
                                 limits=manager.server_args.limit_mm_data_per_request or {})
    from_disk = starts_asleep(ours)
    if from_disk and not worker.is_sleeping():  # SGLang's generations wait for a wake-up, like the connector's
        worker.sleep(1, True)
    if manager.mm_processor is not None:  # SGLang's fallback when the receiver has nothing: never here
        manager.mm_processor.process_mm_data_async = _no_local_media
    _here = Connected(ours, worker, receiver, BootstrapAllowList(ours.allowed_bootstrap_hosts),
                      restore_on_wake=from_disk)
    _add_routes(manager, worker, dispatch)
    kv = f"{manager.server_args.max_total_tokens} tokens (--max-total-tokens)"
    if ours.kv_budget is not None:
        kv = f"{ours.kv_budget.describe()} (this mode's CPU default; --max-total-tokens to change)"
    log.info("epd-resume: SGLang's server is the language worker; embeddings arrive through the resumable connector "
             "(zmq=tcp://%s:%d mooncake=%s pool=%dx%d tokens%s, encoders=%s); KV pool: %s", config.public_host,
             worker.receivers.rank_port, worker.transport.session_id, config.num_blocks, config.block_size,
             " pinned" if worker.pool is not None and worker.pool.pinned else "",
             ",".join(ours.encoder_urls or []), kv if manager.server_args.max_total_tokens else "SGLang's own sizing")
    return receiver


class SGLangSleep:
    """Sleep and wake of SGLang's server and its connector, for the sleep routes our own workers
    have too (``worker_infra.http.add_sleep_routes``).

    A sleep is SGLang's ``pause_generation``, which the hook above extends to the connector: level 1
    pauses ``in_place`` (running requests keep their KV and go on exactly where they stood), level
    2 ``retract``s them (KV freed, recomputed from prompt and tokens on continue) and releases
    SGLang's memory occupation (KV cache and weights where its memory saver can; on CPU its cache
    is flushed); ``preserve_state=false`` aborts every request (``abort``). A wake-up is the reverse."""

    def __init__(self, manager, worker: LanguageWorker, freeze_pending: asyncio.Event) -> None:  # noqa: ANN001
        self.manager, self.worker = manager, worker
        self.freeze_pending = freeze_pending  # SGLang's /freeze_gc came while asleep (FreezeGcAfterWake)
        self.released = False  # SGLang's memory occupation, by a level-2 sleep

    def is_sleeping(self) -> bool:
        return self.worker.is_sleeping()

    async def sleep(self, level: int, preserve_state: bool) -> dict:
        from sglang.srt.managers.io_struct import (
            ContinueGenerationReqInput,
            PauseGenerationReqInput,
            ReleaseMemoryOccupationReqInput,
        )

        if self.worker.is_sleeping():
            return {"changed": False, "is_sleeping": True}
        try:
            mode = ("in_place" if level == 1 else "retract") if preserve_state else "abort"
            await self.manager.pause_generation(PauseGenerationReqInput(mode=mode))
        except (HTTPError, TransferFailure, CheckpointError):  # the connector stayed awake
            await self.manager.continue_generation(ContinueGenerationReqInput())
            raise
        if level == 2 and not self.released:
            await self.manager.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)
            self.released = True
        return _here.last_sleep | {"level": level}

    async def wake_up(self, discard_checkpoint: bool) -> dict:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, ResumeMemoryOccupationReqInput

        if self.released:
            await self.manager.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)
            self.released = False
        _here.discard_on_wake = discard_checkpoint  # read by the continue_generation hook
        try:
            await self.manager.continue_generation(ContinueGenerationReqInput())
        finally:
            _here.discard_on_wake = False
        if self.freeze_pending.is_set():  # asked for while asleep (a boot from disk): the scheduler answers now
            self.freeze_pending.clear()
            await self.manager.freeze_gc()
        return {"changed": True, "is_sleeping": self.worker.is_sleeping()}


def _add_routes(manager, worker, dispatch) -> None:
    """Our sleep routes and the connector's state on SGLang's FastAPI app, with the same
    parameters and errors as our own workers' (``worker_infra.http``)."""
    from fastapi.responses import ORJSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.runtime_context import get_observability
    from sglang.srt.utils.auth import AuthLevel, auth_level

    freeze_pending = asyncio.Event()  # SGLang's /freeze_gc came while asleep (FreezeGcAfterWake)
    sleeper = SGLangSleep(manager, worker, freeze_pending)

    async def health():
        dispatch.watch()
        return ORJSONResponse(worker.health())

    async def metrics():
        """SGLang's own metrics (with ``--enable-metrics``) and the connector's ``epd_*`` ones;
        registered before SGLang mounts its ``/metrics``, so this route answers it."""
        dispatch.watch()  # the encoders' gauge follows their /health from the first scrape on
        text = b""
        if get_observability().enable_metrics:
            sglang_registry = CollectorRegistry()
            sglang_registry.register(SGLangMetricsOnly(multiprocess.MultiProcessCollector(None)))
            text = generate_latest(sglang_registry)
        return Response(text + worker.metrics.render() + dispatch.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(AsleepHealth, connector=worker)
    app.add_middleware(FreezeGcAfterWake, connector=worker, pending=freeze_pending)
    app.add_middleware(RetryAfter, connector=worker)
    app.add_middleware(ScrubErrors)
    app.add_middleware(BodyLimit, max_bytes=_here.ours.max_request_body_bytes,
                       flag="--max-request-body-bytes")  # outermost: before anything reads
    _admin_only(app)
    answer_our_errors(app)
    # SGLang's API-key middleware (--admin-api-key, else --api-key) guards sleep and wake as it does
    # its own /pause_generation; with no key configured they are open, as SGLang's are
    add_sleep_routes(app, sleeper, auth_level(AuthLevel.ADMIN_OPTIONAL))
    app.add_api_route("/epd/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])


# SGLang's admin routes that act on a path, host or serialized object the client names: they need
# --admin-api-key (SGLang's ADMIN_FORCE: 401 without it, 403 when no admin key is configured)
# instead of being open on a server started without keys.
CLIENT_NAMED_TARGETS = ("/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_ipc",
                        "/update_weights_from_distributed", "/init_weights_update_group",
                        "/init_weights_send_group_for_remote_instance", "/send_weights_to_remote_instance",
                        "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/start_profile",
                        "/add_external_corpus", "/hicache/storage-backend", "/dumper/{method}", "/configure_logging",
                        "/set_internal_state", "/pd_role_switch")


def _admin_only(app) -> None:
    from sglang.srt.utils.auth import AuthLevel

    for route in app.router.routes:
        if getattr(route, "path", None) in CLIENT_NAMED_TARGETS and getattr(route, "endpoint", None) is not None:
            route.endpoint._auth_level = AuthLevel.ADMIN_FORCE


class SGLangMetricsOnly:
    """SGLang's metrics from its processes' shared files, without the connector's: SGLang runs
    prometheus-client in multiprocess mode, so the connector's counters land in those files too,
    and would be shown twice beside its own registries' (a scrape refuses duplicate series)."""

    def __init__(self, collector) -> None:
        self.collector = collector

    def collect(self):
        return (family for family in self.collector.collect() if not family.name.startswith("epd_"))
