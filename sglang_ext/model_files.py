"""Files of a ``--model-path``: a checkpoint folder, or a Hugging Face hub id as SGLang takes it."""

from __future__ import annotations

import os


def checkpoint_file(model_path: str, name: str, revision: str | None = None) -> str:
    """The path of file ``name`` of checkpoint ``model_path``: a folder, or a Hugging Face hub id
    resolved as SGLang resolves it (the local cache first; only the cache with HF_HUB_OFFLINE=1).
    SystemExit naming the checkpoint and what to pass when it cannot be had."""
    if os.path.isdir(model_path):
        return os.path.join(model_path, name)
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(model_path, name, revision=revision)
    except Exception as exc:  # noqa: BLE001 - the hub's errors are many; each means "not here"
        raise SystemExit(
            f"error: --model-path {model_path!r} is neither a folder nor a hub id whose {name} can be read "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); pass a checkpoint folder "
            f"that holds {name}, or a hub id in the Hugging Face cache (HF_HOME, HF_HUB_OFFLINE=1 offline)") from None


def local_config(model_path: str) -> str | None:
    """The path of ``model_path``'s config.json where it is here without a download: in the folder,
    or in the Hugging Face cache for a hub id; None otherwise."""
    if os.path.isdir(model_path):
        return os.path.join(model_path, "config.json")
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model_path, "config.json")
    except Exception:  # noqa: BLE001 - not a valid hub id either
        return None
    return cached if isinstance(cached, str) else None


def cpu_language_model_refusal(model_path: str) -> str | None:
    """Why SGLang's CPU engine in this install cannot run the language model of ``model_path``, or
    None. Linear-attention layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) run on a CPU only through
    sgl_kernel's CPU kernels (``sgl_kernel.mamba``, imported by SGLang's linear-attention backend),
    which this install's CPU build lacks; the model's encode role needs none of them."""
    import importlib.util
    import json

    try:
        with open(checkpoint_file(model_path, "config.json")) as f:
            config = json.load(f)
    except (SystemExit, OSError, ValueError):  # no readable config: SGLang's own loading says what is wrong
        return None
    layer_types = (config.get("text_config") or config).get("layer_types") or []
    if "linear_attention" not in layer_types:
        return None
    try:
        if importlib.util.find_spec("sgl_kernel.mamba") is not None:
            return None
    except ImportError:  # sgl_kernel is this install's stand-in module, not the package
        pass
    architecture = (config.get("architectures") or [config.get("model_type", "this model")])[0]
    return (f"{architecture}'s language model has linear-attention layers, which SGLang runs on a CPU only with "
            f"sgl_kernel's CPU kernels (sgl_kernel.mamba), and this install has none: serve its language side on a "
            f"GPU (its encode role runs here)")
