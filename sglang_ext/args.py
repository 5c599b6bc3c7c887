"""Command-line flags of both workers: SGLang's names for shared things, ours for the rest.

The connector's settings come from one table, ``connector.SETTINGS`` (each with its flag,
type, default, environment variable and help): every one defaults to its environment variable
and then to the built-in default, and ``--help`` shows the value in effect and the variable.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector import DTYPE_SIZES, SETTINGS, ConnectorConfig, Setting
from embedding_side.images import (
    DEFAULT_DECODE_BYTES,
    DEFAULT_MAX_AUDIO_SECONDS,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_VIDEO_FRAMES,
    DEFAULT_MAX_VIDEO_PIXELS,
    DEFAULT_TIMEOUT_S,
)
from sglang_ext.model_files import checkpoint_file
from worker_infra.heap import MAX_THRESHOLD

if TYPE_CHECKING:
    from worker_infra.embedding_store import EmbeddingStore

MODES = ("encode", "language")
DEFAULT_SEGMENT_BYTES = 512 << 20
DEFAULT_STORE_TIMEOUT_S = 2.0
MAX_STORE_HEADER_BYTES = 1 << 20
DEFAULT_MAX_IMAGES = 16  # per request, as an encoder takes per /encode
DEFAULT_MAX_BODY_BYTES = 64 << 20
DEFAULT_MMAP_THRESHOLD = 1 << 20  # see worker_infra.heap
# The encode worker's bootstrap port unless told: not one of SGLang's defaults (8998 its PD
# prefill's KV bootstrap, 8997 its encoder-only), so an encoder and a prefill can share a host.
ENCODE_BOOTSTRAP_PORT = 8996


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


def setting_kwargs(s: Setting, d: ConnectorConfig) -> dict:
    """``add_argument``'s keywords for a row of the settings table: its default is the value in
    effect in ``d`` (``ConnectorConfig.from_env()``: the environment, then the default)."""
    shown = "%(default)s" if s.shown is None else s.shown(d).replace("%", "%%")
    env = f", env {s.env}" if s.env else ""
    kwargs: dict[str, Any] = dict(type=s.type, default=getattr(d, s.name), help=f"{s.help}{env} (default {shown})")
    if s.metavar:
        kwargs["metavar"] = s.metavar
    if s.choices:
        kwargs["choices"] = list(s.choices)
    return kwargs


def _or_in_effect(s: Setting, d: ConnectorConfig) -> Callable[[Any], Any]:
    """SGLang's value of a setting's flag, or, where SGLang left it unset, the value in effect."""
    return lambda value: value or getattr(d, s.name)


def shared_flags(d: ConnectorConfig | None = None) -> tuple[SharedFlag, ...]:
    """The flags SGLang defines too, each once: our launcher's definitions and how the plugin
    reads SGLang's values for them. The connector's come from its settings table (``sglang=True``),
    with their values in effect in ``d`` (default: ``ConnectorConfig.from_env()``)."""
    d = ConnectorConfig.from_env() if d is None else d
    return (
        SharedFlag("--disaggregation-mode", dict(
            choices=MODES, default=None, help="encode: encoder + bootstrap server; language: SGLang's server fed "
            "by the connector (or, without --model-path, a transfer-only receiver) (or --encoder-only / "
            "--language-only, SGLang's names)"), None),
        SharedFlag("--encoder-only", dict(action="store_true", help="the same as --disaggregation-mode encode"), None),
        SharedFlag("--language-only", dict(action="store_true", help="the same as --disaggregation-mode language"),
                   None),
        SharedFlag("--encoder-urls", dict(
            nargs="+", default=None, metavar="URL", help="language side: encode workers (http://host:port) this "
            "worker sends the images of a request to itself (image_data in /generate, image_url parts in "
            "/v1/chat/completions), split by load, a failed part sent again to another encoder"),
            lambda urls: urls or None),
        SharedFlag("--port", dict(type=int, default=30000, help="HTTP port (default %(default)s)")),
        SharedFlag("--model-path", dict(default=None, help="checkpoint folder (config.json + safetensors): the "
                                        "encoder's model (required for an encode worker), the language server's model "
                                        "(without it a language worker is a transfer-only receiver)")),
        SharedFlag("--disaggregation-bootstrap-port", dict(
            type=int, default=ENCODE_BOOTSTRAP_PORT, help="encode side: port of the bootstrap server (default "
            "%(default)s; SGLang's PD prefill takes 8998 and its own encoder 8997)")),
        SharedFlag("--disaggregation-transfer-backend", dict(
            default="mooncake", choices=["mooncake"], help="transfer backend (default %(default)s)"), None),
        SharedFlag("--tp-size", dict(type=int, default=1, help="tensor parallel size (only 1 is supported)")),
        SharedFlag("--log-level", dict(default="info", choices=["debug", "info", "warning", "error"])),
        SharedFlag("--admin-api-key", dict(default=None, metavar="KEY", help="/sleep and /wake_up need "
                                           "'Authorization: Bearer KEY' (SGLang's flag; default: open)")),
        SharedFlag("--allowed-media-domains", dict(
            nargs="+", metavar="HOST", help="encode side: http(s) images only from these host names (then no "
            "address check)"), lambda hosts: hosts or None),
        SharedFlag("--device", dict(default=None, help="where the models run: cpu (default) or cuda")),
        *(SharedFlag(s.flag, setting_kwargs(s, d), _or_in_effect(s, d)) for s in SETTINGS if s.sglang and s.flag),
    )


def threshold_bytes(text: str) -> int:
    """A ``--malloc-mmap-threshold`` value: 0 (glibc's moving threshold) up to glibc's bound."""
    nbytes = int(text)
    if not 0 <= nbytes <= MAX_THRESHOLD:
        raise argparse.ArgumentTypeError(f"must be 0 to {MAX_THRESHOLD} bytes (glibc's bound), got {nbytes}")
    return nbytes


def add_worker_args(parser: argparse.ArgumentParser, with_shared: bool = True) -> None:
    """Add our flags; ``with_shared=False`` leaves out the ones SGLang already defines. A setting
    the environment gives wrong (a short ``SGLANG_EMBEDDING_CONTROL_SECRET``, a number that is not
    one) ends the start with argparse's one-line error."""
    try:
        d = ConnectorConfig.from_env()
    except ValueError as exc:
        parser.error(f"from the environment: {exc}")
    if with_shared:
        for shared in shared_flags(d):
            parser.add_argument(shared.flag, **shared.kwargs)
    e = parser.add_argument_group("language side (SGLang's server)")
    e.add_argument("--transfer-only", action="store_true",
                   help="no language model: receive each embedding a /generate names and answer its digest (the "
                        "connector alone, for transfer tests and benchmarks); the mode of a language worker "
                        "started without --model-path")
    e.add_argument("--image-embedding-cache-bytes", type=int, default=1 << 30, metavar="BYTES",
                   help="with --encoder-urls: image embeddings kept for images sent again (data: URIs, keyed by a "
                        "hash of the image bytes and the encoders' preprocessing), least recently used dropped "
                        "first; a 4K image's embedding is 75 MB at hidden 3584; 0 turns it off (default "
                        "%(default)s = 1 GiB)")
    e.add_argument("--max-images-per-request", type=int, default=DEFAULT_MAX_IMAGES, metavar="N",
                   help="language side (SGLang's server): a request with more images, or more videos, gets 400 before "
                        "any encoder is asked (SGLang's --limit-mm-data-per-request, which wins if given) (default "
                        "%(default)s)")
    e.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="language side (SGLang's server): a request body over this gets 413, from its Content-Length "
                        "before it is read, or as soon as a streamed body passes it (default %(default)s = "
                        f"{DEFAULT_MAX_BODY_BYTES >> 20} MiB: a few large data: images)")
    g = parser.add_argument_group("embedding transfer")
    g.add_argument("--hidden-size", type=int, default=None,
                   help=f"embedding width: the language model's hidden size, read from --model-path's config.json "
                        f"(else {d.hidden_size}); give it only to override")
    for s in SETTINGS:  # the connector's settings table, less the flags SGLang defines too
        if s.flag and not s.sglang:
            g.add_argument(s.flag, **setting_kwargs(s, d))
    g.add_argument("--allowed-bootstrap-hosts", nargs="+", default=[], metavar="HOST[:PORT]",
                   help="language side: the encoders a /generate may name by bootstrap_host/bootstrap_port (the "
                        "two-request flow, off unless given; --encoder-urls does not open it); any other gets 403 "
                        "before it is contacted")
    g.add_argument("--checkpoint-dir", default=None,
                   help="also write sleep checkpoints here (safetensors + JSON + checksum); a worker started with a "
                        "checkpoint in it boots asleep and continues the requests on /wake_up")
    g.add_argument("--queue-while-sleeping", action="store_true",
                   help="requests that arrive while asleep wait for the wake-up instead of getting 503")
    c = parser.add_argument_group("the cluster's embedding cache (Mooncake Store; off unless --mm-global-cache-master)")
    c.add_argument("--mm-global-cache-master", default=None, metavar="HOST:PORT",
                   help="Mooncake master of the embedding cache every encode worker and language server of the "
                        "cluster shares (its RPC port, 50051 by default): an image, video or clip any encoder has "
                        "encoded is read from it, not encoded again; see docs/global_cache.md (default: off)")
    c.add_argument("--mm-global-cache-metadata", default="P2PHANDSHAKE", metavar="URL",
                   help="the store's transfer-engine metadata: P2PHANDSHAKE (peers tell each other, nothing to run) "
                        "or a metadata server's URL, e.g. the master's own (http://MASTER:8080/metadata with "
                        "mooncake_master --enable_http_metadata_server=true) (default %(default)s)")
    c.add_argument("--mm-global-cache-segment-bytes", type=int, default=DEFAULT_SEGMENT_BYTES, metavar="BYTES",
                   help="host memory this worker lends the store for entries (0: none; it reads and writes in "
                        "others') (default %(default)s)")
    c.add_argument("--mm-global-cache-timeout", type=float, default=DEFAULT_STORE_TIMEOUT_S, metavar="SECONDS",
                   help="bound of each call to the store (a lookup, a write, the set-up): past it the cache counts "
                        "as unavailable for a few seconds and media are encoded without it (default %(default)s)")
    env_only = [f"{s.env}: {s.help} (default {getattr(d, s.name)})" for s in SETTINGS if s.env and not s.flag]
    parser.add_argument_group("connector settings given by environment variable only", "; ".join(env_only))
    h = parser.add_argument_group("memory")
    h.add_argument("--malloc-mmap-threshold", type=threshold_bytes, default=DEFAULT_MMAP_THRESHOLD, metavar="BYTES",
                   help="glibc's heap: allocations above this get mappings of their own, given back to the system "
                        "when freed, so images and embeddings of varied sizes do not leave the heap fragmented and "
                        "resident memory rising request after request; 0 keeps glibc's moving threshold; "
                        "MALLOC_MMAP_THRESHOLD_ in the environment wins (default %(default)s = 1 MiB)")
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
    m.add_argument("--image-max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="per image or video (default %(default)s)")
    m.add_argument("--max-video-frames", type=int, default=DEFAULT_MAX_VIDEO_FRAMES,
                   help="per video, counted in its container before any is decoded (the encoder samples at most "
                        "768 of them, at 2 per second by default) (default %(default)s)")
    m.add_argument("--max-video-pixels", type=int, default=DEFAULT_MAX_VIDEO_PIXELS,
                   help="per video, all its frames' pixels (frames x width x height): what decoding the frames "
                        "sampled can cost, as each decodes the frames from the keyframe before it (default "
                        "%(default)s: 4,000 frames of 1920x1080)")
    m.add_argument("--max-audio-seconds", type=float, default=DEFAULT_MAX_AUDIO_SECONDS,
                   help="per audio clip, from its header before any sample is decoded (Qwen2-Audio's encoder "
                        "takes 30 s) (default %(default)s)")
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
        path = checkpoint_file(args.model_path, "config.json", getattr(args, "revision", None))
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
            width = _config_width(config)
        except (OSError, ValueError, AttributeError) as exc:
            raise SystemExit(f"error: cannot read the embedding width from {path}: {exc}") from None
        if not isinstance(width, int) or width <= 0:
            raise SystemExit(f"error: {path} names no hidden_size; pass --hidden-size")
        return width
    return ConnectorConfig.hidden_size


def _config_width(config: dict) -> int | None:
    """A checkpoint's embedding width: the vision tower's output, times (1 + deepstack layers)
    where the tower also hands its intermediate layers to the language model (Qwen3-VL: SGLang's
    encoder sends them side by side in one row), else the language model's hidden size."""
    vision = config.get("vision_config") or {}
    deepstack = vision.get("deepstack_visual_indexes") or []
    if isinstance(vision.get("out_hidden_size"), int):
        return vision["out_hidden_size"] * (1 + len(deepstack))
    return (config.get("text_config") or {}).get("hidden_size") or config.get("hidden_size")


def connector_config(args: argparse.Namespace) -> ConnectorConfig:
    """The connector's configuration: each setting of the table from its flag's value in ``args``
    (a setting with no flag from its environment variable), the width from :func:`embedding_width`."""
    if args.tp_size != 1:
        raise SystemExit(f"--tp-size {args.tp_size}: only 1 is supported by the encode/language workers")
    return ConnectorConfig.from_env(hidden_size=embedding_width(args),
                                    **{s.name: getattr(args, s.dest) for s in SETTINGS if s.flag})


def global_cache(args: argparse.Namespace, config: ConnectorConfig) -> EmbeddingStore | None:
    """The cluster's embedding cache ``--mm-global-cache-*`` ask for (None: off), not connected yet.
    An entry is at most one pool's worth of rows (what a language worker could take)."""
    master = getattr(args, "mm_global_cache_master", None)
    if not master:
        return None
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"error: --mm-global-cache-master {master!r}: give HOST:PORT (the master's RPC port)")
    if args.mm_global_cache_segment_bytes < 0 or args.mm_global_cache_timeout <= 0:
        raise SystemExit("error: --mm-global-cache-segment-bytes must be 0 or more, --mm-global-cache-timeout "
                         "more than 0")
    # here, not at the top: the plugin imports this module in processes that must not import
    # prometheus_client before SGLang sets its multiprocess folder
    from worker_infra.embedding_store import EmbeddingStore, StoreSettings

    row_bytes = config.hidden_size * DTYPE_SIZES[config.dtype]
    return EmbeddingStore(StoreSettings(
        master=master, metadata=args.mm_global_cache_metadata,
        local_host=config.public_host, segment_bytes=args.mm_global_cache_segment_bytes,
        timeout_s=args.mm_global_cache_timeout, secret=config.secret,
        max_entry_bytes=config.num_blocks * config.block_size * row_bytes + MAX_STORE_HEADER_BYTES))
