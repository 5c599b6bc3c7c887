"""Our language mode written as SGLang's flags, with the defaults it needs that SGLang's lack.

``python -m sglang.launch_server --disaggregation-mode language ...`` becomes SGLang's
language-only mode with the ``zmq_to_tokenizer`` transfer backend (the plugin re-parses the
result, so SGLang validates its own configuration). Where the user left them out:

* on a CPU, ``--attention-backend torch_native`` (the portable one) and ``--device cpu``;
* on a CPU, ``--sleep-on-idle`` and ``--enable-mixed-chunk`` (:data:`CPU_SCHEDULING`);
* on a CPU, ``--max-total-tokens`` sized to the machine (:func:`cpu_kv_tokens`): SGLang sizes
  its KV pool on a CPU from a fraction of all host memory (6.3 M tokens, 15 GB resident, for the
  seeded 2-layer model on a 24 GiB machine), which leaves no room for a second server or for a
  restart while the old process exits; on a GPU SGLang's own sizing stands;
* ``--limit-mm-data-per-request {"image": N, "video": N, "audio": N}`` from ``--max-images-per-request``:
  SGLang refuses a request over it (400) before its media reach our receiver, so before any
  encoder is asked (the receiver counts again after flattening nested lists);
* ``--skip-server-warmup`` when the server starts asleep on a disk checkpoint: SGLang's warm-up
  is a generation, which a sleeping server refuses (503), and SGLang ends itself when its warm-up
  fails.

With one rank (``--tp-size 1``, ``--pp-size 1``) SGLang's scheduler would still open a
torch.distributed TCP store, listening on every interface whatever ``--host`` says (torch's store
takes no bind address); :func:`distributed_init_method` gives it a file store instead, which
opens no port.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import tempfile

from sglang_ext.model_files import checkpoint_file

# Our mode's flags that SGLang's language-only mode is given instead.
OUR_MODE_FLAGS = ("--disaggregation-mode", "--language-only", "--encoder-transfer-backend")
SGLANG_FLAGS = ("--language-only", "--encoder-transfer-backend", "zmq_to_tokenizer")
# On a CPU (docs/scheduling.md): the scheduler sleeps while idle (else it busy-polls a whole core,
# one the encoders on the same host need while it waits for their embeddings), and running
# requests decode within every prefill chunk (else each waits out every chunk of a long prompt).
CPU_SCHEDULING = ("--sleep-on-idle", "--enable-mixed-chunk")
CPU_KV_MEMORY_SHARE = 8  # on a CPU, the KV pool takes at most 1/8 of the machine's memory
CPU_KV_CONTEXTS = 4  # ... and at most 4 of the model's context lengths
GENERATIONS_ROLE = "sglang"  # the disk checkpoint of SGLang's generations (sglang_ext.generations)
DIST_INIT_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"  # SGLang's own override of its store's address


def sglang_argv(argv: list[str], ours: argparse.Namespace) -> list[str]:
    """``argv`` with our language mode written as SGLang's language-only mode, plus the defaults
    of the module docstring (each only where the user gave no value of their own)."""
    out = without_flags(argv, OUR_MODE_FLAGS, valueless=("--language-only",)) + list(SGLANG_FLAGS)
    if ours.pd_role is not None:  # SGLang's PD prefill, fed by our connector
        out += ["--disaggregation-mode", ours.pd_role]
    if on_cpu(argv):
        out += cpu_backend(argv)
        # a prefill holds no decode batch for a prefill chunk to carry along
        scheduling = CPU_SCHEDULING if ours.pd_role is None else ("--sleep-on-idle",)
        out += [flag for flag in scheduling if flag not in argv]
        if ours.pd_role is not None:
            from sglang_ext.pd import cpu_environment

            cpu_environment(ours.pd_role)
    if ours.kv_budget is not None:  # kv_default's
        out += ["--max-total-tokens", str(ours.kv_budget.tokens)]
    if flag_value(argv, "--limit-mm-data-per-request") is None:
        cap = ours.max_images_per_request
        out += ["--limit-mm-data-per-request", json.dumps({"image": cap, "video": cap, "audio": cap})]
    if starts_asleep(ours) and "--skip-server-warmup" not in argv:
        out.append("--skip-server-warmup")
    return out


def cpu_backend(argv: list[str]) -> list[str]:
    """The portable attention backend and the CPU device, each where ``argv`` names none."""
    out = []
    if flag_value(argv, "--attention-backend") is None:
        out += ["--attention-backend", "torch_native"]
    if flag_value(argv, "--device") is None:
        out += ["--device", "cpu"]
    return out


def kv_default(argv: list[str], ours: argparse.Namespace) -> KVBudget | None:
    """The KV pool our mode picks: on a CPU without ``--max-total-tokens`` only."""
    if not on_cpu(argv) or flag_value(argv, "--max-total-tokens") is not None or not ours.model_path:
        return None
    return cpu_kv_tokens(ours.model_path)


def on_cpu(argv: list[str]) -> bool:
    """``--device cpu``, or no ``--device`` on a machine without a GPU."""
    return (flag_value(argv, "--device") or ("cuda" if _has_gpu() else "cpu")) == "cpu"


def starts_asleep(ours: argparse.Namespace) -> bool:
    """A server started on a disk checkpoint of SGLang's generations boots asleep. (Runs before
    SGLang sets up its metrics: nothing that imports prometheus-client may be imported here, or
    this process's metrics would miss SGLang's multiprocess files.)"""
    from connector import checkpoint

    return bool(ours.checkpoint_dir) and checkpoint.exists(ours.checkpoint_dir, GENERATIONS_ROLE)


@dataclasses.dataclass(frozen=True)
class KVBudget:
    """The KV pool our mode gives SGLang on a CPU, and why."""

    tokens: int
    bytes_per_token: int
    memory: int  # the machine's, in bytes
    context: int  # the model's context length, in tokens

    def describe(self) -> str:
        return (f"{self.tokens} tokens = {self.tokens * self.bytes_per_token / 2**20:.0f} MiB at "
                f"{self.bytes_per_token} B/token: the smaller of 1/{CPU_KV_MEMORY_SHARE} of "
                f"{self.memory / 2**30:.1f} GiB of memory and {CPU_KV_CONTEXTS} x the {self.context}-token context")


def cpu_kv_tokens(model_path: str, memory: int | None = None) -> KVBudget:
    """The KV pool for ``model_path``'s language model on a CPU: the smaller of what fits in
    1/8 of the machine's memory (its cgroup limit, if lower) and 4 context lengths.
    Bytes per token = 2 (K and V) x layers x KV heads x head dim x dtype size."""
    with open(checkpoint_file(model_path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    text = config.get("text_config") or config
    layers = text["num_hidden_layers"]
    heads = text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    per_token = 2 * layers * kv_heads * head_dim * (4 if dtype in ("float32", "float") else 2)
    context = text.get("max_position_embeddings") or 32768
    memory = memory or machine_memory()
    tokens = min(memory // CPU_KV_MEMORY_SHARE // per_token, CPU_KV_CONTEXTS * context)
    return KVBudget(int(tokens), per_token, memory, context)


def machine_memory() -> int:
    """Physical memory, or this process's cgroup limit where that is lower."""
    import psutil

    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def distributed_init_method(argv: list[str]) -> None:
    """One rank and no address asked for: SGLang's scheduler initialises torch.distributed on a
    file store in a private temporary folder (no listening socket) instead of a TCP store on
    every interface; the environment carries it to the scheduler process."""
    ranks = int(flag_value(argv, "--tp-size") or flag_value(argv, "--tp") or 1) * int(
        flag_value(argv, "--pp-size") or flag_value(argv, "--pp") or 1)
    if ranks != 1 or flag_value(argv, "--dist-init-addr") is not None or os.environ.get(DIST_INIT_ENV):
        return
    folder = tempfile.mkdtemp(prefix="epd-dist-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ[DIST_INIT_ENV] = f"file://{os.path.join(folder, 'store')}"


def without_flags(argv: list[str], flags: tuple[str, ...], valueless: tuple[str, ...] = ()) -> list[str]:
    """``argv`` less each of ``flags`` and its value (``valueless`` ones take none)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg and name not in valueless
            continue
        out.append(arg)
    return out


def flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
