"""A seeded Qwen2-Audio checkpoint folder: the audio family SGLang's encoder serves whose
monolithic model transformers has (``Qwen2AudioForConditionalGeneration``).

Small: audio encoder of 2 layers (d_model 128, 128 mel bins, the 30 s window of 1,500
positions), language model Qwen2 with hidden 256 and 2 layers. Two things differ from what
``save_pretrained`` writes: the language model's tensors are saved under the hub's names
(``language_model.model.*``; transformers writes ``language_model.model.model.*``, which
SGLang's loader does not take, and reads both), and ``audio_config.output_dim`` is the language
model's width (what the projector emits; SGLang's encoder sizes audio rows from it, else from
``d_model``). The language model is re-drawn so that its greedy ids are decided far above bf16
rounding (``checkpoint_text.decisive_language_model``).
"""

from __future__ import annotations

import json
from pathlib import Path

from checkpoint_text import TEXT_INIT, VOCAB_SIZE, decisive_language_model, write_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
# each audio part as Qwen2-Audio's chat template lays it out: "Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>"
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'audio' or part['type'] == 'audio_url' -%}"
    "{{- 'Audio ' + loop.index|string + ': <|audio_bos|><|AUDIO|><|audio_eos|>\\n' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
HIDDEN = 256


def write_qwen2_audio_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """The folder: config.json, model.safetensors (bf16), tokenizer and chat template, the
    Whisper feature extractor's config (128 mel bins at 16 kHz, a 30 s window)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(folder, SPECIAL_TOKENS, CHAT_TEMPLATE)
    audio = {"num_mel_bins": 128, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 256,
             "d_model": 128, "max_source_positions": 1500, "activation_function": "gelu", "scale_embedding": False}
    text = {"vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"], "initializer_range": TEXT_INIT, "tie_word_embeddings": False}
    config = Qwen2AudioConfig(audio_config=audio, text_config=text, audio_token_index=ids["<|AUDIO|>"])
    config.architectures = ["Qwen2AudioForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    decisive_language_model(model, "qwen2_audio", seed, 2)
    model.to(torch.bfloat16).save_pretrained(folder)
    weights = folder / "model.safetensors"
    tensors = {name.replace("language_model.model.model.", "language_model.model."): tensor
               for name, tensor in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    saved = json.loads((folder / "config.json").read_text())
    saved["audio_config"]["output_dim"] = HIDDEN
    (folder / "config.json").write_text(json.dumps(saved, indent=1))
    features = {"feature_extractor_type": "WhisperFeatureExtractor", "processor_class": "Qwen2AudioProcessor",
                "feature_size": 128, "sampling_rate": 16000, "chunk_length": 30, "n_fft": 400, "hop_length": 160,
                "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right", "padding_value": 0.0,
                "return_attention_mask": True, "dither": 0.0}
    (folder / "preprocessor_config.json").write_text(json.dumps(features, indent=1))
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2AudioProcessor"}))
    return folder
