"""What SGLang's server needs on a machine without a GPU in place of two CUDA-only packages.

Installed only there: ``scripts/setup.sh`` writes ``epd_cpu_shim.pth`` (one line, ``import
sglang_ext.cpu.shim``) into the environment's site-packages when ``nvidia-smi`` finds no GPU, so
every Python process of that environment (SGLang's scheduler and detokenizer included) loads
this module at start; it imports nothing heavy until asked for one of the two packages.

* ``SGLANG_USE_CPU_ENGINE=1`` unless set: SGLang's CPU engine is selected by it, not by
  ``--device cpu``.
* ``sgl_kernel``: its published wheels are CUDA builds (they fail to load here) and SGLang's
  CPU engine imports a few of its names at import time (KV-copy and speculative-decoding
  helpers) without calling them for Qwen2.5-VL. When no real ``sgl_kernel`` can be found, a
  stand-in module provides those names, and declares the four operators other models' modules
  look up on ``torch.ops.sgl_kernel`` when imported; calling any of them raises
  :class:`CpuShimCalled`. It has no submodules, so ``import sgl_kernel.x`` fails as SGLang expects where a kernel is
  optional (its layers then take their ``forward_native`` path). One operator is real:
  ``murmur_hash32_cpu``, the hash of SGLang's seeded sampling (``sglang_ext/seeds.py``), in
  torch integer ops, bit for bit its Triton kernel's.
* torchvision's wheel here is a CUDA build whose C ops do not load; its Python part imports
  once the two operators its meta registrations name unconditionally (``torchvision::nms``,
  ``torchvision::qnms``) exist. Before torchvision is imported they are declared, with kernels
  that raise :class:`CpuShimCalled` (SGLang's Qwen-VL processor imports torchvision for its
  image transforms, never for these ops).

* ``torchaudio``: its wheel is a CUDA build too. SGLang reads audio with soundfile where
  torchcodec is missing and imports torchaudio there unconditionally, for
  ``functional.resample`` alone (a clip not at the model's rate). When no real ``torchaudio``
  can be found, a stand-in package provides that one function with SciPy's polyphase
  resampler (the same output length, ceil(n x new / old); other sample values than
  torchaudio's windowed-sinc kernel).

Delete the ``.pth`` file to turn all of this off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

# The CPU kernels SGLang 0.5.23 imports from sgl_kernel (every `from sgl_kernel import` of a
# `*_cpu` name in its sources): KV-copy, token-pool and speculative-decoding helpers. None is
# called for Qwen2.5-VL without speculative decoding.
SGL_KERNEL_NAMES = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "sgl_build_tree_kernel_efficient_cpu",
    "sgl_verify_tree_greedy_cpu",
    "verify_tree_greedy_cpu",
)
# Operators SGLang's modules look up on ``torch.ops.sgl_kernel`` when they are imported (other
# models' modules, reached through the multimodal processors' registry); only looked up here.
SGL_KERNEL_OPS = ("fused_sigmoid_mul_cpu", "fused_qk_gemma_rmsnorm_cpu", "fused_qk_gemma_rmsnorm_with_gate_cpu",
                  "fused_qkvzba_split_reshape_cat_contiguous_cpu")
TORCHVISION_OPS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


class CpuShimCalled(RuntimeError):
    """A CUDA-only kernel was called on a machine that has none."""


def _refuse(name: str):
    def refuse(*_args, **_kwargs):
        raise CpuShimCalled(f"{name} was called, but this machine has no build of it (no GPU, no CPU build of "
                            f"sgl_kernel / torchvision's C ops): only a stand-in from sglang_ext/cpu/shim.py")

    refuse.__name__ = name.rsplit(".", 1)[-1]
    return refuse


def _stand_in_sgl_kernel() -> types.ModuleType:
    _declare_ops("sgl_kernel", {name: f"{name}(Tensor[] args) -> Tensor" for name in SGL_KERNEL_OPS})
    library = _LIBRARIES["sgl_kernel"]
    library.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
    library.impl("murmur_hash32_cpu", murmur_hash32, "CompositeExplicitAutograd")
    module = types.ModuleType("sgl_kernel", "CPU stand-in for sgl_kernel (sglang_ext/cpu/shim.py)")
    for name in SGL_KERNEL_NAMES:
        setattr(module, name, _refuse(f"sgl_kernel.{name}"))
    module.__epd_cpu_shim__ = True
    return module


_LIBRARIES: dict = {}  # namespace -> torch.library.Library; declarations live as long as it does


def _declare_ops(namespace: str, schemas: dict[str, str]) -> None:
    """Declare ``namespace``'s operators that do not exist yet, each with a kernel that refuses."""
    import torch

    if namespace in _LIBRARIES:
        return
    _LIBRARIES[namespace] = library = torch.library.Library(namespace, "FRAGMENT")
    for name, schema in schemas.items():
        if not hasattr(getattr(torch.ops, namespace), name):
            library.define(schema)
            library.impl(name, _refuse(f"{namespace}::{name}"), "CompositeExplicitAutograd")


_U32 = 0xFFFFFFFF


def _mul32(a, b: int):
    """``a * b mod 2**32`` for int64 tensors of 32-bit values, without leaving int64."""
    return ((a & 0xFFFF) * b + ((((a >> 16) * b) & 0xFFFF) << 16)) & _U32


def _rotl32(x, r: int):
    return ((x << r) | (x >> (32 - r))) & _U32


def _mix(h, k):
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    return (_mul32(_rotl32(h ^ k, 13), 5) + 0xE6546B64) & _U32


def murmur_hash32(seed, positions, col_indices):
    """SGLang's ``murmur_hash32`` [rows, columns] over (seed low, seed high, position, column)
    as 4-byte blocks, then MurmurHash3's finalisation; int64 holding the uint32 values."""
    import torch

    seed = seed.to(torch.int64)  # SGLang hands uint64; its bits are what is hashed
    h = _mix(torch.zeros_like(seed), seed & _U32)
    h = _mix(h, (seed >> 32) & _U32)
    h = _mix(h, positions.to(torch.int64) & _U32)[:, None]
    h = _mix(h, col_indices.to(torch.int64)[None, :] & _U32) ^ 16
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def resample(waveform, orig_freq: int, new_freq: int, **_ignored):
    """``torchaudio.functional.resample``'s stand-in: along the last axis, SciPy's polyphase filter."""
    import math

    import numpy as np
    import torch
    from scipy.signal import resample_poly

    if orig_freq == new_freq:
        return waveform
    common = math.gcd(int(orig_freq), int(new_freq))
    out = resample_poly(waveform.detach().cpu().numpy(), int(new_freq) // common, int(orig_freq) // common, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out)).to(waveform.dtype)


def _stand_in_torchaudio() -> types.ModuleType:
    module = types.ModuleType("torchaudio")
    module.__path__ = []  # a package: `import torchaudio.functional` finds the submodule below
    functional = types.ModuleType("torchaudio.functional")
    functional.resample = resample
    module.functional = sys.modules["torchaudio.functional"] = functional
    return module


STAND_INS = {"sgl_kernel": _stand_in_sgl_kernel, "torchaudio": _stand_in_torchaudio}


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on ``sys.meta_path``: declares torchvision's ops before torchvision loads, and
    serves the ``sgl_kernel`` and ``torchaudio`` stand-ins when no other finder has a real one."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            _declare_ops("torchvision", TORCHVISION_OPS)
            return None
        if fullname not in STAND_INS:
            return None
        for finder in sys.meta_path:
            if finder is not self and getattr(finder, "find_spec", None):
                if finder.find_spec(fullname, path, target) is not None:
                    return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == "torchaudio")

    def create_module(self, spec):
        return STAND_INS[spec.name]()

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    # SGLang's CPU engine is chosen by this variable (read when SGLang is imported), not by --device
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if not any(isinstance(f, _StandIns) for f in sys.meta_path):
        sys.meta_path.insert(0, _StandIns())


install()
