"""Write a complete seeded Qwen2.5-VL (or Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, or MiniMax-M3-VL: ``checkpoint_minimax.py``,
or Qwen2-Audio: ``checkpoint_qwen2_audio.py``) checkpoint folder: vision tower, language model, an offline tokenizer with the family's special
tokens and a chat template, and the image (and video) preprocessor configs.

Nothing can be downloaded here, so this folder stands in for a real checkpoint on both workers
(the encode worker loads its vision tower, the language worker its language model and
tokenizer). The weights are random (seeded): generated text means nothing, but tokens are
exact, so the disaggregated path can be compared with transformers' monolithic model. The
language model answers in 16 letters, each step's letter decided far above bf16 rounding and by
the media (:func:`decisive_language_model`), so that comparison can demand equal ids.

    python scripts/make_checkpoint.py /tmp/qwen-seeded [--hidden-size 2048] [--seed 0] [--layers 28]
    python scripts/make_checkpoint.py /tmp/qwen3-seeded --family qwen3_vl   # or qwen3_vl_moe
    python scripts/make_checkpoint.py /tmp/qwen2-seeded --family qwen2_vl
    python scripts/make_checkpoint.py /tmp/qwen3.5-seeded --family qwen3_5   # or qwen3_5_moe
    python scripts/make_checkpoint.py /tmp/minimax-seeded --family minimax_m3_vl
    python scripts/make_checkpoint.py /tmp/qwen2-audio-seeded --family qwen2_audio
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from checkpoint_minimax import write_minimax_m3_vl_checkpoint
from checkpoint_qwen2_audio import write_qwen2_audio_checkpoint
from checkpoint_text import TEXT_INIT, VOCAB_SIZE, decisive_language_model, write_tokenizer

# Qwen2.5-VL-7B's geometry: 14 px patches, 2x2 merge, 2 frames a patch in time, and the hub
# preprocessor_config's bounds (4 to 16384 merged tokens per image).
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 16384 * (PATCH * MERGE) ** 2

def small_tower_config(out_hidden_size: int) -> dict:
    """A seeded vision tower with Qwen2.5-VL-7B's geometry (112 px windows) and one narrow windowed
    block, so a 4K image encodes in about a second."""
    return dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=out_hidden_size,
                hidden_act="silu", patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                window_size=112, fullatt_block_indexes=[])


def model_config(hidden_size: int, ids: dict[str, int], layers: int = 1) -> dict:
    """A small Qwen2.5-VL: a small vision tower, and a language model of ``layers`` layers (one by
    default) whose width is the tower's output width."""
    heads = hidden_size // 128  # head_dim 128, as in Qwen2.5-VL-3B/7B
    text = {"vocab_size": VOCAB_SIZE, "hidden_size": hidden_size, "intermediate_size": 512, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 4 if heads % 4 == 0 else heads,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"], "initializer_range": TEXT_INIT}
    return {"text_config": text, "vision_config": small_tower_config(hidden_size),
            "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
            "tie_word_embeddings": False}


def write_checkpoint(folder: str | Path, hidden_size: int = 3584, seed: int = 0, layers: int = 1) -> Path:
    """The whole folder: config.json, model.safetensors (bf16), tokenizer files, chat template,
    preprocessor_config.json. ``hidden_size=512, layers=28`` gives Qwen2.5-VL-7B's KV per token
    (28 layers x 4 KV heads x head_dim 128, bf16: 56 KiB) in a model a CPU runs quickly."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    if hidden_size % 128:
        raise ValueError(f"hidden size {hidden_size} must be a multiple of 128 (head_dim 128)")
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder)
    config = Qwen2_5_VLConfig(**model_config(hidden_size, ids, layers))
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    decisive_language_model(model, "qwen2_5_vl", seed, layers)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    write_qwen2_processor(folder)
    return folder


def write_qwen2_processor(folder: Path) -> None:
    """Qwen2-VL's and Qwen2.5-VL's image processor config (14 px patches, the hub's pixel bounds)."""
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "merge_size": MERGE,
                    "temporal_patch_size": TEMPORAL, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
                    "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
                    "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255}
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))


# A small Qwen3-VL: 16 px patches, a learned position table, two deepstack layers (so SGLang's
# encoder sends rows of 256 x 3 = 768), and a language model of two layers (one per deepstack
# layer, which it adds to its first two layers' hidden states).
QWEN3_HIDDEN, QWEN3_PATCH = 256, 16
QWEN3_VISION = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=QWEN3_HIDDEN,
                    hidden_act="gelu_pytorch_tanh", patch_size=QWEN3_PATCH, spatial_merge_size=MERGE,
                    temporal_patch_size=TEMPORAL, num_position_embeddings=2304, deepstack_visual_indexes=[0, 1])


# Qwen3-VL-MoE's language model: 4 experts a layer, 2 a token (an expert's width unlike the
# model's, so that no expert matrix is square and its layout cannot be mistaken)
QWEN3_VL_MOE = {"num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                "decoder_sparse_step": 1}
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def write_hub_expert_layout(folder: Path) -> None:
    """The fused expert weights as the hub's Qwen3-VL-MoE checkpoints hold them ([experts, in, out]:
    what SGLang's loader and transformers' conversion on load both take); transformers saves them
    in its own [experts, out, in]."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(FUSED_EXPERTS)]:
        tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def qwen3_text_config(ids: dict[str, int], **fields) -> dict:
    """The small language model of the Qwen3-VL-style families (2 layers of 256, 2 heads of 128),
    with the tokenizer's special ids; ``fields`` add or override (rotary, layer kinds, experts)."""
    return {"vocab_size": VOCAB_SIZE, "hidden_size": QWEN3_HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "initializer_range": TEXT_INIT,
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
            **fields}


def qwen3_family_model(classes: tuple, ids: dict[str, int], text: dict, vision: dict, seed: int):  # noqa: ANN201
    """A seeded model of a Qwen3-VL-style family: ``classes`` (its config and model classes)
    built from ``text`` and ``vision`` configs, with the tokenizer's special ids."""
    import torch

    config_class, model_class = classes
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    return model_class(config).eval()


def write_qwen3_vl_checkpoint(folder: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """A seeded Qwen3-VL (``moe``: Qwen3-VL-MoE) folder (see :data:`QWEN3_VISION`), with its image
    and video processor configs."""
    import torch
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder)
    text = qwen3_text_config(ids, rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                                   "mrope_section": [24, 20, 20], "mrope_interleaved": True},
                             **(QWEN3_VL_MOE if moe else {}))
    classes = ((Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe
               else (Qwen3VLConfig, Qwen3VLForConditionalGeneration))
    model = qwen3_family_model(classes, ids, text, QWEN3_VISION, seed)
    decisive_language_model(model, "qwen3_vl_moe" if moe else "qwen3_vl", seed, 2)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    if moe:
        write_hub_expert_layout(folder)
    write_qwen3_processors(folder)
    return folder


def write_qwen3_processors(folder: Path) -> None:
    """Qwen3-VL's (and Qwen3.5's) image and video processor configs, for 16 px patches."""
    pixels = {"patch_size": QWEN3_PATCH, "merge_size": MERGE, "temporal_patch_size": TEMPORAL,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_resize": True, "do_rescale": True,
              "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255}
    factor = QWEN3_PATCH * MERGE  # Qwen3-VL's hub bounds: 64 to 16384 tokens per image
    image = {"image_processor_type": "Qwen2VLImageProcessor", **pixels,
             "size": {"shortest_edge": 64 * factor * factor, "longest_edge": 16384 * factor * factor}}
    video = {"video_processor_type": "Qwen3VLVideoProcessor", **pixels, "fps": 2, "min_frames": 4, "max_frames": 768,
             "do_sample_frames": True, "size": {"shortest_edge": 4096, "longest_edge": 25165824}}
    (folder / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=1))


# A small Qwen2-VL: its tower (14 px patches, 2D rotary, LayerNorm, QuickGELU, no windows) of one
# narrow block, and Qwen2.5-VL's small language model. ``in_chans`` as the hub's configs spell it
# (SGLang's model reads that name; transformers' is ``in_channels``).
QWEN2_VISION = dict(depth=1, embed_dim=64, num_heads=2, mlp_ratio=2, hidden_act="quick_gelu", patch_size=PATCH,
                    spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_chans=3)


def write_qwen2_vl_checkpoint(folder: str | Path, seed: int = 0, hidden_size: int = 256) -> Path:
    """A seeded Qwen2-VL folder (see :data:`QWEN2_VISION`), with Qwen2.5-VL's image processor config."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder)
    fields = model_config(hidden_size, ids, layers=2)
    config = Qwen2VLConfig(**{**fields, "vision_config": {**QWEN2_VISION, "hidden_size": hidden_size}})
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    decisive_language_model(model, "qwen2_vl", seed, 2)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    write_qwen2_processor(folder)
    return folder


# A small Qwen3.5: Qwen3-VL's tower without deepstack layers (as the hub's Qwen3.5 configs say:
# ``deepstack_visual_indexes: []``), and SGLang's hybrid language model of two layers, one
# linear-attention (gated delta net) and one full-attention; Qwen3.5-MoE's with 4 experts a layer.
QWEN3_5_VISION = {**QWEN3_VISION, "deepstack_visual_indexes": []}
QWEN3_5_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
               "shared_expert_intermediate_size": 128}


def write_qwen3_5_checkpoint(folder: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """A seeded Qwen3.5 (``moe``: Qwen3.5-MoE) folder (see :data:`QWEN3_5_VISION`), with Qwen3-VL's
    processor configs. Its language model is transformers' init: this family is checked by its
    tower's rows (SGLang's CPU engine here does not run its linear-attention layers)."""
    import torch
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder)
    text = qwen3_text_config(ids, layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
                             linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=64,
                             linear_value_head_dim=64,
                             rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                              "mrope_section": [6, 5, 5], "mrope_interleaved": True,
                                              "partial_rotary_factor": 0.25},
                             **(QWEN3_5_MOE if moe else {}))
    classes = ((Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration) if moe
               else (Qwen3_5Config, Qwen3_5ForConditionalGeneration))
    model = qwen3_family_model(classes, ids, text, QWEN3_5_VISION, seed)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    write_qwen3_processors(folder)
    return folder


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--hidden-size", type=int, default=3584, help="language width = vision output (default 3584)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=1, help="language model layers (default 1)")
    ap.add_argument("--family", choices=["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe",
                                         "minimax_m3_vl", "qwen2_audio"], default="qwen2_5_vl",
                    help="every family but qwen2_5_vl: a fixed small shape (--hidden-size and --layers do not apply)")
    args = ap.parse_args()
    if args.family in ("qwen3_vl", "qwen3_vl_moe"):
        print(write_qwen3_vl_checkpoint(args.folder, args.seed, moe=args.family == "qwen3_vl_moe"))
    elif args.family == "qwen2_vl":
        print(write_qwen2_vl_checkpoint(args.folder, args.seed))
    elif args.family in ("qwen3_5", "qwen3_5_moe"):
        print(write_qwen3_5_checkpoint(args.folder, args.seed, moe=args.family == "qwen3_5_moe"))
    elif args.family == "minimax_m3_vl":
        print(write_minimax_m3_vl_checkpoint(args.folder, args.seed))
    elif args.family == "qwen2_audio":
        print(write_qwen2_audio_checkpoint(args.folder, args.seed))
    else:
        print(write_checkpoint(args.folder, args.hidden_size, args.seed, args.layers))
