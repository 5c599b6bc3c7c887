"""Start an encode or language worker: ``python -m sglang_ext.launch_server --disaggregation-mode ...``.

Works without SGLang installed; the SGLang plugin calls :func:`run` with the flags SGLang parsed.
"""

from __future__ import annotations

import argparse
import logging
import sys

from sglang_ext.args import add_worker_args, connector_config


def run(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = connector_config(args)
    except ValueError as exc:
        raise SystemExit(f"invalid configuration: {exc}") from None
    from connector.http_util import serve

    if args.disaggregation_mode == "encode":
        from embedding_side.encoders import FakeEncoder, QwenVisionEncoder
        from embedding_side.http_api import build_app
        from embedding_side.images import MediaPolicy
        from embedding_side.worker import EncodeWorker

        encoder = FakeEncoder(config.hidden_size) if args.encoder == "fake" else QwenVisionEncoder(args.model_path)
        media = MediaPolicy.create(args.allowed_local_media_path or (), args.allowed_media_domains,
                                   allow_private=args.allow_private_media_urls, max_bytes=args.image_max_bytes,
                                   fetch_timeout=args.image_fetch_timeout, max_pixels=args.max_image_pixels,
                                   decode_bytes=args.decode_memory_bytes)
        worker = EncodeWorker(config, encoder, args.disaggregation_bootstrap_port, media, args.queue_while_sleeping,
                              args.checkpoint_dir)
        extra = (f" bootstrap=http://{config.host}:{worker.bootstrap.port} "
                 f"zmq=tcp://{config.host}:{worker.sender.rank_port} encoder={encoder.name}")
    else:
        from language_side.http_api import build_app
        from language_side.worker import LanguageWorker

        worker = LanguageWorker(config, checkpoint_dir=args.checkpoint_dir, queue_while_sleeping=args.queue_while_sleeping)
        extra = f" zmq=tcp://{config.host}:{worker.receivers.rank_port}"

    def banner(port: int) -> None:
        state = " (asleep: a checkpoint waits for /wake_up)" if worker.is_sleeping() else ""
        print(f"READY {args.disaggregation_mode} worker http=http://{config.host}:{port}{extra} "
              f"mooncake={worker.transport.session_id} pool={config.num_blocks}x{config.block_size} tokens "
              f"({config.pool_bytes / 2**20:.0f} MiB){state}", flush=True)

    serve(build_app(worker), config.host, args.port, banner, worker.stop, worker.close)
    print(f"{args.disaggregation_mode} worker stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sglang_ext.launch_server", description=__doc__.splitlines()[0])
    add_worker_args(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
