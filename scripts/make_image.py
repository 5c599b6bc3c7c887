"""Write a deterministic test image (gradients, ripples and seeded noise) as PNG.

    .venv/bin/python scripts/make_image.py /data/images/4k.png --size 3840x2160 [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from transfer_large_image import make_image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--size", default="3840x2160", help="WIDTHxHEIGHT (default 3840x2160)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    width, height = (int(n) for n in args.size.lower().split("x"))
    args.path.parent.mkdir(parents=True, exist_ok=True)
    make_image(width, height, args.seed).save(args.path)
    print(f"{args.path}: {width}x{height}")


if __name__ == "__main__":
    main()
