"""bf16 matrix products computed in float32 on a CPU without bf16 arithmetic.

A CPU without AVX512-BF16 or AMX (this project's test machine: AVX2 only) has no bf16 GEMM
kernel, and PyTorch's fallback is slow: a ``[4096, 256] x [256, 768]`` product takes 111 ms in
bf16 and 12 ms on float32 copies rounded back to bf16 (2 threads here; 1874 ms and 250 ms for
``[4096, 1280] x [1280, 3584]``). Both accumulate in float32; the results differ only where the
order of the additions moves a value across a bf16 rounding boundary (0.01% of the outputs, by
one bf16 step). So a product with many rows (a prefill, a vision tower's patches) runs on float32
copies; one with few rows (a decode step) keeps the bf16 kernel, since there converting the
weight costs more than the product (16 rows x a 3584 x 18944 weight: 100 ms in bf16, 163 ms
converted). On a GPU, or a CPU with bf16 arithmetic, nothing changes.

Used around SGLang's unquantized linear layers (its language models and vision towers), through
the plugin's hook.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_ROWS = 64  # fewer rows: the bf16 kernel (see the module docstring)


@functools.cache
def slow_bf16() -> bool:
    """True on a machine whose bf16 products run on the CPU without bf16 arithmetic."""
    if torch.cuda.is_available():
        return False
    return not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def _wanted(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.numel() >= MIN_ROWS * x.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; for a bf16 CPU product of :data:`MIN_ROWS` rows or more, on float32 copies,
    rounded to bf16 once."""
    if not _wanted(x, weight):
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)


def around_unquantized_linear(original, method, layer, x: torch.Tensor, bias: torch.Tensor | None = None,
                              *args, **kwargs) -> torch.Tensor:
    """Around hook for SGLang's ``UnquantizedLinearMethod.apply`` (registered only where
    :func:`slow_bf16`)."""
    if args or kwargs or not _wanted(x, layer.weight):
        return original(method, layer, x, bias, *args, **kwargs)
    return linear(x, layer.weight, bias)
