"""Write the built-in seeded Qwen2.5-VL-geometry vision tower as a checkpoint folder.

For ``--encoder qwen --model-path DIR`` on a machine without real Qwen2.5-VL weights: this
folder stands in (config.json + model.safetensors, vision tower only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from embedding_side.encoders import write_builtin_checkpoint  # noqa: E402

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--seed", type=int, default=0)
    print(write_builtin_checkpoint(ap.parse_args().folder, ap.parse_args().seed))
