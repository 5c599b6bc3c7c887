"""The language server holds no encoder tower: its image, video and audio embeddings come through
the connector.

In SGLang's language-only mode (ours: ``sglang_ext.language_flags``) the multimodal models still
build their encoder towers and load their weights (SGLang 0.5.23: ``models/qwen2_vl.py``, ``models/qwen2_5_vl.py``,
``models/qwen3_vl.py`` unless ``language_model_only``, which also turns off M-RoPE and deepstack,
so it is no switch for a multimodal language side; ``models/qwen2_audio.py``;
``models/minimax_m3_vl.py``). A plugin hook after each constructor drops the towers it built when
the config says language-only, before any weight is loaded, and a hook around its ``load_weights``
leaves the towers' checkpoint weights out (Qwen2-Audio's loader fails on a weight without a
parameter; the others skip it, MiniMax's after buffering its vision q/k/v). A tower's weights are
then never read and it can never run here: an item without a precomputed embedding (which the
receiver never hands over: ``sglang_ext.mm_receiver``) would fail on the missing tower instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tower:
    kind: str  # what it encodes, for the start log
    attributes: tuple[str, ...]  # the model's attributes holding it
    weights: tuple[str, ...]  # the prefixes of its checkpoint weights' names


# SGLang's model classes -> their towers (a subclass's constructor runs its base's, hook included)
TOWERS = {
    "sglang.srt.models.qwen2_vl.Qwen2VLForConditionalGeneration": Tower("vision", ("visual",), ("visual.",)),
    "sglang.srt.models.qwen2_5_vl.Qwen2_5_VLForConditionalGeneration": Tower("vision", ("visual",), ("visual.",)),
    "sglang.srt.models.qwen3_vl.Qwen3VLForConditionalGeneration": Tower("vision", ("visual",), ("visual.",)),
    "sglang.srt.models.qwen2_audio.Qwen2AudioForConditionalGeneration": Tower(
        "audio", ("audio_tower", "multi_modal_projector"), ("audio_tower.", "multi_modal_projector.")),
    "sglang.srt.models.minimax_m3_vl.MiniMaxM3SparseForConditionalGeneration": Tower(
        "vision", ("vision_tower",), ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")),
}
DROPPED = "_epd_dropped_tower"  # set on a model whose tower was dropped: its Tower


def drop_tower(tower: Tower, model, config) -> None:
    """After ``model.__init__(config, ...)``: no tower in a language-only model."""
    built = [name for name in tower.attributes if getattr(model, name, None) is not None]
    if not getattr(config, "language_only", False) or not built:
        return
    params = sum(p.numel() for name in built for p in getattr(model, name).parameters())
    for name in built:
        setattr(model, name, None)
    setattr(model, DROPPED, tower)
    log.info("language-only: %s built without its %s tower (%.1fM parameters never loaded)",
             type(model).__name__, tower.kind, params / 1e6)


def without_tower_weights(model, weights: Iterable[tuple[str, object]]) -> Iterable[tuple[str, object]]:
    """The checkpoint's weights, less the dropped tower's (named with or without a ``model.`` prefix)."""
    tower: Tower | None = getattr(model, DROPPED, None)
    if tower is None:
        return weights
    return ((name, w) for name, w in weights if not name.removeprefix("model.").startswith(tower.weights))
