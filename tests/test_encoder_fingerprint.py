"""An encoder's fingerprint (its ``/health`` ``preprocessing``: the second half of every cache key,
per server and in the cluster's store) binds what made the rows: the loaded weights by content,
the model's class and config, dtype, the processor's settings and every preprocessing setting,
flag or environment variable. Checkpoints are named by folder or by hub id (from an offline
Hugging Face cache, as SGLang resolves them): the same weights share a fingerprint wherever they
lie, one changed tower weight or one preprocessing setting does not. And the README's multi-host
lines run on hub ids: an encoder and SGLang's language server on ``probe/a`` answer transformers'
greedy ids."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sglang_stack import (
    encode_worker,
    encoder_health,
    generate_as_reference,
    image_reference,
    language_server,
    write_images,
)

from harness import hub_cache
from harness.workers import WorkerProcess, start_together

pytestmark = pytest.mark.sglang

MM_PROCESS_CONFIG = json.dumps({"vision_config": {"image": {"max_pixels": 200704}}})


# SGLang's own command, in a process of its own (not forked from the suite's warm launcher), so the
# environment is read where SGLang's modules are imported, as on a deployed host
SGLANG_SERVE = (str(Path(sys.executable).parent / "sglang"), "serve")


def one_tower_weight_changed(source: str, target: Path) -> str:
    """A copy of ``source`` in which one element of the vision tower's patch embedding moved."""
    shutil.copytree(source, target, copy_function=shutil.copyfile)
    [weights] = target.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if "visual" in k and "patch_embed" in k)
    flat = tensors[name].view(-1)
    flat[0] = flat[0] + torch.tensor(0.25, dtype=flat.dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    return str(target)


@pytest.fixture(scope="module")
def folder(seeded_checkpoint) -> str:
    return seeded_checkpoint(256, layers=2)


@pytest.fixture(scope="module")
def encoders(folder, tmp_path_factory):  # noqa: ANN201
    """Encoders by name: ``a`` on the folder, ``copy`` on a copy of it elsewhere with other mtimes,
    ``b`` on a copy with one tower weight changed, ``hub-a`` and ``hub-b`` on those two as hub ids,
    ``mm`` on the folder with another ``--mm-process-config``, ``env`` on it with another
    ``VIDEO_MAX_PIXELS`` (in a fresh process: SGLang reads it at import)."""
    root = tmp_path_factory.mktemp("fingerprints")
    copy = shutil.copytree(folder, root / "copy", copy_function=shutil.copyfile)
    os.utime(Path(copy) / "config.json", (1_000_000_000, 1_000_000_000))
    changed = one_tower_weight_changed(folder, root / "changed")
    hub_a = hub_cache.install(folder, "probe/fingerprint-a")
    hub_b = hub_cache.install(changed, "probe/fingerprint-b")
    starts = {"a": lambda: encode_worker(folder), "copy": lambda: encode_worker(str(copy)),
              "b": lambda: encode_worker(changed), "hub-a": lambda: encode_worker(hub_a),
              "hub-b": lambda: encode_worker(hub_b),
              "mm": lambda: encode_worker(folder, "--mm-process-config", MM_PROCESS_CONFIG),
              "env": lambda: WorkerProcess("encode", "--model-path", folder, command=SGLANG_SERVE,
                                           env={"VIDEO_MAX_PIXELS": "1000000"}, timeout=240)}
    started = dict(zip(starts, start_together(*starts.values()), strict=True))
    yield started
    for worker in started.values():
        worker.stop()


def fingerprint(worker: WorkerProcess) -> str:
    return encoder_health(worker)["preprocessing"]


def test_the_same_weights_share_a_fingerprint_wherever_they_lie(encoders) -> None:
    """A copy in another folder with other mtimes, and the same checkpoint as a hub id: one
    fingerprint, so their entries are shared."""
    assert fingerprint(encoders["copy"]) == fingerprint(encoders["a"]) == fingerprint(encoders["hub-a"])


def test_one_changed_tower_weight_never_shares_an_entry(encoders) -> None:
    """Same sizes, same config, one element of one tower tensor apart: other fingerprints, by folder
    and by hub id alike (and the two names of the changed checkpoint agree)."""
    assert fingerprint(encoders["b"]) == fingerprint(encoders["hub-b"])
    assert fingerprint(encoders["b"]) != fingerprint(encoders["a"])


def test_a_preprocessing_flag_or_environment_variable_stops_the_sharing(encoders) -> None:
    base = fingerprint(encoders["a"])
    assert fingerprint(encoders["mm"]) != base
    assert fingerprint(encoders["env"]) != base


def test_the_readmes_multi_host_lines_run_on_hub_ids(encoders, folder, tmp_path) -> None:
    """SGLang's language server on ``probe/fingerprint-a`` sending to the encoder on the same hub id
    answers transformers' greedy ids of the checkpoint; an unreadable ``--model-path`` is refused
    in one line that names it and says what to pass."""
    images = write_images(tmp_path)
    language = language_server("probe/fingerprint-a", [encoders["hub-a"].url])
    try:
        generate_as_reference(language, [images["448x448"]], "hub-id", image_reference(folder))
    finally:
        language.stop()
    with pytest.raises(RuntimeError) as refused:
        encode_worker("probe/not-in-the-cache", timeout=60)
    assert "--model-path 'probe/not-in-the-cache' is neither a folder nor a hub id" in str(refused.value)
    assert "pass a checkpoint folder" in str(refused.value)
