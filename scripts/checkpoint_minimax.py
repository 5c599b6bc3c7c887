"""A seeded MiniMax-M3-VL checkpoint folder, in the hub's layout: the non-Qwen family SGLang's
encoder serves that runs on this CPU (its language model is dense attention without MLA; the
Kimi and GLM families' MLA prefill is wrong on SGLang's CPU attention path, see
docs/sglang_encoder.md).

The shape is small (language: hidden 256, 2 layers, 2 heads of 128, 1 KV head; vision: 2
layers, hidden 64, 14 px patches, 2x2 merge) and every layer dense: SGLang's CPU MoE path reads
MiniMax's gate and up projections interleaved (GPT-OSS's layout), and its sparse (indexer)
attention has no CPU kernel. transformers' ``MiniMaxM3SparseForConditionalGeneration`` makes
the weights; they are saved under the hub's names (what transformers' conversion mapping for
``minimax_m3_vl`` reads and SGLang's ``load_weights`` expects), and config.json carries both
libraries' spellings of the vision settings. The language model is re-drawn so that its greedy
ids are decided far above bf16 rounding (``checkpoint_text.decisive_language_model``).
"""

from __future__ import annotations

import json
from pathlib import Path

from checkpoint_text import TEXT_INIT, VOCAB_SIZE, decisive_language_model, write_tokenizer

# MiniMax-M3's chat and vision tokens: ]~!b[ begins a conversation, ]~b]role ... [e~[ is a turn
SPECIAL_TOKENS = ("]~!b[", "]~b]", "[e~[", "]!p~[", "]<]image[>[", "]<]video[>[", "]<]start of image[>[",
                  "]<]end of image[>[", "<think>", "</think>")
CHAT_TEMPLATE = (
    "{{- ']~!b[' -}}{%- for message in messages -%}{{- ']~b]' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}{{- ']<]image[>[' -}}"
    "{%- elif part['type'] == 'video' or part['type'] == 'video_url' -%}{{- ']<]video[>[' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{- '[e~[\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ']~b]ai\\n' -}}{%- endif -%}"
)
HIDDEN, LAYERS = 256, 2
PATCH, MERGE, TEMPORAL = 14, 2, 2


def config_dict(ids: dict[str, int]) -> dict:
    dense = [0] * LAYERS
    text = {
        # transformers builds its own text config from these; SGLang looks "minimax_m2" up in
        # CONFIG_MAPPING, which keeps every key
        "model_type": "minimax_m2", "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "hidden_act": "swigluoai", "rope_theta": 5_000_000.0, "rotary_dim": 64,
        "partial_rotary_factor": 0.5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.5},
        "use_qk_norm": True, "qk_norm_type": "per_head", "use_gemma_norm": True,
        "dense_intermediate_size": 512, "intermediate_size": 128, "shared_intermediate_size": 128,
        "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "scoring_func": "sigmoid",
        "use_routing_bias": True, "routed_scaling_factor": 2.0, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "moe_layer_freq": dense, "mlp_layer_types": ["dense"] * LAYERS, "layer_types": ["full_attention"] * LAYERS,
        "num_mtp_modules": 0,
        # SGLang sizes its KV pool from this for every MiniMaxM3Sparse architecture, even one with
        # no sparse layer (all frequencies 0); transformers drops it
        "sparse_attention_config": {"use_sparse_attention": True, "sparse_index_dim": 128, "sparse_num_index_heads": 2,
                                    "sparse_topk_blocks": 16, "sparse_block_size": 128, "sparse_init_block": 0,
                                    "sparse_local_block": 1, "sparse_score_type": "max",
                                    "sparse_disable_index_value": [1] * LAYERS, "sparse_attention_freq": dense},
        "index_n_heads": 2, "index_head_dim": 128, "index_block_size": 128, "index_topk_blocks": 16,
        "index_local_blocks": 1, "bos_token_id": ids["]~!b["], "eos_token_id": ids["[e~["],
        "initializer_range": TEXT_INIT, "tie_word_embeddings": False,
    }
    vision = {
        "model_type": "minimax_m3_vl_vision", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_channels": 3, "image_size": 2016, "patch_size": PATCH, "hidden_act": "gelu",
        "layer_norm_eps": 1e-5, "initializer_range": TEXT_INIT,
        # transformers' spelling
        "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL,
        "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
        # SGLang's (every field of its CLIPVisionConfig is required)
        "img_token_compression_config": {"spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL},
        "position_embedding_type": "rope", "rope_mode": "3d", "rope_theta": 10000.0, "vision_segment_max_frames": None,
    }
    return {"architectures": ["MiniMaxM3SparseForConditionalGeneration"], "model_type": "minimax_m3_vl",
            "text_config": text, "vision_config": vision, "image_token_index": ids["]<]image[>["],
            "video_token_index": ids["]<]video[>["], "projector_hidden_size": HIDDEN, "projector_hidden_act": "gelu",
            "multimodal_projector_bias": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def hub_names(state: dict) -> dict:
    """transformers' parameter names -> the hub's (dense layers only)."""
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().contiguous()
        if name == "lm_head.weight":
            out["language_model.lm_head.weight"] = tensor
        elif name.startswith("model.language_model."):
            hub = "language_model.model." + name.removeprefix("model.language_model.")
            if hub.endswith("mlp.gate_up_proj.weight"):  # one fused matrix here, two on the hub
                gate, up = tensor.chunk(2, dim=0)
                base = hub.removesuffix("gate_up_proj.weight")
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = gate.clone(), up.clone()
            else:
                out[hub] = tensor
        elif name.startswith("model.vision_tower."):
            rest = name.removeprefix("model.vision_tower.")
            if rest.startswith("embeddings.proj."):
                out["vision_tower.vision_model.embeddings.patch_embedding." + rest.removeprefix("embeddings.proj.")] = tensor
            elif rest.startswith("layers."):
                out["vision_tower.vision_model.encoder." + rest] = tensor
            elif rest.startswith("pre_layrnorm."):
                out["vision_tower.vision_model." + rest] = tensor
            else:
                raise KeyError(name)
        elif name.startswith("model.multi_modal_projector."):
            rest = name.removeprefix("model.multi_modal_projector.")
            out[("patch_merge_mlp.linear_" + rest.removeprefix("merge_linear_")) if rest.startswith("merge_linear_")
                else "multi_modal_projector." + rest] = tensor
        else:
            raise KeyError(name)
    return out


PROJECTOR_OUT_GAIN = 0.01


def write_minimax_m3_vl_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """The folder: config.json, model.safetensors (bf16, hub names), tokenizer and chat template,
    image and video preprocessor configs (the hub's spelling: ``size`` [672, 672])."""
    import torch
    from safetensors.torch import save_file
    from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, SPECIAL_TOKENS, CHAT_TEMPLATE, bos_token="]~!b[", eos_token="[e~[")
    config = config_dict(ids)
    torch.manual_seed(seed)
    model = MiniMaxM3SparseForConditionalGeneration(MiniMaxM3VLConfig(**json.loads(json.dumps(config)))).eval()
    with torch.no_grad():  # Gemma-style norms start at 0 (a scale of 1): spread them so that they count
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and "vision" not in name:
                param.normal_(0.0, 0.1)
        # the projector drawn at the configs' init makes image rows of rms ~230 against the text's 1:
        # attention then sees the same few extreme rows whatever the picture; at rms ~2 it reads them
        model.model.multi_modal_projector.merge_linear_2.weight.mul_(PROJECTOR_OUT_GAIN)
        model.model.multi_modal_projector.merge_linear_2.bias.mul_(PROJECTOR_OUT_GAIN)
    decisive_language_model(model, "minimax_m3_vl", seed, LAYERS, norm_offset=1.0)
    state = {k: v for k, v in model.to(torch.bfloat16).state_dict().items() if "rotary_emb" not in k}
    save_file(hub_names(state), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    pixels = {"patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": TEMPORAL,
              "img_token_compression_config": {"spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL},
              "size": [672, 672], "image_mean": [0.48145466, 0.4578275, 0.40821073],
              "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
              "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255,
              "processor_class": "MiniMaxM3VLProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "MiniMaxM3VLImageProcessor", **pixels}, indent=1))
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "MiniMaxM3VLVideoProcessor", **pixels}, indent=1))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "MiniMaxM3VLProcessor"}, indent=1))
    return folder
