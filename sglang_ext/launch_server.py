"""Our workers' runner: the encode worker, and the transfer-only receiver.

``python -m sglang.launch_server --disaggregation-mode encode|language`` starts them: the SGLang
plugin calls :func:`run` with the flags SGLang parsed (or, for a worker without a checkpoint,
with :func:`parse`'s). A language worker with a checkpoint is SGLang's own server, not run here.
``python -m sglang_ext.launch_server`` is an alias that runs SGLang's launcher with the same
arguments.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang_ext.args import ENCODE_BOOTSTRAP_PORT, add_worker_args, connector_config, global_cache, resolve_mode
from worker_infra.heap import fix_mmap_threshold

if TYPE_CHECKING:
    from fastapi import FastAPI

    from connector import ConnectorConfig
    from embedding_side.worker import EncodeWorker
    from language_side.worker import LanguageWorker

log = logging.getLogger(__name__)
WARM_UP_TIMEOUT_S = 300.0  # the encoder's first forward pass (a compile included), at start


@dataclass
class Built:
    """A worker and its HTTP app, not yet serving; ``describe`` is what the READY line says of its
    addresses, model and encoders."""

    worker: EncodeWorker | LanguageWorker
    app: FastAPI
    config: ConnectorConfig
    describe: str


def build(args: argparse.Namespace, encoder=None) -> Built:  # noqa: ANN001 - a VisionEncoder
    """The worker ``args`` ask for and its app: what :func:`run` serves, and what the fast test
    tier serves in-process (an encode worker around ``encoder`` when given: a test double)."""
    try:
        config = connector_config(args)
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None
    if args.disaggregation_mode == "encode":
        from connector import BootstrapPortInUse
        from embedding_side.http_api import build_app
        from embedding_side.images import MediaPolicy
        from embedding_side.worker import EncodeWorker

        encoder = encoder or make_encoder(args, config)
        warming = _warm_up(args, encoder)
        media = MediaPolicy.create(args.allowed_local_media_path or (), args.allowed_media_domains,
                                   allow_private=args.allow_private_media_urls, max_bytes=args.image_max_bytes,
                                   fetch_timeout=args.image_fetch_timeout, max_pixels=args.max_image_pixels,
                                   decode_bytes=args.decode_memory_bytes, max_video_frames=args.max_video_frames,
                                   max_video_pixels=args.max_video_pixels,
                                   max_audio_seconds=args.max_audio_seconds)
        store = global_cache(args, config)
        try:
            worker = EncodeWorker(config, encoder, args.disaggregation_bootstrap_port, media,
                                  args.queue_while_sleeping, args.checkpoint_dir, store)
        except BootstrapPortInUse as exc:
            raise SystemExit(f"error: {exc}; each encode worker on a host needs its own "
                             f"--disaggregation-bootstrap-port (default {ENCODE_BOOTSTRAP_PORT})") from None
        if store is not None:  # on the worker's engine; bounded: a master not answering now is tried again later
            store.connect(worker.transport)
        if warming is not None:
            _warmed(warming, worker)
        extra = (f" bootstrap=http://{config.public_host}:{worker.bootstrap.port} "
                 f"zmq=tcp://{config.public_host}:{worker.sender.rank_port} encoder={encoder.name}")
        return Built(worker, build_app(worker, args.admin_api_key), config, extra)

    from language_side.transfer_only_api import build_app
    from language_side.worker import LanguageWorker
    from worker_infra.trust import BootstrapAllowList

    if args.encoder_urls:
        raise SystemExit("error: --encoder-urls needs the language model (--model-path): a transfer-only receiver "
                         "has no prompt to put images in")
    try:
        allowed = BootstrapAllowList(args.allowed_bootstrap_hosts)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    worker = LanguageWorker(config, checkpoint_dir=args.checkpoint_dir, queue_while_sleeping=args.queue_while_sleeping)
    return Built(worker, build_app(worker, allowed, args.admin_api_key), config,
                 f" zmq=tcp://{config.public_host}:{worker.receivers.rank_port} transfer-only")


def _warm_up(args: argparse.Namespace, encoder):  # noqa: ANN001, ANN202 - a VisionEncoder, a Future or None
    """The encoder's first forward pass, started before the worker sets up its transfer engine and
    pool (about 1.5 s, overlapped) and finished before it serves (SGLang's ``--skip-server-warmup``
    skips it, as it skips SGLang's server's)."""
    server_args = getattr(args, "sglang_server_args", None)
    if getattr(server_args, "skip_server_warmup", False) or not hasattr(encoder, "warm_up"):
        return None
    future = encoder.warm_up()  # None: an encoder of audio only (nothing compiled at its first pass)
    return None if future is None else (future, time.monotonic())


def _warmed(warming: tuple, worker) -> None:  # noqa: ANN001 - an EncodeWorker
    future, started = warming
    try:
        future.result(timeout=WARM_UP_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the worker cannot encode
        worker.close()
        raise SystemExit(f"error: the encoder's warm-up pass failed: {type(exc).__name__}: {exc}") from None
    log.info("encoder warmed up: its first forward pass took %.1f s", time.monotonic() - started)


def make_encoder(args: argparse.Namespace, config: ConnectorConfig):
    """The encode worker's encoder: SGLang's own, for ``--model-path``'s checkpoint (the plugin
    parsed SGLang's flags for it when SGLang's launcher started us)."""
    if not args.model_path:
        raise SystemExit("error: an encode worker needs --model-path: the checkpoint whose encoder it runs "
                         "(SGLang's encoder for that model)")
    from embedding_side.sglang_encoder import SGLangEncoder
    from sglang_ext.encoder_flags import standalone_server_args

    server_args = getattr(args, "sglang_server_args", None)  # the plugin's, parsed by SGLang
    try:
        return SGLangEncoder(server_args if server_args is not None else standalone_server_args(args))
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None


def run(args: argparse.Namespace) -> None:
    # force: SGLang's launcher configured the root logger already (without the level in each line)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        force=True)
    # `kill -USR1 <pid>` writes every thread's stack to the log: where a stuck worker stands.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    fix_mmap_threshold(args.malloc_mmap_threshold)
    from worker_infra.http import serve

    built = build(args)
    worker, config = built.worker, built.config

    def banner(port: int) -> None:
        state = " (asleep: a checkpoint waits for /wake_up)" if worker.is_sleeping() else ""
        pinned = ", pinned" if worker.pool is not None and worker.pool.pinned else ""
        print(f"READY {args.disaggregation_mode} worker http=http://{config.public_host}:{port}{built.describe} "
              f"mooncake={worker.transport.session_id} pool={config.num_blocks}x{config.block_size} tokens "
              f"({config.pool_bytes / 2**20:.0f} MiB{pinned}){state}", flush=True)

    close = functools.partial(_close_for_exit, worker) if args.disaggregation_mode == "encode" else worker.close
    serve(built.app, config.host, args.port, banner, worker.stop, close)
    print(f"{args.disaggregation_mode} worker stopped", flush=True)
    _exit_now()


# SIGINT to exit within 2 s (README): what the encode worker's close has not finished by then
# (a write to a language peer that stopped answering, up to Mooncake's 10 s transfer timeout) is
# left to the exit; that peer finds the room gone by its heartbeat, as after a kill.
CLOSE_WAIT_S = 1.5


def _close_for_exit(worker: EncodeWorker) -> None:
    failed: list[BaseException] = []

    def close() -> None:
        try:
            worker.close(exiting=True)
        except BaseException as exc:  # raised again in the caller's thread
            failed.append(exc)

    closing = threading.Thread(target=close, name="encode-close", daemon=True)
    closing.start()
    closing.join(CLOSE_WAIT_S)
    if closing.is_alive():
        log.warning("encode worker still closing after %gs (a write in flight?); exiting "
                                            "anyway", CLOSE_WAIT_S)
    elif failed:
        raise failed[0]


def _exit_now() -> None:
    """End the process once the worker is closed, without the interpreter's own teardown:
    collecting torch's and transformers' (and under SGLang's launcher, SGLang's) modules took
    1-3 s here, and a thread of a forward pass still running would be joined first. Everything
    that must reach a peer or the disk was sent or written by ``stop`` and ``close``."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse(argv: list[str]) -> argparse.Namespace:
    """Our flags alone, for a worker without a checkpoint (SGLang's parser needs one)."""
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server", description=__doc__.splitlines()[0])
    add_worker_args(parser)
    args = parser.parse_args(argv)
    args.disaggregation_mode = resolve_mode(args)
    return args


def main(argv: list[str] | None = None) -> None:
    """The alias: SGLang's launcher, with the same arguments (one launcher for every worker)."""
    argv = sys.argv[1:] if argv is None else argv
    os.execv(sys.executable, [sys.executable, "-m", "sglang.launch_server", *argv])


if __name__ == "__main__":
    sys.exit(main())
