"""Qwen2-Audio's audio tower with its padding mask, in SGLang's model (a plugin hook).

SGLang 0.5.23's ``Qwen2AudioForConditionalGeneration.get_audio_feature`` runs transformers'
``Qwen2AudioEncoder`` on the mel features without an attention mask. The feature extractor pads
every clip to the 30 s window, and transformers' own model masks the padded frames, so every
clip shorter than the window came out of SGLang's encoder other than out of transformers (seeded
checkpoint: other greedy ids for 1 s and 7.3 s clips, the same for 30 s). The mask here is the
one transformers builds, from each item's mel length (``audio_feature_lens_raw``) through the
tower's own ``_get_feat_extract_output_lengths``.
"""

from __future__ import annotations


def masked_audio_feature(_original, model, items):
    """``get_audio_feature(items)`` of SGLang's Qwen2-Audio with the padded frames masked."""
    import torch
    from transformers.masking_utils import create_bidirectional_mask

    features = torch.cat([item.feature for item in items], dim=0).type(model.audio_tower.dtype)
    mel_lengths = torch.cat([torch.as_tensor(item.audio_feature_lens_raw).reshape(-1) for item in items])
    frame_lengths, _ = model.audio_tower._get_feat_extract_output_lengths(mel_lengths.to(features.device))
    frames = (features.shape[-1] - 2) // 2 + 1  # after the tower's stride-2 convolution
    keep = (torch.arange(frames, device=features.device)[None, :] < frame_lengths[:, None]).long()
    mask = create_bidirectional_mask(config=model.audio_tower.config, attention_mask=keep,
                                     inputs_embeds=features.new_zeros(features.shape[0], frames, 1))
    embeds = model.multi_modal_projector(model.audio_tower(features, attention_mask=mask).last_hidden_state)
    tokens = torch.cat([torch.as_tensor(item.audio_feature_lens).reshape(-1) for item in items])
    return torch.cat([rows[: int(count)] for count, rows in zip(tokens, embeds, strict=True)], dim=0)
