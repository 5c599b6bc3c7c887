"""Our encode mode written as the flags of SGLang's own encoder (``--encoder-only``), which the
encode worker runs in its process (:mod:`embedding_side.sglang_encoder`).

``python -m sglang.launch_server --disaggregation-mode encode ...`` keeps every SGLang flag the
user gave (model, dtype, ``--mm-attention-backend``, ``--mm-process-config``, ...); the mode flags
become ``--encoder-only`` with the ``zmq_to_tokenizer`` backend (the transfer is ours, so none of
SGLang's backends is ever started: ``mooncake`` would open a second transfer engine), and on a
CPU ``--device cpu``. The plugin parses the result with SGLang's own parser, so SGLang validates
it (an architecture its encoder does not serve is refused there, with SGLang's message).
"""

from __future__ import annotations

import argparse

from sglang_ext.language_flags import flag_value, on_cpu, without_flags

OUR_MODE_FLAGS = ("--disaggregation-mode", "--encoder-only", "--encoder-transfer-backend",
                  "--disaggregation-transfer-backend")
# An encoder runs only the tower: it has no radix cache, and saying so keeps SGLang's hybrid
# families (Qwen3.5: linear-attention layers) from sizing one, whose state snapshots a CPU lacks.
SGLANG_FLAGS = ("--encoder-only", "--encoder-transfer-backend", "zmq_to_tokenizer", "--disable-radix-cache")


def encoder_argv(argv: list[str]) -> list[str]:
    """``argv`` with our encode mode written as SGLang's encoder-only mode."""
    out = without_flags(argv, OUR_MODE_FLAGS, valueless=("--encoder-only",)) + list(SGLANG_FLAGS)
    if on_cpu(argv) and flag_value(argv, "--device") is None:
        out += ["--device", "cpu"]
    return out


def standalone_server_args(args: argparse.Namespace):
    """SGLang's parsed encoder flags for a worker built from our own parser (the in-process tests),
    which has only ``--model-path`` and ``--device`` of them."""
    from sglang.srt.server_args import ServerArgs

    argv = ["--model-path", args.model_path, "--host", args.host]
    if args.device:
        argv += ["--device", args.device]
    # SGLang's parser, not its prepare_server_args: the plugin's hook there would take
    # --encoder-only for our own mode again
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(encoder_argv(argv)))
