"""SGLang's vision attention on a CPU without its patch-by-patch mask: each window (or image)
attends within itself, equal-length segments in one call.

On a CPU without AMX, SGLang's vision towers (every family its encoder serves: Qwen2.5-VL,
Qwen3-VL, Kimi, GLM, MiniMax) run ``VisionSdpaAttention`` with ``flatten_batch``: every patch of
every image in the batch is one sequence, and ``cu_seqlens`` says where each window or image
starts. Upstream builds a boolean ``[1, S, S]`` mask from it (cached, up to 128 of them) and runs
SDPA with that mask, which on a CPU is the math kernel: memory and time grow with S². For one
1920x1080 Qwen2.5-VL image (S = 10,764) that is 8 s and 2.6 GB per attention; a 3840x2160 one
(S = 42,196) took the encoder past 13 GB here. This hook runs the same attention segment by
segment without a mask (SDPA's flash kernel on a CPU, memory linear in S), with all segments of
one length batched into one call: 0.03 s and 0.23 GB for that 1080p image. A GPU never gets
here (SGLang picks fa3/fa4/triton there), nor do the layouts this does not cover (a given mask,
a batch dimension, single-precision softmax, grouped KV heads): they keep upstream's code.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention


def segmented_attention(original, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bsz: int,
                        cu_seqlens: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                        **more: Any) -> torch.Tensor:
    """Around hook for ``VisionSdpaAttention.forward``: ``q``/``k``/``v`` are ``[S, heads, dim]``
    (flattened patches), the result ``[S, heads, dim]`` as upstream's."""
    bounds = _segment_bounds(module, q, bsz, cu_seqlens, attention_mask)
    if bounds is None:
        return original(module, q, k, v, bsz, cu_seqlens=cu_seqlens, attention_mask=attention_mask, **more)
    heads, dim = module.num_heads, module.head_size
    q, k, v = (t.reshape(-1, heads, dim) for t in (q, k, v))
    out = q.new_empty(q.shape)
    starts_by_length: dict[int, list[int]] = defaultdict(list)
    for start, end in zip(bounds, bounds[1:], strict=False):
        if end > start:
            starts_by_length[end - start].append(start)
    for length, starts in starts_by_length.items():
        if len(starts) == 1:  # a whole image (a full-attention layer): a slice, no gather
            window = slice(starts[0], starts[0] + length)
            # [1, heads, length, dim]: four dimensions, or a CPU takes SDPA's math kernel (S x S memory)
            qs, ks, vs = (t[window].transpose(0, 1)[None] for t in (q, k, v))
            attended = scaled_dot_product_attention(qs, ks, vs, dropout_p=module.dropout, scale=module.scale)
            out[window] = attended[0].transpose(0, 1)
            continue
        index = (torch.tensor(starts)[:, None] + torch.arange(length)).reshape(-1)
        # [segments, heads, length, dim]
        qs, ks, vs = (t[index].view(len(starts), length, heads, dim).transpose(1, 2) for t in (q, k, v))
        attended = scaled_dot_product_attention(qs, ks, vs, dropout_p=module.dropout, scale=module.scale)
        out[index] = attended.transpose(1, 2).reshape(-1, heads, dim)
    return out


def _segment_bounds(module, q: torch.Tensor, bsz: int, cu_seqlens: torch.Tensor | None,
                    attention_mask: torch.Tensor | None) -> list[int] | None:
    """The segments' boundaries when this hook covers the call (see the module docstring), else None."""
    if (q.device.type != "cpu" or not module.flatten_batch or bsz != 1 or cu_seqlens is None
            or attention_mask is not None or module.softmax_in_single_precision
            or module.num_kv_heads != module.num_heads or q.dim() != 3):
        return None
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != q.shape[0] or any(b > a for a, b in zip(bounds[1:], bounds, strict=False)):
        return None  # a patch outside every segment, or segments out of order: upstream's mask decides
    return bounds
