"""The language server holds no vision tower: its image embeddings come through the connector.

In SGLang's language-only mode (ours: ``sglang_ext.language_flags``) Qwen2.5-VL and Qwen3-VL still
build their vision tower and load its weights (SGLang 0.5.23: ``models/qwen2_5_vl.py``, and
``models/qwen3_vl.py`` unless ``language_model_only``, which also turns off M-RoPE and deepstack,
so it is no switch for a multimodal language side). A plugin hook after each constructor drops
the tower it built (``visual = None``) when the config says language-only, before any weight is
loaded: both loaders skip a checkpoint weight that has no parameter. A tower's weights are then
never read and it can never run here: an item without a precomputed embedding (which the receiver
never hands over: ``sglang_ext.mm_receiver``) would fail on the missing tower instead.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def drop_vision_tower(_result, model, config, *args, **kwargs) -> None:
    """After ``model.__init__(config, ...)``: no tower in a language-only model."""
    if getattr(config, "language_only", False) and getattr(model, "visual", None) is not None:
        params = sum(p.numel() for p in model.visual.parameters())
        model.visual = None
        log.info("language-only: %s built without its vision tower (%.1fM parameters never loaded)",
                 type(model).__name__, params / 1e6)
