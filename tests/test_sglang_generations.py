"""The disk checkpoint of SGLang's generations (sglang_ext/generations.py) as a file: what is
written comes back equal, and a file that does not fit this server, or lies, is refused whole
with a clear error. (Across a real kill -9 and restart: test_sglang_language.)"""

from __future__ import annotations

import numpy as np
import pytest

from connector.checkpoint import CheckpointError
from sglang_ext.generations import ROLE, SavedGeneration, load, save

pytestmark = pytest.mark.fast

GEOMETRY = {"hidden_size": 8, "vocab_size": 100}


def generations() -> list[SavedGeneration]:
    rows = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)  # 4 image tokens, bf16 bits of width 8
    return [SavedGeneration("with-image", [1, 2, 3], [7, 8], {"max_new_tokens": 5, "temperature": 0},
                            ["/data/a.png"], rows, [(1, 4, 4)]),
            SavedGeneration("at-the-encoder", [4, 5], [], {"max_new_tokens": 3}, ["/data/b.png"]),
            SavedGeneration("text", [9], [1, 2, 3], {"max_new_tokens": 3}, [])]


def test_what_is_written_comes_back_equal(tmp_path) -> None:
    written = generations()
    assert save(tmp_path, written, GEOMETRY) > 0
    loaded = load(tmp_path, GEOMETRY)
    assert [(g.rid, g.prompt_ids, g.output_ids, g.sampling_params, g.images, g.grids, g.tokens_left)
            for g in loaded] == [(g.rid, g.prompt_ids, g.output_ids, g.sampling_params, g.images, g.grids,
                                  g.tokens_left) for g in written]
    np.testing.assert_array_equal(loaded[0].rows, written[0].rows)
    assert loaded[1].rows is None and loaded[2].tokens_left == 0


@pytest.mark.parametrize("change, why", [
    (lambda g: setattr(g, "output_ids", [7, 100]), "outside the vocabulary of 100"),
    (lambda g: setattr(g, "prompt_ids", [-1, 2]), "outside the vocabulary of 100"),
    (lambda g: setattr(g, "rows", np.zeros((4, 12), np.uint8)), r"expected \[tokens, 16\] uint8"),
    (lambda g: setattr(g, "grids", [(1, 0, 4)]), "malformed grids"),
    (lambda g: setattr(g, "output_ids", [1] * 6), "6 ids generated of 5"),
    (lambda g: setattr(g, "images", [3]), "malformed sampling_params or images"),
])
def test_a_generation_that_lies_refuses_the_whole_file(tmp_path, change, why) -> None:
    written = generations()
    change(written[0])
    save(tmp_path, written, GEOMETRY)
    with pytest.raises(CheckpointError, match=why):
        load(tmp_path, GEOMETRY)


def test_a_file_from_another_model_or_damaged_is_refused(tmp_path) -> None:
    save(tmp_path, generations(), GEOMETRY)
    with pytest.raises(CheckpointError, match="hidden_size=8; this worker has hidden_size=16"):
        load(tmp_path, {**GEOMETRY, "hidden_size": 16})
    blob = tmp_path / f"{ROLE}.safetensors"
    blob.write_bytes(blob.read_bytes()[:-1] + b"\x00")
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load(tmp_path, GEOMETRY)
