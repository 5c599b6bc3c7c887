"""``monolithic.greedy_mismatch`` (strict) and ``long_run_mismatch`` (a long run may end at a step
whose lead was within one bf16 step of the logits): equal ids, a real difference, a difference at a
rounding-sized lead, a length difference."""

from __future__ import annotations

import pytest
import torch
from monolithic import Greedy, bf16_step, greedy_mismatch, long_run_mismatch

pytestmark = pytest.mark.fast

CHOSEN_LOGIT = 20.0  # a bf16 step of 0.125 at this magnitude


def reference(ids: list[int], tie_at: int | None = None, other: int = 0, gap: float = 0.0) -> Greedy:
    """A reference that chose ``ids`` (each 5 nats ahead); at step ``tie_at`` token ``other``
    scored ``gap`` below its choice."""
    logprobs = torch.full((len(ids), 8), -20.0)
    for step, chosen in enumerate(ids):
        logprobs[step, chosen] = -1.0
        logprobs[step, (chosen + 1) % 8] = -6.0
    if tie_at is not None:
        logprobs[tie_at, other] = -1.0 - gap
    return Greedy(ids, logprobs, torch.full((len(ids),), CHOSEN_LOGIT))


def test_bf16_step_is_the_spacing_of_bf16_numbers() -> None:
    values = torch.tensor([1.0, 20.0, -20.0, 0.3, 1000.0]).to(torch.bfloat16)
    steps = bf16_step(values.float())
    assert steps.tolist() == [2.0 ** -7, 0.125, 0.125, 2.0 ** -9, 4.0]
    # the next bf16 number away from zero is exactly one step from each value
    above = torch.nextafter(values.abs(), torch.tensor(float("inf"), dtype=torch.bfloat16))
    assert torch.equal(above.float() - values.abs().float(), steps)


def test_equal_ids_match_and_count_every_step() -> None:
    assert greedy_mismatch([1, 2, 3], reference([1, 2, 3])) is None
    assert long_run_mismatch([1, 2, 3], reference([1, 2, 3])) == (None, 3)


def test_any_other_token_is_a_mismatch_naming_its_step_and_the_lead() -> None:
    why = greedy_mismatch([1, 5, 3], reference([1, 2, 3], tie_at=1, other=5, gap=0.01))
    assert why is not None and why.startswith("step 1: 5 where the reference chose 2 (which led its runner-up by 0.010")


def test_a_long_run_ends_at_a_lead_within_one_bf16_step_of_the_logits() -> None:
    tied = reference([1, 2, 3, 4], tie_at=1, other=5, gap=0.125)
    assert long_run_mismatch([1, 5, 7], tied) == (None, 1)  # the lengths after it are not compared
    wider = reference([1, 2, 3, 4], tie_at=1, other=5, gap=0.25)  # two steps: not rounding
    why, compared = long_run_mismatch([1, 5, 3, 4], wider)
    assert compared == 1 and why.startswith("step 1: 5 where the reference chose 2")


def test_the_same_prefix_with_another_length_is_a_mismatch() -> None:
    assert greedy_mismatch([1, 2], reference([1, 2, 3])) == "2 ids, the reference has 3: [1, 2] vs [1, 2, 3]"
    assert long_run_mismatch([1, 2], reference([1, 2, 3]))[0] == "2 ids, the reference has 3: [1, 2] vs [1, 2, 3]"
