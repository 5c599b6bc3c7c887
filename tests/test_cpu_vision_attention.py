"""sglang_ext/cpu/vision_attention.py against SGLang's own ``VisionSdpaAttention`` (its masked
SDPA), on the same inputs: windows of several lengths, an empty window, one whole-image segment.
(The tower's output through SGLang's encoder is checked against transformers in
test_sglang_encoder.)"""

from __future__ import annotations

import pytest
import torch
from monolithic import bf16_step

# imported at collection: importing it runs ldconfig once (a process, which the fast tier refuses)
from sglang.srt.layers.attention.vision import VisionSdpaAttention

from sglang_ext.cpu.vision_attention import segmented_attention

pytestmark = pytest.mark.fast

HEADS, DIM = 2, 16


def rounding_step(values: torch.Tensor, dtype: torch.dtype) -> float:
    """One step of ``dtype`` at ``values``' largest magnitude: a bf16 step, for float32 16 bits finer."""
    bits_finer = torch.finfo(torch.bfloat16).eps / torch.finfo(dtype).eps
    return float(bf16_step(values.float().abs().max()) / bits_finer)


def upstream_forward():
    function = VisionSdpaAttention.forward
    return getattr(function, "__wrapped__", function)  # SGLang's own, whether or not the plugin hooked it


def attention(**kwargs):
    return VisionSdpaAttention(head_dim=DIM, num_heads=HEADS, num_kv_heads=HEADS, flatten_batch=True, **kwargs)


def qkv(patches: int, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(patches, HEADS, DIM, generator=generator).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bounds", [[0, 16, 32, 48, 50, 50, 66, 70], [0, 70]], ids=["windows", "whole_image"])
def test_segments_equal_sglangs_masked_attention(dtype: torch.dtype, bounds: list[int]) -> None:
    module, (q, k, v) = attention(), qkv(bounds[-1], dtype)
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    called = []

    def original(*args, **kwargs):
        called.append(True)
        return upstream_forward()(*args, **kwargs)

    ours = segmented_attention(original, module, q, k, v, 1, cu_seqlens=cu_seqlens, seq_len=bounds[-1])
    theirs = upstream_forward()(module, q, k, v, 1, cu_seqlens=cu_seqlens)
    assert not called and ours.shape == theirs.shape == (bounds[-1], HEADS, DIM)
    # Each side rounds the attention weights and the output in ``dtype`` (and sums in its own order):
    # its result is within about one step of ``dtype`` at the largest |v| (the output is an average of
    # v's rows) from the exact one, so the two are within two such steps of each other.
    assert (ours.float() - theirs.float()).abs().max() <= 2 * rounding_step(v, dtype)


def test_layouts_it_does_not_cover_keep_sglangs_code() -> None:
    q, k, v = qkv(8, torch.float32)
    cu_seqlens = torch.tensor([0, 4, 8], dtype=torch.int32)
    marker = torch.zeros(1)
    original = lambda *args, **kwargs: marker  # noqa: E731
    assert segmented_attention(original, attention(), q, k, v, 1, cu_seqlens=cu_seqlens,
                               attention_mask=torch.ones(1, 8, 8, dtype=torch.bool)) is marker
    assert segmented_attention(original, attention(softmax_in_single_precision=True), q, k, v, 1,
                               cu_seqlens=cu_seqlens) is marker
    assert segmented_attention(original, attention(), q, k, v, 1, cu_seqlens=None) is marker
    # segments that leave patches out: upstream's mask decides what those rows get
    assert segmented_attention(original, attention(), q, k, v, 1, cu_seqlens=torch.tensor([0, 4, 6])) is marker
