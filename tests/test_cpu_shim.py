"""The CPU stand-ins (sglang_ext/cpu/shim.py), as installed by scripts/setup.sh on a machine
without a GPU (this project's CI machines): SGLang's imports succeed, and anything that calls a
stand-in fails loudly."""

from __future__ import annotations

import importlib.util
import os
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast


def test_setup_installed_the_stand_ins_on_this_gpu_less_machine() -> None:
    assert (Path(sysconfig.get_paths()["purelib"]) / "epd_cpu_shim.pth").read_text().strip() == \
        "import sglang_ext.cpu.shim"


def test_the_environment_selects_sglangs_cpu_engine() -> None:
    assert os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def test_sgl_kernel_names_import_and_refuse_to_run() -> None:
    import sgl_kernel
    from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu  # what SGLang imports

    from sglang_ext.cpu.shim import CpuShimCalled

    assert sgl_kernel.__epd_cpu_shim__
    with pytest.raises(CpuShimCalled, match="copy_all_layer_kv_cache_cpu was called"):
        copy_all_layer_kv_cache_cpu(1, 2)
    with pytest.raises(CpuShimCalled):
        assign_req_to_token_pool_cpu()
    with pytest.raises(ImportError):  # optional kernels stay missing: SGLang falls back to native code
        importlib.import_module("sgl_kernel.kvcacheio")


def test_the_looked_up_operators_exist_and_refuse_to_run() -> None:
    import sgl_kernel  # noqa: F401  (declares them)
    import torch

    from sglang_ext.cpu.shim import CpuShimCalled

    with pytest.raises(CpuShimCalled, match="sgl_kernel::fused_sigmoid_mul_cpu"):
        torch.ops.sgl_kernel.fused_sigmoid_mul_cpu([torch.zeros(1)])


def test_torchvision_imports_and_its_c_ops_refuse_to_run() -> None:
    import torch
    import torchvision
    from torchvision.transforms import InterpolationMode  # what SGLang's Qwen-VL processor takes

    from sglang_ext.cpu.shim import CpuShimCalled

    assert torchvision.__version__ and InterpolationMode.BICUBIC
    with pytest.raises(CpuShimCalled, match="torchvision::nms"):
        torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
