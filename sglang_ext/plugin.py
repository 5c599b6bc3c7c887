"""SGLang plugin (entry point group ``sglang.srt.plugins``): ``--disaggregation-mode encode|language``.

Two hooks on public-facing SGLang functions, nothing else:

* after ``ServerArgs.add_cli_args(parser)``: add ``encode`` and ``language`` to the
  ``--disaggregation-mode`` choices and our own flags (pool size, timeouts, ...);
* around ``prepare_server_args(argv)``: when the parsed mode is one of ours (or upstream's
  ``--encoder-only`` / ``--language-only``, taken as ``encode`` / ``language``), map the flags
  SGLang parsed onto a worker configuration and run our worker instead of SGLang's server;
  every other mode gets SGLang's own result untouched.

SGLang runs plugins in every process it starts (schedulers, detokenizers); there this costs a
version check and two registrations, and imports nothing of ours.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

SUPPORTED = ">=0.5.21,<0.6"
_MIN, _BELOW = (0, 5, 21), (0, 6)
OUR_MODES = ("encode", "language")
HOOK_TARGETS = ("sglang.srt.server_args.ServerArgs.add_cli_args", "sglang.srt.server_args.prepare_server_args",
                "sglang.srt.managers.tokenizer_manager.TokenizerManager.init_disaggregation",
                "sglang.srt.managers.tokenizer_manager.TokenizerManager.abort_request",
                "sglang.srt.managers.tokenizer_manager.TokenizerManager.pause_generation",
                "sglang.srt.managers.tokenizer_manager.TokenizerManager.continue_generation")
# SGLang transfer backends and the Mooncake protocol each maps to (None: from --mooncake-protocol)
BACKENDS = {"mooncake": None, "mooncake_tcp": "tcp"}

log = logging.getLogger(__name__)


def supported_version(version: str) -> bool:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return _MIN <= tuple(parts) < _BELOW


def register() -> None:
    """Entry point SGLang calls once per process."""
    version = metadata.version("sglang")
    if not supported_version(version):
        _unsupported(f"SGLang {version} is installed; epd-resume supports sglang{SUPPORTED}")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGETS[0], _after_add_cli_args, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS[1], _around_prepare_server_args, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS[2], _around_init_disaggregation, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS[3], _after_abort_request, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS[4], _around_pause_generation, HookType.AROUND)
    HookRegistry.register(HOOK_TARGETS[5], _around_continue_generation, HookType.AROUND)


def _unsupported(message: str) -> None:
    """One clear error instead of a traceback from inside SGLang; fatal only if our mode was asked for."""
    wanted = any(a in (*OUR_MODES, "--encoder-only", "--language-only") for a in sys.argv) or any(
        a.endswith(("=encode", "=language")) for a in sys.argv)
    if wanted:
        raise SystemExit(f"error: --disaggregation-mode encode|language unavailable: {message}")
    log.error("epd-resume plugin inactive: %s", message)


def _after_add_cli_args(_result, parser: argparse.ArgumentParser, *args, **kwargs) -> None:
    from sglang_ext.args import add_worker_args

    for action in parser._actions:
        if action.dest == "disaggregation_mode" and action.choices is not None:
            action.choices = list(action.choices) + [m for m in OUR_MODES if m not in action.choices]
            action.help = (action.help or "") + (" 'encode' / 'language': encoder/language disaggregation with "
                                                 "resumable embedding transfers (epd-resume)")
    if not any(a.dest == "embedding_cache_buffer_size" for a in parser._actions):
        add_worker_args(parser, with_shared=False)


def _around_prepare_server_args(original, argv, *args, **kwargs):
    server_args = original(argv, *args, **kwargs)
    if our_mode(server_args) is None:
        return server_args
    ours = worker_args(server_args, argv)
    if ours.language_backend == "sglang":  # SGLang's own server, fed by our connector
        from sglang_ext.language_server import arm, sglang_argv

        sglang_args = original(sglang_argv(argv), *args, **kwargs)
        arm(ours)
        return sglang_args
    from sglang_ext.launch_server import run

    run(ours)
    sys.exit(0)


def _around_init_disaggregation(original, manager, *args, **kwargs):
    if sys.modules.get("sglang_ext.language_server") is None:  # nothing armed in this process
        return original(manager, *args, **kwargs)
    from sglang_ext.language_server import around_init_disaggregation

    return around_init_disaggregation(original, manager, *args, **kwargs)


def _after_abort_request(result, manager, *args, **kwargs):
    if sys.modules.get("sglang_ext.language_server") is not None:
        from sglang_ext.language_server import after_abort_request

        return after_abort_request(result, manager, *args, **kwargs)
    return result


def _around_pause_generation(original, manager, *args, **kwargs):
    if sys.modules.get("sglang_ext.language_server") is None:
        return original(manager, *args, **kwargs)
    from sglang_ext.language_server import around_pause_generation

    return around_pause_generation(original, manager, *args, **kwargs)


def _around_continue_generation(original, manager, *args, **kwargs):
    if sys.modules.get("sglang_ext.language_server") is None:
        return original(manager, *args, **kwargs)
    from sglang_ext.language_server import around_continue_generation

    return around_continue_generation(original, manager, *args, **kwargs)


def our_mode(server_args) -> str | None:
    """``encode`` or ``language`` when SGLang parsed one of our modes, or upstream's EPD flags
    ``--encoder-only`` / ``--language-only`` (aliases here); None for everything else."""
    if getattr(server_args, "encoder_only", False):
        return "encode"
    if getattr(server_args, "language_only", False):
        return "language"
    return server_args.disaggregation_mode if server_args.disaggregation_mode in OUR_MODES else None


def worker_args(server_args, argv: list[str]) -> argparse.Namespace:
    """Our worker's flags: SGLang's parsed values for shared things, ours parsed from ``argv``."""
    from connector.config import ConnectorConfig
    from sglang_ext.args import add_worker_args

    parser = argparse.ArgumentParser(add_help=False)
    add_worker_args(parser, with_shared=False)
    ours, _ = parser.parse_known_args(argv)
    backend = server_args.disaggregation_transfer_backend
    if backend not in BACKENDS:
        raise SystemExit(f"error: --disaggregation-transfer-backend {backend} is not supported in "
                         f"--disaggregation-mode {our_mode(server_args)}; use one of {sorted(BACKENDS)}")
    ours.mooncake_protocol = BACKENDS[backend] or ours.mooncake_protocol
    ours.disaggregation_mode = our_mode(server_args)
    ours.host, ours.port = server_args.host, server_args.port
    ours.model_path = server_args.model_path
    ours.device, ours.max_total_tokens = server_args.device, server_args.max_total_tokens
    ours.disaggregation_bootstrap_port = server_args.disaggregation_bootstrap_port
    ours.disaggregation_ib_device = server_args.disaggregation_ib_device or ""
    ours.tp_size = server_args.tp_size
    ours.log_level = server_args.log_level
    ours.max_queued_requests = server_args.max_queued_requests or ConnectorConfig.from_env().max_queued_requests
    ours.allowed_media_domains = server_args.allowed_media_domains or None
    ours.encoder_urls = getattr(server_args, "encoder_urls", None) or None
    if ours.language_backend is None:
        ours.language_backend = "native" if ours.disaggregation_mode != "language" or ours.language_model == "none" \
            or not ours.model_path else "sglang"
    if ours.language_backend == "sglang" and ours.language_model == "none":
        raise SystemExit("error: --language-model none (transfer-only) runs on --language-backend native")
    return ours
