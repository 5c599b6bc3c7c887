"""What the tests of the SGLang stacks (SGLang's encoder in our encode worker, SGLang's language
server, the connector between) share: the launcher, the prompt, the images and the request."""

from __future__ import annotations

import sys
from pathlib import Path

import requests
from monolithic import greedy_mismatch
from transfer_large_image import make_image
from workers import WorkerProcess

SGLANG_LAUNCH = (sys.executable, "-m", "sglang.launch_server")
NEW_TOKENS = 12
PROMPT = "<|im_start|>user\n{images}Describe it.<|im_end|>\n<|im_start|>assistant\n"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SIZES = {"448x448": (448, 448), "1920x1080": (1920, 1080), "3840x2160": (3840, 2160)}


def write_images(root: Path) -> dict[str, str]:
    """One image of each of :data:`SIZES` and a 640x336 ``other``, as PNG files under ``root``."""
    paths = {}
    for i, (name, (w, h)) in enumerate([*SIZES.items(), ("other", (640, 336))]):
        paths[name] = str(root / f"{name}.png")
        make_image(w, h, seed=60 if name == "other" else 40 + i).save(paths[name])
    return paths


def prompt(n_images: int) -> str:
    return PROMPT.format(images=IMAGE * n_images)


def generate(language: WorkerProcess, paths: list[str], rid: str, new_tokens: int = NEW_TOKENS,
             **extra) -> requests.Response:
    """A greedy ``/generate`` of ``new_tokens`` for ``paths`` in the prompt (``extra``: more body fields)."""
    body = {"rid": rid, "text": prompt(len(paths)), "image_data": paths,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}} | extra
    return requests.post(f"{language.url}/generate", json=body, timeout=300)


def generate_as_reference(language: WorkerProcess, paths: list[str], rid: str, reference) -> dict:
    """:func:`generate`, checked: 200, and the greedy ids of ``reference(paths)`` (a
    ``monolithic.Greedy``) as ``monolithic.greedy_mismatch`` compares them; the response body."""
    answer = generate(language, paths, rid)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert greedy_mismatch(body["output_ids"], reference(paths)) is None
    return body
