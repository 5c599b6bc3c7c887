"""SGLang plugin (entry point group ``sglang.srt.plugins``): ``--disaggregation-mode encode|language``.

Two hooks on public-facing SGLang functions decide the mode:

* after ``ServerArgs.add_cli_args(parser)``: add ``encode`` and ``language`` to the
  ``--disaggregation-mode`` choices and our own flags (pool size, timeouts, ...);
* around ``prepare_server_args(argv)``: when the parsed mode is one of ours (or upstream's
  ``--encoder-only`` / ``--language-only``, taken as ``encode`` / ``language``), map the flags
  SGLang parsed onto a worker configuration and run our worker instead of SGLang's server;
  every other mode gets SGLang's own result untouched.

The language mode's hooks on SGLang's tokenizer manager live in
:mod:`sglang_ext.language_server`; one more, in every mode, gives SGLang's ``torch_native``
attention backend (the CPU one) an extend without padded queries
(:mod:`sglang_ext.cpu.attention`), another SGLang's vision attention on a CPU a mask-free
one (:mod:`sglang_ext.cpu.vision_attention`), one, on a CPU without bf16 arithmetic, its linear
layers' bf16 products on float32 copies (:mod:`sglang_ext.cpu.gemm`), one Qwen2-Audio's encoder the padding mask
upstream leaves out (:mod:`sglang_ext.qwen2_audio_mask`, on every device), and one leaves the
language side's models without their vision or audio tower (:mod:`sglang_ext.no_encoder_tower`).

SGLang runs plugins in every process it starts (schedulers, detokenizers); there this costs a
version check and the registrations, and imports nothing of ours until a hook is called but the
table of the models whose towers the language side drops.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

SUPPORTED = ">=0.5.21,<0.6"
_MIN, _BELOW = (0, 5, 21), (0, 6)
OUR_MODES = ("encode", "language")
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
# The language mode's hooks, around these TokenizerManager methods: the function of
# sglang_ext.language_server that each one calls, where that module was armed (see there).
LANGUAGE_SERVER_HOOKS = {
    "generate_request": "around_generate_request",
    "init_disaggregation": "around_init_disaggregation",
    "abort_request": "around_abort_request",
    "pause_generation": "around_pause_generation",
    "continue_generation": "around_continue_generation",
}
OPENAI_REQUEST = "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request"
RESOLVED_DICT = "sglang.srt.server_args.ServerArgs.resolved_dict"  # what /server_info and the logs show
TORCH_NATIVE_EXTEND = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend."
                       "_run_sdpa_forward_extend")
VISION_SDPA = "sglang.srt.layers.attention.vision.VisionSdpaAttention.forward"  # the vision towers' CPU attention
UNQUANTIZED_LINEAR = "sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply"  # bf16 products on a CPU
# Qwen2-Audio's encoder without its padding mask upstream (sglang_ext/qwen2_audio_mask.py)
QWEN2_AUDIO_FEATURE = "sglang.srt.models.qwen2_audio.Qwen2AudioForConditionalGeneration.get_audio_feature"
# every batch's sampling seeded per request (sglang_ext/seeds.py), in our language mode
SAMPLING_BATCH_INFO = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch"
SEEDED_DRAW = "sglang.srt.layers.sampler.multinomial_with_seed"  # torch.compile'd: eager on a CPU
# the top-k/top-p draw: for a seeded batch, noise on token ids, not on ranks (sglang_ext/seeds.py)
FILTERED_DRAW = "sglang.srt.layers.sampler.top_k_top_p_min_p_sampling_from_probs_torch"
# SGLang's /freeze_gc call once warm: with --skip-server-warmup (a server booted asleep from disk)
# it came before uvicorn listened (connection refused, a traceback in the log)
FREEZE_GC = "sglang.srt.entrypoints.http_server._freeze_gc_after_server_warmup"
LISTEN_WAIT_S = 60.0
# a PD prefill's KV bootstrap queue, made in its scheduler (sglang_ext/pd.py: Mooncake's sender on a CPU)
PREFILL_QUEUE_INIT = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.__init__"
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

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.prepare_server_args", _around_prepare_server_args, HookType.AROUND)
    for method, name in LANGUAGE_SERVER_HOOKS.items():
        HookRegistry.register(f"{TOKENIZER_MANAGER}.{method}", _language_server_hook(name), HookType.AROUND)
    HookRegistry.register(TORCH_NATIVE_EXTEND, _around_torch_native_extend, HookType.AROUND)
    HookRegistry.register(VISION_SDPA, _around_vision_sdpa, HookType.AROUND)
    from sglang_ext.cpu.gemm import around_unquantized_linear, slow_bf16

    if slow_bf16():
        HookRegistry.register(UNQUANTIZED_LINEAR, around_unquantized_linear, HookType.AROUND)
    HookRegistry.register(QWEN2_AUDIO_FEATURE, _around_qwen2_audio_feature, HookType.AROUND)
    HookRegistry.register(OPENAI_REQUEST, _language_server_hook("around_openai_request"), HookType.AROUND)
    HookRegistry.register(RESOLVED_DICT, _after_resolved_dict, HookType.AFTER)
    HookRegistry.register(PREFILL_QUEUE_INIT, _after_prefill_queue_init, HookType.AFTER)
    HookRegistry.register(SAMPLING_BATCH_INFO, _after_sampling_batch_info, HookType.AFTER)
    HookRegistry.register(SEEDED_DRAW, _around_seeded_draw, HookType.AROUND)
    HookRegistry.register(FILTERED_DRAW, _around_filtered_draw, HookType.AROUND)
    HookRegistry.register(FREEZE_GC, _around_freeze_gc, HookType.AROUND)
    from sglang_ext.no_encoder_tower import TOWERS  # the models left without their towers on the language side

    for model, tower in TOWERS.items():
        HookRegistry.register(f"{model}.__init__", _after_model_init(tower), HookType.AFTER)
        HookRegistry.register(f"{model}.load_weights", _around_load_weights, HookType.AROUND)


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
    seen = requested(argv)
    if seen is not None and not seen.help:
        if seen.model_path:
            refuse_family(seen.model_path)
        else:  # a transfer-only receiver (or an encode worker's missing-model error): SGLang's parser needs a model
            from sglang_ext.launch_server import parse, run

            run(parse(argv))
            sys.exit(0)
    server_args = original(argv, *args, **kwargs)
    if our_mode(server_args) is None:
        from sglang_ext.language_flags import on_cpu
        from sglang_ext.pd import cpu_argv, cpu_environment, pd_role

        if (role := pd_role(argv)) is not None and on_cpu(argv):  # SGLang's own PD server, on a CPU
            refuse_language_model_on_cpu(server_args.model_path)
            cpu_environment(role)
            return original(cpu_argv(argv, role), *args, **kwargs)
        return server_args
    ours = worker_args(server_args, argv)
    if ours.disaggregation_mode == "language" and not ours.transfer_only:  # SGLang's own server, fed by our connector
        from sglang_ext.language_flags import on_cpu
        from worker_infra.heap import fix_mmap_threshold

        if on_cpu(argv):
            refuse_language_model_on_cpu(server_args.model_path)

        fix_mmap_threshold(ours.malloc_mmap_threshold)
        from sglang_ext import seeds
        from sglang_ext.language_flags import distributed_init_method, kv_default, sglang_argv
        from sglang_ext.language_server import arm
        from sglang_ext.redact import redact_command_line

        ours.kv_budget = kv_default(argv, ours)
        sglang_args = original(sglang_argv(argv, ours), *args, **kwargs)
        distributed_init_method(argv)
        sglang_args._launch_command = redact_command_line(sglang_args.launch_command)
        arm(ours)
        seeds.arm()
        return sglang_args
    if ours.disaggregation_mode == "encode":
        from sglang_ext.encoder_flags import encoder_argv

        ours.sglang_server_args = original(encoder_argv(argv), *args, **kwargs)  # SGLang's own encoder's
    from sglang_ext.launch_server import run

    run(ours)
    sys.exit(0)


def _language_server_hook(name: str):
    def hook(original, manager, *args, **kwargs):
        if sys.modules.get("sglang_ext.language_server") is None:  # nothing armed in this process
            return original(manager, *args, **kwargs)
        from sglang_ext import language_server

        return getattr(language_server, name)(original, manager, *args, **kwargs)

    hook.__qualname__ = f"epd_resume.{name}"
    return hook


def _after_prefill_queue_init(result, queue, *args, **kwargs) -> None:
    from sglang_ext.pd import after_prefill_queue_init

    after_prefill_queue_init(result, queue, *args, **kwargs)


def _after_resolved_dict(result, *args, **kwargs):
    from sglang_ext.redact import redact_fields

    return redact_fields(result)


def _after_sampling_batch_info(result, *args, **kwargs):
    from sglang_ext import seeds

    if not seeds.armed():  # another mode: SGLang's own sampling
        return result
    batch = kwargs.get("batch") or next(a for a in args if hasattr(a, "reqs"))  # args: (cls, batch, vocab_size)
    return seeds.seed_every_request(result, batch)


def _around_seeded_draw(original, *args, **kwargs):
    from sglang_ext.seeds import eager_on_cpu

    return eager_on_cpu(original, *args, **kwargs)


def _around_filtered_draw(original, *args, **kwargs):
    from sglang_ext.seeds import vocabulary_draw

    return vocabulary_draw(original, *args, **kwargs)


def _around_freeze_gc(original, server_args, *args, **kwargs):
    """SGLang's freeze of its GC once warm, asked of its own HTTP server: wait until that server
    answers (at most :data:`LISTEN_WAIT_S`), then ask."""
    import time

    import requests

    deadline = time.monotonic() + LISTEN_WAIT_S
    while time.monotonic() < deadline:
        try:
            requests.get(server_args.url() + "/is_sleeping", timeout=2, verify=False)
            break
        except requests.exceptions.RequestException:
            time.sleep(0.2)
    return original(server_args, *args, **kwargs)


def _around_torch_native_extend(original, *args, **kwargs):
    from sglang_ext.cpu.attention import extend_without_padding

    return extend_without_padding(original, *args, **kwargs)


def _around_qwen2_audio_feature(original, *args, **kwargs):
    from sglang_ext.qwen2_audio_mask import masked_audio_feature

    return masked_audio_feature(original, *args, **kwargs)


def _after_model_init(tower):
    def hook(_result, model, config, *args, **kwargs) -> None:
        from sglang_ext.no_encoder_tower import drop_tower

        drop_tower(tower, model, config)

    return hook


def _around_load_weights(original, model, weights, *args, **kwargs):
    from sglang_ext.no_encoder_tower import without_tower_weights

    return original(model, without_tower_weights(model, weights), *args, **kwargs)


def _around_vision_sdpa(original, *args, **kwargs):
    from sglang_ext.cpu.vision_attention import segmented_attention

    return segmented_attention(original, *args, **kwargs)


def refuse_family(model_path: str) -> None:
    """Exit with one line where our roles do not serve ``model_path``'s architecture
    (:mod:`sglang_ext.families`), before SGLang reads more than its config."""
    from sglang_ext.families import refusal
    from sglang_ext.model_files import local_config

    if (config := local_config(model_path)) and (reason := refusal(config)):
        raise SystemExit(f"error: {reason}")


def refuse_language_model_on_cpu(model_path: str) -> None:
    """Exit with one line where SGLang's CPU engine here cannot run ``model_path``'s language model
    (else it fails in its scheduler with a traceback)."""
    from sglang_ext.model_files import cpu_language_model_refusal

    if reason := cpu_language_model_refusal(model_path):
        raise SystemExit(f"error: {reason}")


def our_mode(server_args) -> str | None:
    """``encode`` or ``language`` when SGLang parsed one of our modes, or upstream's EPD flags
    ``--encoder-only`` / ``--language-only`` (aliases here; ``--disaggregation-mode prefill
    --language-only`` is our language side as SGLang's PD prefill); None for everything else."""
    if getattr(server_args, "encoder_only", False):
        return "encode"
    if getattr(server_args, "language_only", False):
        if server_args.disaggregation_mode == "decode":
            raise SystemExit("error: --language-only is for the server fed by encoders, a PD prefill's role: "
                             "a decode server takes its KV from the prefill; start it without --language-only")
        return "language"
    return server_args.disaggregation_mode if server_args.disaggregation_mode in OUR_MODES else None


def worker_args(server_args, argv: list[str]) -> argparse.Namespace:
    """Our worker's flags: SGLang's parsed values for shared things, ours parsed from ``argv``."""
    from sglang_ext.args import add_worker_args, shared_flags

    parser = argparse.ArgumentParser(add_help=False)
    add_worker_args(parser, with_shared=False)
    ours, _ = parser.parse_known_args(argv)
    # SGLang's PD role of our language side: there --disaggregation-transfer-backend is PD's KV
    # transfer, and our connector's protocol is --mooncake-protocol's alone
    ours.pd_role = server_args.disaggregation_mode if server_args.disaggregation_mode == "prefill" else None
    backend = server_args.disaggregation_transfer_backend
    if ours.pd_role is None:
        if backend not in BACKENDS:
            raise SystemExit(f"error: --disaggregation-transfer-backend {backend} is not supported in "
                             f"--disaggregation-mode {our_mode(server_args)}; use one of {sorted(BACKENDS)}")
        ours.mooncake_protocol = BACKENDS[backend] or ours.mooncake_protocol
    elif ours.checkpoint_dir:
        raise SystemExit("error: --checkpoint-dir is not supported on a PD prefill: its requests end at their "
                         "first token, and their generations live on the decode server")
    ours.disaggregation_mode = our_mode(server_args)
    for shared in shared_flags():
        if shared.from_sglang is not None:
            setattr(ours, shared.dest, shared.from_sglang(getattr(server_args, shared.dest, None)))
    if not any(a.split("=", 1)[0] == "--disaggregation-bootstrap-port" for a in argv):  # not SGLang's 8998
        from sglang_ext.args import ENCODE_BOOTSTRAP_PORT

        ours.disaggregation_bootstrap_port = ENCODE_BOOTSTRAP_PORT
    return ours


def requested(argv: list[str]) -> argparse.Namespace | None:
    """What ``argv`` asks of our modes before SGLang parses it (``model_path``, ``help``), or
    None when it asks for none of them (or is malformed: SGLang's parser says what is wrong)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--disaggregation-mode")
    parser.add_argument("--encoder-only", action="store_true")
    parser.add_argument("--language-only", action="store_true")
    parser.add_argument("--model-path", "--model")
    parser.add_argument("-h", "--help", action="store_true")
    try:
        seen, _ = parser.parse_known_args(argv)
    except SystemExit:
        return None
    ours = seen.disaggregation_mode in OUR_MODES or seen.encoder_only or seen.language_only
    return seen if ours else None

