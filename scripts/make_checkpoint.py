"""Write a complete seeded Qwen2.5-VL (or Qwen3-VL, or MiniMax-M3-VL: ``checkpoint_minimax.py``,
or Qwen2-Audio: ``checkpoint_qwen2_audio.py``) checkpoint folder: vision tower, language model, an offline tokenizer with the family's special
tokens and a chat template, and the image (and video) preprocessor configs.

Nothing can be downloaded here, so this folder stands in for a real checkpoint on both workers
(the encode worker loads its vision tower, the language worker its language model and
tokenizer). The weights are random (seeded): generated text means nothing, but tokens are
exact, so the disaggregated path can be compared with transformers' monolithic model.

    python scripts/make_checkpoint.py /tmp/qwen-seeded [--hidden-size 2048] [--seed 0] [--layers 28]
    python scripts/make_checkpoint.py /tmp/qwen3-seeded --family qwen3_vl
    python scripts/make_checkpoint.py /tmp/minimax-seeded --family minimax_m3_vl
    python scripts/make_checkpoint.py /tmp/qwen2-audio-seeded --family qwen2_audio
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embedding_side.encoders import MAX_PIXELS, MERGE, MIN_PIXELS, PATCH, TEMPORAL, small_tower_config  # noqa: E402

# Qwen's special tokens, in the order they get ids after the 256 byte tokens.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
VOCAB_SIZE = 512  # 256 bytes + the special tokens, rounded up (the model's table covers every id)

# Chat messages -> prompt, as Qwen2.5-VL lays them out: each turn in <|im_start|>role ...
# <|im_end|>, each image (video) part as one vision_start / image_pad (video_pad) / vision_end
# placeholder (the language side expands the pad to the image's or video's token count).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' or part['type'] == 'video_url' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def byte_symbols() -> list[str]:
    """One printable character per byte value (the byte-level BPE convention): printable
    Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shift = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shift)
            shift += 1
    return [symbols[b] for b in range(256)]


def write_tokenizer(folder: Path, special: tuple[str, ...] = SPECIAL_TOKENS, template: str = CHAT_TEMPLATE,
                    **roles: str) -> dict[str, int]:
    """A byte-level tokenizer (every byte one token, no merges) plus the ``special`` tokens (the
    first two are the pad/bos and the chat-role ones of ``roles``: Qwen's by default), saved so
    ``AutoTokenizer.from_pretrained(folder)`` loads it; returns the special tokens' ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    # as in Qwen's own tokenizer, the chat and vision tokens are special (clients that sample
    # random prompts, such as SGLang's benchmark, leave them out)
    roles = roles or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **roles, model_max_length=32768,
                                        extra_special_tokens=[t for t in special if t not in roles.values()])
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special}
    assert list(ids.values()) == list(range(256, 256 + len(special))), ids
    return ids


# Random weights at the usual init scale (0.02) give a language model whose next-token
# distribution is nearly flat (top log-probabilities 0.01 apart over 512 ids): the last bf16 bit
# of an embedding then picks the greedy id, and the greedy ids hardly depend on the image, so an
# equality check between two implementations fails on rounding and passes for any picture. At
# 0.2 the ids follow the picture and the top choices are far apart.
TEXT_INIT = 0.2


def model_config(hidden_size: int, ids: dict[str, int], layers: int = 1) -> dict:
    """A small Qwen2.5-VL: the vision tower the encode worker builds by default, and a language
    model of ``layers`` layers (one by default) whose width is the tower's output width."""
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
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    preprocessor = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": PATCH, "merge_size": MERGE,
                    "temporal_patch_size": TEMPORAL, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
                    "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_resize": True, "do_rescale": True,
                    "do_normalize": True, "do_convert_rgb": True, "rescale_factor": 1 / 255}
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    return folder


# A small Qwen3-VL: 16 px patches, a learned position table, two deepstack layers (so SGLang's
# encoder sends rows of 256 x 3 = 768), and a language model of two layers (one per deepstack
# layer, which it adds to its first two layers' hidden states).
QWEN3_HIDDEN, QWEN3_PATCH = 256, 16
QWEN3_VISION = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=QWEN3_HIDDEN,
                    hidden_act="gelu_pytorch_tanh", patch_size=QWEN3_PATCH, spatial_merge_size=MERGE,
                    temporal_patch_size=TEMPORAL, num_position_embeddings=2304, deepstack_visual_indexes=[0, 1])


def write_qwen3_vl_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """A seeded Qwen3-VL folder (see :data:`QWEN3_VISION`), with its image and video processor configs."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder)
    text = {"vocab_size": VOCAB_SIZE, "hidden_size": QWEN3_HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "initializer_range": TEXT_INIT,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [24, 20, 20],
                                "mrope_interleaved": True},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    config = Qwen3VLConfig(text_config=text, vision_config=QWEN3_VISION, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
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
    return folder


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--hidden-size", type=int, default=3584, help="language width = vision output (default 3584)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=1, help="language model layers (default 1)")
    ap.add_argument("--family", choices=["qwen2_5_vl", "qwen3_vl", "minimax_m3_vl", "qwen2_audio"],
                    default="qwen2_5_vl",
                    help="qwen3_vl, minimax_m3_vl, qwen2_audio: a fixed small shape (--hidden-size and --layers do "
                         "not apply)")
    args = ap.parse_args()
    if args.family == "qwen3_vl":
        print(write_qwen3_vl_checkpoint(args.folder, args.seed))
    elif args.family == "minimax_m3_vl":
        from checkpoint_minimax import write_minimax_m3_vl_checkpoint

        print(write_minimax_m3_vl_checkpoint(args.folder, args.seed))
    elif args.family == "qwen2_audio":
        from checkpoint_qwen2_audio import write_qwen2_audio_checkpoint

        print(write_qwen2_audio_checkpoint(args.folder, args.seed))
    else:
        print(write_checkpoint(args.folder, args.hidden_size, args.seed, args.layers))
