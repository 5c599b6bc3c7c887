"""Command-line flags of both workers: SGLang's names for shared things, ours for the rest.

Every connector setting defaults to its environment variable (``connector.config.ENV_NAMES``)
and then to the built-in default; ``--help`` shows the value in effect.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from connector.buffers import BufferPool
from connector.config import ENV_NAMES, ConnectorConfig
from embedding_side.images import DEFAULT_DECODE_BYTES, DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS, DEFAULT_TIMEOUT_S

MODES = ("encode", "language")
LANGUAGE_BACKENDS = ("sglang", "native")
DEFAULT_KV_TOKENS = 65536
KV_HELP = ("bytes = tokens x 2 x layers x KV heads x head dim x dtype size: 2 KiB per token for the seeded "
           "1-layer model, 56 KiB for Qwen2.5-VL-7B in bf16, so the default is 128 MiB or 3.5 GiB; the "
           "worker prints its own at startup")


@dataclass(frozen=True)
class SharedFlag:
    """A flag SGLang's own parser defines too: our launcher defines it with ``kwargs``; under
    SGLang's launchers the worker takes SGLang's parsed value (``ServerArgs.<dest>``, through
    ``from_sglang``). ``from_sglang`` None: the SGLang plugin derives it itself (the mode, the
    transfer backend)."""

    flag: str
    kwargs: dict
    from_sglang: Callable[[Any], Any] | None = lambda value: value

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def _shared_flags(d: ConnectorConfig) -> tuple[SharedFlag, ...]:
    return (
        SharedFlag("--disaggregation-mode", dict(
            choices=MODES, default=None, help="encode: vision encoder + bootstrap server; language: receives "
            "embeddings and generates (or --encoder-only / --language-only, SGLang's names)"), None),
        SharedFlag("--encoder-only", dict(action="store_true", help="the same as --disaggregation-mode encode"), None),
        SharedFlag("--language-only", dict(action="store_true", help="the same as --disaggregation-mode language"),
                   None),
        SharedFlag("--encoder-urls", dict(
            nargs="+", default=None, metavar="URL", help="language side: encode workers (http://host:port) this "
            "worker sends the images of a request to itself (image_data in /generate, image_url parts in "
            "/v1/chat/completions), split by load, a failed part sent again to another encoder"),
            lambda urls: urls or None),
        SharedFlag("--host", dict(default="127.0.0.1", help="interface every server binds (default %(default)s)")),
        SharedFlag("--port", dict(type=int, default=30000, help="HTTP port (default %(default)s)")),
        SharedFlag("--model-path", dict(default=None, help="Qwen2.5-VL checkpoint folder (config.json + safetensors); "
                                        "encode side loads its vision tower. Default: a built-in seeded small tower "
                                        "with 7B geometry")),
        SharedFlag("--disaggregation-bootstrap-port", dict(
            type=int, default=8998, help="encode side: port of the bootstrap server (default %(default)s)")),
        SharedFlag("--disaggregation-transfer-backend", dict(
            default="mooncake", choices=["mooncake"], help="transfer backend (default %(default)s)"), None),
        SharedFlag("--disaggregation-ib-device", dict(default="", help="RDMA device for Mooncake (with "
                                                      "--mooncake-protocol rdma)"), lambda device: device or ""),
        SharedFlag("--tp-size", dict(type=int, default=1, help="tensor parallel size (only 1 is supported)")),
        SharedFlag("--log-level", dict(default="info", choices=["debug", "info", "warning", "error"])),
        SharedFlag("--admin-api-key", dict(default=None, metavar="KEY", help="/sleep and /wake_up need "
                                           "'Authorization: Bearer KEY' (SGLang's flag; default: open)")),
        SharedFlag("--max-queued-requests", dict(
            type=int, default=d.max_queued_requests, metavar="N", help=f"requests waiting for blocks (language "
            f"side) or for memory and the encoder (encode side); more get 503 with Retry-After at once, env "
            f"{ENV_NAMES['max_queued_requests']} (default %(default)s)"), lambda n: n or d.max_queued_requests),
        SharedFlag("--allowed-media-domains", dict(
            nargs="+", metavar="HOST", help="encode side: http(s) images only from these host names (then no "
            "address check)"), lambda hosts: hosts or None),
        SharedFlag("--device", dict(default=None, help="where the models run: cpu (default) or cuda")),
        SharedFlag("--max-total-tokens", dict(
            type=int, default=None, metavar="TOKENS", help=f"language side: KV cache budget in tokens ({KV_HELP}); "
            f"requests beyond it wait (default {DEFAULT_KV_TOKENS})")),
    )


def shared_flags() -> tuple[SharedFlag, ...]:
    """The flags SGLang defines too, each once: our launcher's definitions and how the plugin
    reads SGLang's values for them."""
    return _shared_flags(ConnectorConfig.from_env())


def add_worker_args(parser: argparse.ArgumentParser, with_shared: bool = True) -> None:
    """Add our flags; ``with_shared=False`` leaves out the ones SGLang already defines."""
    d = ConnectorConfig.from_env()
    if with_shared:
        for shared in _shared_flags(d):
            parser.add_argument(shared.flag, **shared.kwargs)
    pool_bytes = BufferPool.bytes_for(d.num_blocks, d.block_size, d.hidden_size, d.dtype)
    e = parser.add_argument_group("language model (language side)")
    e.add_argument("--language-backend", choices=LANGUAGE_BACKENDS, default=None,
                   help="what generates: sglang = SGLang's own server (scheduler, paged KV, radix cache, chunked "
                        "prefill, its native and OpenAI APIs) with embeddings from the resumable connector, the "
                        "default under python -m sglang.launch_server / sglang serve; native = this project's "
                        "engine (transformers), the only one of python -m sglang_ext.launch_server and of "
                        "--language-model none")
    e.add_argument("--language-model", choices=["auto", "transformers", "none"], default="auto",
                   help="transformers: generate with the language model of --model-path; none: receive embeddings "
                        "and answer their digest (transfer-only); auto: transformers when --model-path is given "
                        "(default %(default)s)")
    e.add_argument("--sleep-kv", choices=["keep", "recompute"], default="keep",
                   help="sleep with preserve_state=true: keep each running request's KV cache in host memory, or "
                        "drop it and recompute it at wake-up from the kept prompt embedding and the generated "
                        "tokens (same tokens either way) (default %(default)s)")
    e.add_argument("--image-embedding-cache-bytes", type=int, default=1 << 30, metavar="BYTES",
                   help="with --encoder-urls: image embeddings kept for images sent again (data: URIs, keyed by a "
                        "hash of the image bytes and the encoders' preprocessing), least recently used dropped "
                        "first; a 4K image's embedding is 75 MB at hidden 3584; 0 turns it off (default "
                        "%(default)s = 1 GiB)")
    g = parser.add_argument_group("embedding transfer")
    g.add_argument("--encoder", choices=["qwen", "fake"], default="qwen",
                   help="encode side: transformers Qwen2.5-VL tower, or the numpy fake for tests (default %(default)s)")
    g.add_argument("--hidden-size", type=int, default=None,
                   help=f"embedding width: the language model's hidden size, read from --model-path's config.json "
                        f"(else {d.hidden_size}); give it only to override")
    g.add_argument("--embedding-cache-buffer-size", type=int, default=d.num_blocks, metavar="BLOCKS",
                   help=f"blocks per pool, env {ENV_NAMES['num_blocks']} (default %(default)s = "
                        f"{pool_bytes / 2**20:.0f} MiB at hidden {d.hidden_size} {d.dtype})")
    g.add_argument("--multimodal-block-size", type=int, default=d.block_size, metavar="TOKENS",
                   help=f"tokens per block, env {ENV_NAMES['block_size']} (default %(default)s)")
    g.add_argument("--embedding-default-allocate-buffer-size", type=int, default=d.default_allocate_tokens,
                   metavar="TOKENS", help=f"language side: tokens allocated before the size is known, env "
                                          f"{ENV_NAMES['default_allocate_tokens']} (default %(default)s)")
    g.add_argument("--mooncake-protocol", default=os.environ.get("MOONCAKE_PROTOCOL", "tcp"), choices=["tcp", "rdma"],
                   help="Mooncake transport, env MOONCAKE_PROTOCOL (default %(default)s)")
    for name, flag in (("bootstrap_timeout", "--bootstrap-timeout"), ("waiting_timeout", "--waiting-timeout"),
                       ("resume_timeout", "--resume-timeout"), ("heartbeat_interval", "--heartbeat-interval"),
                       ("abort_ack_timeout", "--abort-ack-timeout")):
        g.add_argument(flag, type=float, default=getattr(d, name), metavar="SECONDS",
                       help=f"env {ENV_NAMES[name]} (default %(default)s)")
    g.add_argument("--heartbeat-max-failure", type=int, default=d.heartbeat_max_failures,
                   help=f"heartbeats (language side) or pings (encode side) missed in a row before a peer is "
                        f"dead, env {ENV_NAMES['heartbeat_max_failures']} (default %(default)s)")
    g.add_argument("--staging-bytes", type=int, default=d.staging_bytes, metavar="BYTES",
                   help=f"encode side: host memory for embeddings no language worker has asked for yet; more "
                        f"wait (up to --queue-timeout) in arrival order, env {ENV_NAMES['staging_bytes']} "
                        f"(default %(default)s = {d.staging_bytes / 2**30:g} GiB)")
    g.add_argument("--queue-timeout", type=float, default=d.queue_timeout, metavar="SECONDS",
                   help=f"longest wait in those queues, then 503 with Retry-After, env "
                        f"{ENV_NAMES['queue_timeout']} (default %(default)s)")
    g.add_argument("--fork-abort-hold", type=float, default=d.fork_abort_hold, metavar="SECONDS",
                   help=f"language side: an aborted room of an encoder built from the reference fork (which cannot be "
                        f"told to stop) keeps its blocks until that encoder reports the round it owes, or this long, "
                        f"env {ENV_NAMES['fork_abort_hold']} (default %(default)s)")
    g.add_argument("--allowed-bootstrap-hosts", nargs="+", default=[], metavar="HOST[:PORT]",
                   help="language side: the encoders a /generate may name by bootstrap_host/bootstrap_port (the "
                        "two-request flow), beside the hosts of --encoder-urls; any other gets 403 before it is "
                        "contacted (default: only the hosts of --encoder-urls)")
    g.add_argument("--control-secret", default=d.control_secret, metavar="SECRET",
                   help=f"shared secret both workers require on control messages and bootstrap routes (at least "
                        f"16 characters; peers built from the reference fork cannot use it). Prefer the env "
                        f"{ENV_NAMES['control_secret']}: a flag shows in the process list (default: off)")
    g.add_argument("--max-sleep", type=float, default=d.max_sleep, metavar="SECONDS",
                   help=f"a sleeping peer's rooms are kept this long, env {ENV_NAMES['max_sleep']} (default %(default)s)")
    g.add_argument("--checkpoint-dir", default=None,
                   help="also write sleep checkpoints here (safetensors + JSON + checksum); a worker started with a "
                        "checkpoint in it boots asleep and continues the requests on /wake_up")
    g.add_argument("--queue-while-sleeping", action="store_true",
                   help="requests that arrive while asleep wait for the wake-up instead of getting 503")
    m = parser.add_argument_group("media access (encode side; what a request may name)")
    m.add_argument("--allowed-local-media-path", action="append", metavar="DIR",
                   help="local paths and file:// URIs are read only inside this directory (symlinks followed; "
                        "repeatable); without it, local files are refused")
    m.add_argument("--allow-private-media-urls", action="store_true",
                   help="without --allowed-media-domains, also fetch URLs whose host resolves to loopback, "
                        "link-local or private addresses (refused by default)")
    m.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                   help="per image, from its header before decoding (default %(default)s)")
    m.add_argument("--decode-memory-bytes", type=int, default=DEFAULT_DECODE_BYTES, metavar="BYTES",
                   help="host memory for decoding and preprocessing images, all requests together, reserved from "
                        "the image sizes before decoding (a request needing more: 413; others wait up to "
                        f"--queue-timeout, then 503) (default %(default)s = {DEFAULT_DECODE_BYTES / 2**30:g} GiB)")
    m.add_argument("--image-max-bytes", type=int, default=DEFAULT_MAX_BYTES, help="per image (default %(default)s)")
    m.add_argument("--image-fetch-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds for the whole fetch of an http(s) image, redirects and body included "
                        "(default %(default)s)")


def resolve_mode(args: argparse.Namespace) -> str:
    """The one mode ``--disaggregation-mode``, ``--encoder-only`` and ``--language-only`` ask for."""
    wanted = {m for m, on in (("encode", args.encoder_only), ("language", args.language_only)) if on}
    if args.disaggregation_mode in MODES:
        wanted.add(args.disaggregation_mode)
    if len(wanted) != 1:
        raise SystemExit("error: give one of --disaggregation-mode encode|language, --encoder-only or --language-only"
                         + (f" (got {sorted(wanted)})" if wanted else ""))
    return wanted.pop()


def embedding_width(args: argparse.Namespace) -> int:
    """``--hidden-size``, else the width ``--model-path``'s config.json gives the language model (what
    its vision tower's merger outputs), else the built-in default."""
    if args.hidden_size is not None:
        return args.hidden_size
    if getattr(args, "model_path", None):
        path = os.path.join(args.model_path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            width = (config.get("text_config") or {}).get("hidden_size") or config.get("hidden_size") \
                or (config.get("vision_config") or {}).get("out_hidden_size")
        except (OSError, ValueError, AttributeError) as exc:
            raise SystemExit(f"error: cannot read the embedding width from {path}: {exc}") from None
        if not isinstance(width, int) or width <= 0:
            raise SystemExit(f"error: {path} names no hidden_size; pass --hidden-size")
        return width
    return ConnectorConfig.hidden_size


def connector_config(args: argparse.Namespace) -> ConnectorConfig:
    if args.tp_size != 1:
        raise SystemExit(f"--tp-size {args.tp_size}: only 1 is supported by the encode/language workers")
    return ConnectorConfig(
        host=args.host, hidden_size=embedding_width(args), block_size=args.multimodal_block_size,
        num_blocks=args.embedding_cache_buffer_size, default_allocate_tokens=args.embedding_default_allocate_buffer_size,
        protocol=args.mooncake_protocol, ib_device=args.disaggregation_ib_device or "",
        bootstrap_timeout=args.bootstrap_timeout, waiting_timeout=args.waiting_timeout,
        resume_timeout=args.resume_timeout, heartbeat_interval=args.heartbeat_interval,
        heartbeat_max_failures=args.heartbeat_max_failure, abort_ack_timeout=args.abort_ack_timeout,
        max_sleep=args.max_sleep, staging_bytes=args.staging_bytes, max_queued_requests=args.max_queued_requests,
        queue_timeout=args.queue_timeout, fork_abort_hold=args.fork_abort_hold, control_secret=args.control_secret)
