"""What an encoder's fingerprint costs at start: the SHA-256 of every loaded tensor
(``embedding_side.encoders.tensors_digest``) over a tower of Qwen2.5-VL-7B's shapes (32 blocks of
width 1280 and the merger to 3584: 675M bf16 parameters, 1.35 GB), random values.

    .venv/bin/python scripts/bench_fingerprint.py [--reps 3]

Last line: ``fingerprint_seconds_7b_tower=S`` (the median).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from embedding_side.encoders import tensors_digest


def tower_7b() -> dict[str, torch.Tensor]:
    tensors = {}
    for i in range(32):
        tensors[f"blocks.{i}.attn.qkv.weight"] = torch.randn(3840, 1280)
        tensors[f"blocks.{i}.attn.proj.weight"] = torch.randn(1280, 1280)
        for name in ("gate", "up"):
            tensors[f"blocks.{i}.mlp.{name}.weight"] = torch.randn(3420, 1280)
        tensors[f"blocks.{i}.mlp.down.weight"] = torch.randn(1280, 3420)
    tensors["merger.mlp.0.weight"] = torch.randn(5120, 5120)
    tensors["merger.mlp.2.weight"] = torch.randn(3584, 5120)
    return {name: t.to(torch.bfloat16) for name, t in tensors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    tensors = tower_7b()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    times = []
    for _ in range(args.reps):
        started = time.perf_counter()
        tensors_digest(tensors.items())
        times.append(time.perf_counter() - started)
        print(f"{size / 1e9:.2f} GB digested in {times[-1]:.2f} s ({size / 1e9 / times[-1]:.2f} GB/s)", flush=True)
    print(f"fingerprint_seconds_7b_tower={statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
