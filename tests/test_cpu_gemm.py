"""sglang_ext/cpu/gemm.py: bf16 products with many rows computed on float32 copies (what a CPU
without bf16 arithmetic runs 6-9x faster), few rows on the bf16 kernel; against PyTorch's own
bf16 kernel and float32 products. (That SGLang's linear layers go through it in a process with the
plugin: test_sglang_plugin; greedy ids through whole servers against transformers: test_sglang_language and others.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_ext.cpu import gemm as cpu_gemm

pytestmark = pytest.mark.fast


def operands(rows: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 96, generator=generator).bfloat16()
    weight = (torch.randn(80, 96, generator=generator) * 0.1).bfloat16()
    bias = torch.randn(80, generator=generator).bfloat16()
    return x, weight, bias


def within_one_bf16_step(ours: torch.Tensor, theirs: torch.Tensor) -> bool:
    step = theirs.float().abs() * 2.0 ** -7 + 1e-30  # bf16 keeps 8 significant bits
    return bool(((ours.float() - theirs.float()).abs() <= step).all())


def test_many_rows_are_the_float32_product_rounded_once_within_one_step_of_the_bf16_kernel() -> None:
    x, weight, bias = operands(256)
    ours = cpu_gemm.linear(x, weight, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (256, 80)
    assert torch.equal(ours, F.linear(x.float(), weight.float(), bias.float()).bfloat16())
    assert within_one_bf16_step(ours, F.linear(x, weight, bias))
    batched = cpu_gemm.linear(x.view(4, 64, 96), weight)  # leading dimensions count as rows
    assert torch.equal(batched.view(256, 80), F.linear(x.float(), weight.float()).bfloat16())


def test_few_rows_and_other_dtypes_keep_pytorchs_own_product() -> None:
    x, weight, bias = operands(cpu_gemm.MIN_ROWS - 1)
    assert torch.equal(cpu_gemm.linear(x, weight, bias), F.linear(x, weight, bias))
    x, weight, bias = (t.float() for t in operands(256))
    assert torch.equal(cpu_gemm.linear(x, weight, bias), F.linear(x, weight, bias))


def test_sglangs_linear_method_goes_through_it_and_keeps_its_own_path_otherwise() -> None:
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    apply = UnquantizedLinearMethod.apply
    upstream = getattr(apply, "__wrapped__", apply)  # SGLang's own, whether or not the plugin hooked it
    x, weight, bias = operands(128)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    method = UnquantizedLinearMethod()
    assert torch.equal(cpu_gemm.around_unquantized_linear(upstream, method, layer, x, bias),
                       cpu_gemm.linear(x, weight, bias))
    assert torch.equal(cpu_gemm.around_unquantized_linear(upstream, method, layer, x[:8], bias),
                       upstream(method, layer, x[:8], bias))
