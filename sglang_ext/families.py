"""The architectures SGLang accepts for encoder disaggregation that this plugin refuses, each with
its reason, before SGLang loads anything (the outcome of every listed one: docs/sglang_encoder.md).

A refused architecture has no check here that the encoder's rows and the language server's ids
equal a reference implementation's, or a known fault on this engine; serving it unchecked could
send wrong rows without an error. SGLang's own EPD, without this plugin, is untouched.
"""

from __future__ import annotations

import json

_UNCHECKED = "transformers has no implementation of it to check the encoder's rows and the ids against"
_MLA = ("its language model's multi-head latent attention gives wrong tokens on SGLang's CPU attention backend "
        "(torch_native has no MLA path: an uncached prefill takes the un-absorbed one)")
_OMNI = ("a thinker with vision and audio towers whose encode path (audio in video, the towers' interleaved rows) "
         "this plugin does not carry yet")
REFUSED: dict[str, str] = {
    "Qwen2_5OmniForConditionalGeneration": _OMNI,
    "Qwen3OmniMoeForConditionalGeneration": _OMNI,
    "KimiVLForConditionalGeneration": f"its config and processor are hub remote code, and {_UNCHECKED}",
    "KimiK25ForConditionalGeneration": f"its processor is hub remote code, and {_MLA}",
    "KimiK3ForConditionalGeneration": _UNCHECKED,
    "Glm5NextForConditionalGeneration": _MLA,
    "MiMoV2ForCausalLM": _UNCHECKED,
    "MuseSparkForConditionalGeneration": _UNCHECKED,
    "InternS2PreviewForConditionalGeneration": _UNCHECKED,
    "Dots3NoteForCausalLM": _UNCHECKED,
}


def architecture(config_path: str) -> str | None:
    """The first architecture ``config.json`` names (None when it cannot be read or names none)."""
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    names = config.get("architectures") if isinstance(config, dict) else None
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def refusal(config_path: str) -> str | None:
    """One line saying why this plugin does not serve the checkpoint of ``config_path``, or None."""
    name = architecture(config_path)
    if name not in REFUSED:
        return None
    return (f"{name} is not served by epd-resume's encode or language role: {REFUSED[name]}; "
            f"SGLang's own EPD serves it without this plugin (SGLANG_PLUGINS=none)")
