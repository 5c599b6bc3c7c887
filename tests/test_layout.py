"""Image grids from the encoder's answer (checked against the rows that came) or, in the
two-request flow, read back from the M-RoPE positions an embedding comes with (the reference
fork's wire), and the reference prompt's placeholder expansion."""

from __future__ import annotations

import pytest
from monolithic import expand_image_pads
from transformers import AutoTokenizer

from embedding_side.positions import image_positions
from language_side.dispatch import image_layout
from language_side.layout import LayoutError, grids_from_positions, image_token_count

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("grids", [[(1, 154, 274)], [(1, 16, 16), (1, 4, 6), (1, 2, 2), (1, 30, 8)], [(1, 2, 2)]])
def test_image_grids_come_back_from_the_positions_on_the_wire(grids) -> None:
    _, mrope, _ = image_positions(grids)  # what the encode side sends
    assert grids_from_positions(mrope) == grids


def test_positions_that_fit_no_image_grid_are_refused() -> None:
    _, mrope, _ = image_positions([(1, 4, 6), (1, 2, 2)])
    shifted = mrope.copy()
    shifted[:, 6:] += 1  # the second image one position too far
    swapped = mrope.copy()
    swapped[[1, 2], :6] = swapped[[2, 1], :6]  # h and w exchanged: a 3x2 grid read as 2x3
    for bad in (shifted, swapped, mrope[:, 1:]):
        with pytest.raises(LayoutError, match="not the layout of any image grid"):
            grids_from_positions(bad)
    with pytest.raises(LayoutError, match=r"must be \[3, n>0\]"):
        grids_from_positions(mrope[:2])


def test_image_grids_from_the_encoders_answer_must_describe_the_rows_that_came() -> None:
    answer = {"grid_thw": [[1, 16, 16], [1, 4, 6]]}
    assert image_layout(answer, 64 + 6, 2) == ([(1, 16, 16), (1, 4, 6)], {})
    for bad, rows, images in ((answer, 71, 2), (answer, 70, 1), ({"grid_thw": [[1, 16]]}, 4, 1), ({}, 4, 1),
                              ({"grid_thw": [[2, 4, 4]]}, 8, 1), ({"grid_thw": [[1, 3, 4]]}, 3, 1),
                              ({"grid_thw": [[1, 0, 4]]}, 0, 1)):
        with pytest.raises(LayoutError):
            image_layout(bad, rows, images)


def test_the_reference_prompt_repeats_each_pad_once_per_row(seeded_checkpoint) -> None:
    tokenizer = AutoTokenizer.from_pretrained(seeded_checkpoint(2048))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text = "<|vision_start|><|image_pad|><|vision_end|>one<|vision_start|><|image_pad|><|vision_end|>two"
    grids = [(1, 4, 6), (1, 30, 8)]
    ids = expand_image_pads(tokenizer, text, grids)
    assert ids.count(pad) == sum(image_token_count(g) for g in grids) == 6 + 60
    assert [t for t in ids if t != pad] == [t for t in tokenizer(text, add_special_tokens=False)["input_ids"] if t != pad]
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_image_pads(tokenizer, text, grids[:1])
