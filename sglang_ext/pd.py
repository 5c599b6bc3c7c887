"""SGLang's prefill/decode (PD) servers in an E/P/D deployment: the defaults a CPU needs.

SGLang's PD runs on a GPU as shipped. On a CPU three of its paths need CUDA; where the device is
a CPU the plugin picks the CPU path instead (each only where the user set nothing of their own):

* the decode's retraction backup (``mem_cache/kv_cache_builder.py``) registers a host pool with
  CUDA: ``--disaggregation-decode-retraction-backup cpu_tensor`` keeps it in plain tensors;
* the prefill's KV sender for Mooncake says it takes page indices as a pinned host tensor made
  with a CUDA event (``MooncakeKVSender.supports_host_tensor_indices``, read by
  ``disaggregation/prefill.py``'s ``_send_kv_chunk``): with a CPU KV pool it is told it does not
  (:func:`after_prefill_queue_init`), so the indices go the plain way;
* the prefill's early send of a radix-cache hit records a CUDA event
  (``maybe_send_cached_prefix_chunk``): ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0``.

Both roles also get the CPU attention backend, the CPU device, a KV pool sized to the machine and
``--sleep-on-idle`` (a scheduler that polls takes a whole core, one the encoders need), as our
language mode does (:mod:`sglang_ext.language_flags`).
"""

from __future__ import annotations

import os

PD_ROLES = ("prefill", "decode")
EARLY_SEND_ENV = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"
RETRACTION_BACKUP = "--disaggregation-decode-retraction-backup"


def pd_role(argv: list[str]) -> str | None:
    """``prefill`` or ``decode`` when ``argv`` asks for one of SGLang's PD roles."""
    from sglang_ext.language_flags import flag_value

    role = flag_value(argv, "--disaggregation-mode")
    return role if role in PD_ROLES else None


def cpu_argv(argv: list[str], role: str) -> list[str]:
    """``argv`` with a PD role's CPU flags (the module docstring's), each only where the user gave none."""
    from sglang_ext.language_flags import cpu_backend, cpu_kv_tokens, flag_value

    out = [*argv, *cpu_backend(argv)]
    if flag_value(argv, "--max-total-tokens") is None and (model := flag_value(argv, "--model-path")):
        out += ["--max-total-tokens", str(cpu_kv_tokens(model).tokens)]
    if "--sleep-on-idle" not in argv:  # else its scheduler polls a whole core while it waits
        out.append("--sleep-on-idle")
    if role == "decode" and flag_value(argv, RETRACTION_BACKUP) is None:
        out += [RETRACTION_BACKUP, "cpu_tensor"]
    return out


def cpu_environment(role: str) -> None:
    """A prefill's environment default on a CPU, for the scheduler SGLang starts next."""
    if role == "prefill":
        os.environ.setdefault(EARLY_SEND_ENV, "0")


def after_prefill_queue_init(_result, queue, *args, **kwargs) -> None:
    """A PD prefill's bootstrap queue was made (in its scheduler): with its KV pool on a CPU,
    Mooncake's sender takes page indices as a plain tensor (the module docstring)."""
    if str(getattr(queue.token_to_kv_pool, "device", "cpu")) != "cpu":
        return
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    MooncakeKVSender.supports_host_tensor_indices = False
