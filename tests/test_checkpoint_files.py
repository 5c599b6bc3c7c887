"""Checkpoint files (both workers' and SGLang's generations'): JSON and a safetensors blob that
safetensors itself reads back, and nothing in the workers that can unpickle."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_of_the_workers_can_unpickle_anything() -> None:
    sources = [p for d in ("connector", "language_side", "embedding_side", "sglang_ext", "worker_infra")
               for p in (ROOT / d).glob("*.py")]
    assert len(sources) > 40
    for path in sources:
        text = path.read_text()
        assert not re.search(r"import (c?pickle|dill|joblib)|from (c?pickle|dill|joblib) |torch\.load\(|np\.load\(|"
                             r"allow_pickle\s*=\s*True|weights_only\s*=\s*False", text), path


def test_the_streamed_safetensors_file_reads_back_with_safetensors_itself(tmp_path) -> None:
    """The checkpoint writer lays out the safetensors file itself, array by array (no joined
    copy of a gigabyte of KV): safetensors' own loader reads back every dtype and shape it
    writes (a transposed view, an empty array, a scalar), and an array it has no dtype for is
    refused before anything is written."""
    from safetensors.numpy import load

    from connector import checkpoint as files
    arrays = {"kv": np.arange(24, dtype=np.int16).reshape(2, 3, 4).transpose(1, 0, 2), "mask": np.array([True, False]),
              "bytes": np.arange(5, dtype=np.uint8), "empty": np.ones((0, 3), np.float32),
              "scalar": np.array(7, np.int64), "ids": np.arange(4, dtype=np.int32), "f": np.linspace(0, 1, 3)}
    size = files.save(tmp_path, "language", {"x": 1}, arrays)
    blob = (tmp_path / "language.safetensors").read_bytes()
    assert size == len(blob) + len((tmp_path / "language.json").read_bytes())
    back = load(blob)
    assert set(back) == set(arrays)
    header_size = struct.unpack("<Q", blob[:8])[0]
    assert header_size % 8 == 0
    for name, entry in json.loads(blob[8:8 + header_size]).items():  # each array starts aligned
        assert entry["data_offsets"][0] % arrays[name].dtype.itemsize == 0, name
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape and np.array_equal(back[name], array)
    assert files.load(tmp_path, "language", {"x": 1})[0]["x"] == 1  # the checksum covers what was streamed
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match="no safetensors dtype"):
        files.save(tmp_path, "language", {}, {"big_endian": np.zeros(2, ">i4")})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the good checkpoint is untouched
