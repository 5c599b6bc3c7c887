"""``monolithic.greedy_mismatch``: equal ids, a near tie, a real difference, a length difference."""

from __future__ import annotations

import pytest
import torch
from monolithic import NEAR_TIE_NATS, Greedy, greedy_mismatch

pytestmark = pytest.mark.fast


def reference(ids: list[int], tie_at: int | None = None, other: int = 0, gap: float = 0.0) -> Greedy:
    """A reference that chose ``ids``; at step ``tie_at`` token ``other`` scored ``gap`` below its choice."""
    logprobs = torch.full((len(ids), 8), -20.0)
    for step, chosen in enumerate(ids):
        logprobs[step, chosen] = -1.0
    if tie_at is not None:
        logprobs[tie_at, other] = -1.0 - gap
    return Greedy(ids, logprobs)


def test_equal_ids_match() -> None:
    assert greedy_mismatch([1, 2, 3], reference([1, 2, 3])) is None


def test_a_near_tie_ends_the_comparison_even_when_the_lengths_then_differ() -> None:
    # ours took the near-tied token at step 1, then reached the end-of-sequence token sooner
    assert greedy_mismatch([1, 5], reference([1, 2, 3, 4], tie_at=1, other=5, gap=NEAR_TIE_NATS / 2)) is None


def test_a_token_far_below_the_references_choice_is_a_mismatch() -> None:
    why = greedy_mismatch([1, 5], reference([1, 2, 3, 4], tie_at=1, other=5, gap=NEAR_TIE_NATS * 4))
    assert why is not None and why.startswith("step 1: 5 where the reference chose 2")


def test_the_same_prefix_with_another_length_is_a_mismatch() -> None:
    assert greedy_mismatch([1, 2], reference([1, 2, 3])) == "2 ids, the reference has 3: [1, 2] vs [1, 2, 3]"
