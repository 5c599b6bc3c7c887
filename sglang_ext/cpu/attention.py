"""SGLang's portable attention backend (``torch_native``, the one a CPU runs) without its padded
extend: the same attention, with a request's new tokens as the only queries.

Upstream's ``TorchNativeAttnBackend._run_sdpa_forward_extend`` pads each request's queries to
its whole sequence (cached prefix included) and discards the prefix rows after the attention.
A prefill that extends a cached prefix (the second turn on an image, a radix-cache hit, every
chunk of a chunked prefill after the first) then costs as much attention as the whole sequence
from scratch: 4.4 s for one turn of 30 new tokens on a 10,581-token 4K-image prompt here. This
hook gives SDPA the new tokens' queries and a causal mask aligned to the end of the keys
(query ``i`` sees keys ``0 .. prefix + i``), which is what the padded rows it kept computed.
Cross-attention, encoder-decoder layouts and sliding windows keep upstream's code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention


def extend_without_padding(original, backend, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                           seq_lens: torch.Tensor, extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor,
                           encoder_lens: torch.Tensor | None = None, scaling: float | None = None,
                           enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
                           sliding_window_size: int | None = None, **more: Any) -> torch.Tensor:
    """Around hook for ``_run_sdpa_forward_extend``: ``query``/``output`` are ``[tokens, heads,
    dim]``; the caches are indexed through ``req_to_token`` like upstream's."""
    if encoder_lens is not None or is_cross_attn or more or (
            sliding_window_size is not None and sliding_window_size > -1):
        return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                        extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size, **more)
    by_head = query.movedim(0, 1)  # [heads, tokens, dim]
    start = 0
    for seq in range(seq_lens.shape[0]):
        new, prefix, total = int(extend_seq_lens[seq]), int(extend_prefix_lens[seq]), int(seq_lens[seq])
        end = start + new
        slots = req_to_token[req_pool_indices[seq], :total]
        key, value = k_cache[slots].movedim(0, 1), v_cache[slots].movedim(0, 1)
        queries = by_head[:, start:end]
        if key.dtype != queries.dtype:
            key, value = key.to(queries.dtype), value.to(queries.dtype)
        mask, from_top_left = None, False
        if causal and new > 1:
            if prefix == 0:
                from_top_left = True  # square: SDPA's own causal mask is the same
            else:
                mask = torch.arange(total, device=query.device) <= torch.arange(
                    prefix, prefix + new, device=query.device)[:, None]
        attended = scaled_dot_product_attention(queries.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0),
                                                attn_mask=mask, is_causal=from_top_left, scale=scaling,
                                                enable_gqa=enable_gqa)
        output[start:end] = attended.squeeze(0).movedim(0, 1)
        start = end
    return output
