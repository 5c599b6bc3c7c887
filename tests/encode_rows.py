"""``python tests/encode_rows.py FOLDER OUT PATH...``: each image's (or ``.mp4`` video's) rows
through SGLang's encoder on FOLDER, one medium a forward pass, saved as a safetensors file OUT
(keys: the paths). Run in a
process of its own, since SGLang's plugins are loaded once per process (and its parallel groups
once too): forked from the tests' worker zygote, or a fresh interpreter."""

import argparse
import sys

import torch
from PIL import Image
from safetensors.torch import save_file

from embedding_side.sglang_encoder import SGLangEncoder
from sglang_ext.encoder_flags import standalone_server_args

folder, out, *paths = sys.argv[1:]
encoder = SGLangEncoder(standalone_server_args(argparse.Namespace(model_path=folder, host="127.0.0.1", device="cpu")))


def encoded(path: str):
    if path.endswith(".mp4"):
        with open(path, "rb") as clip:
            return encoder.encode_videos([clip.read()])
    return encoder.encode([Image.open(path).convert("RGB")])


save_file({path: torch.from_numpy(encoded(path).embeddings) for path in paths}, out)
