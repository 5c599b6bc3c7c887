"""Test images made once per test process: the modules' image fixtures ask for the same seeded
pictures, and one 3840x2160 PNG takes about 4 s to make and save on this machine."""

from __future__ import annotations

import os
from pathlib import Path

from transfer_large_image import make_image


def saved_image(path: str | Path, width: int, height: int, seed: int, **save_args: int) -> str:
    """``make_image(width, height, seed)`` saved at ``path`` (its suffix picks the format, with
    ``save_args``), linked from this process's copy when it made that file before. ``path``'s
    folder is a module's temporary folder: their parent, the process's temporary root, holds
    the copies."""
    path = Path(path)
    options = "".join(f"-{key}{value}" for key, value in sorted(save_args.items()))
    made = path.parent.parent / "image-cache" / f"{width}x{height}-{seed}{options}{path.suffix}"
    if not made.exists():
        made.parent.mkdir(exist_ok=True)
        partial = made.with_name(f"{made.stem}.partial{made.suffix}")
        make_image(width, height, seed).save(partial, **save_args)
        partial.rename(made)
    os.link(made, path)
    return str(path)
