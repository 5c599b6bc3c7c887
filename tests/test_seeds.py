"""Per-request sampling seeds on every batch of our language mode and their draw keyed on token
ids (``sglang_ext/seeds.py``), on SGLang's own ``SamplingBatchInfo`` and ``Sampler``."""

from __future__ import annotations

import functools
import types

import pytest
import torch
from sglang.srt.layers import sampler
from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

from sglang_ext import seeds

pytestmark = pytest.mark.fast


def batch_of(*sampling_seeds):
    reqs = [types.SimpleNamespace(sampling_params=types.SimpleNamespace(sampling_seed=s)) for s in sampling_seeds]
    return types.SimpleNamespace(reqs=reqs)


def info_for(n: int, min_p: bool = False):
    return types.SimpleNamespace(sampling_seed=None, need_min_p_sampling=min_p, temperatures=torch.ones(n, 1))


def test_each_request_keeps_its_own_seed_or_gets_one_for_good() -> None:
    batch = batch_of(7, None, 7)
    info = seeds.seed_every_request(info_for(3), batch)
    drawn = batch.reqs[1].sampling_params.sampling_seed
    assert info.sampling_seed.tolist() == [7, drawn, 7] and 0 <= drawn < 2**63
    again = seeds.seed_every_request(info_for(3), batch)  # the next batch of the same requests
    assert again.sampling_seed.tolist() == [7, drawn, 7]


def test_batches_seeded_already_or_using_min_p_are_left_to_sglang() -> None:
    assert seeds.seed_every_request(info_for(1, min_p=True), batch_of(None)).sampling_seed is None
    given = info_for(1)
    given.sampling_seed = torch.tensor([42])
    assert seeds.seed_every_request(given, batch_of(None)).sampling_seed.tolist() == [42]


def test_the_seeded_draw_gives_a_row_its_token_whatever_the_other_rows(monkeypatch) -> None:
    """The top-k/top-p draw as the plugin has it (SGLang's, wrapped by :func:`seeds.vocabulary_draw`)
    draws the same token for a row (its seed, its position) alone and beside other rows, a greedy
    one (top_k 1: its argmax) among them. Its seeded draw runs eagerly, as the plugin has it on a
    CPU (SGLang's is ``torch.compile``'d)."""
    monkeypatch.setenv(seeds.ENV, "1")
    monkeypatch.setattr(sampler, "multinomial_with_seed", functools.partial(seeds.eager_on_cpu,
                                                                            sampler.multinomial_with_seed))
    draw_filtered = functools.partial(seeds.vocabulary_draw, top_k_top_p_min_p_sampling_from_probs_torch)
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)), dim=-1)
    positions, seed = torch.tensor([5, 9, 5, 30]), torch.tensor([11, 12, 13, 14])
    top_ks, top_ps, min_ps = torch.tensor([1000, 1, 1000, 50]), torch.tensor([1.0, 1.0, 0.9, 0.8]), torch.zeros(4)

    def draw(rows: slice) -> list[int]:
        return draw_filtered(probs[rows], top_ks[rows], top_ps[rows], min_ps[rows], False, seed[rows],
                             positions[rows]).tolist()

    together = draw(slice(0, 4))
    assert together == [t for row in range(4) for t in draw(slice(row, row + 1))]
    assert together[1] == probs[1].argmax().item()  # the greedy row
    assert together[3] in probs[3].topk(50).indices.tolist()
    many = draw_filtered(probs[:1].repeat(8, 1), torch.full((8,), 1000), torch.ones(8), torch.zeros(8), False,
                         torch.arange(100, 108), positions[:1].repeat(8))
    assert len(set(many.tolist())) > 1  # the seed decides, not the row's values alone


def test_the_seeded_draw_keeps_or_drops_tied_tokens_together_and_reports_what_it_kept(monkeypatch) -> None:
    """The cut is made on values: of tokens with equal probabilities (bf16 logits tie often) all or
    none are kept, whatever order the sort left them in; a sampling-mask capture gets the kept
    weights in sorted order, their ids and the drawn token's weight, as SGLang's draw gives them."""
    monkeypatch.setenv(seeds.ENV, "1")
    monkeypatch.setattr(sampler, "multinomial_with_seed", functools.partial(seeds.eager_on_cpu,
                                                                            sampler.multinomial_with_seed))
    probs = torch.tensor([[0.3, 0.1, 0.2, 0.2, 0.2, 0.0]])
    for top_k, top_p, kept in ((3, 1.0, {0, 2, 3, 4}), (1000, 0.55, {0, 2, 3, 4}), (1000, 0.25, {0}), (1, 1.0, {0})):
        drawn = set()
        for seed in range(64):
            ids, weights, order, weight = seeds.vocabulary_draw(
                top_k_top_p_min_p_sampling_from_probs_torch, probs, torch.tensor([top_k]), torch.tensor([top_p]),
                torch.zeros(1), False, torch.tensor([seed]), torch.tensor([3]), return_filtered_probs=True)
            drawn.add(ids.item())
            assert {order[0, i].item() for i in range(6) if weights[0, i] > 0} == kept
            assert weight.item() == probs[0, ids.item()].item() and order.dtype == ids.dtype == torch.int32
        assert drawn == kept, (top_k, top_p)


# ---- SGLang's Sampler, as our language mode runs it: a seeded row alone and in a mixed batch ----

VOCAB = 32_768  # a token's rank, and so SGLang's sorted noise, moves more in a larger one (Qwen2.5: 151,936)
TARGET = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 4321}  # the row the tests follow
OTHERS = [{"temperature": 1.0, "top_p": 1.0, "sampling_seed": 0}, {"temperature": 0.7, "top_k": 40, "sampling_seed": 1},
          {"temperature": 1.3, "top_p": 0.5, "sampling_seed": 2}, {"temperature": 0.0},  # greedy
          {"temperature": 1.0, "sampling_seed": 3}]


@pytest.fixture
def seeded_sampler(monkeypatch):
    """``sample(params, logits, positions)``: the token ids SGLang's ``Sampler`` (the pytorch backend,
    a CPU's) draws for requests of ``params`` (``/generate``'s sampling parameters): their
    ``SamplingBatchInfo`` from SGLang's ``from_schedule_batch`` and then :func:`seeds.seed_every_request`,
    with the plugin's hooks on the sampler module, in our language mode."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.sampling import sampling_batch_info
    from sglang.srt.sampling.sampling_params import SamplingParams

    runtime = types.SimpleNamespace(
        deterministic=types.SimpleNamespace(rl_on_policy_target=None, enable_deterministic_inference=False),
        kernel=types.SimpleNamespace(sampling_backend="pytorch"),
        features=types.SimpleNamespace(sampling_mask_max_tokens=64, enable_custom_logit_processor=False,
                                       enable_watermark=False))
    for module in (sampler, sampling_batch_info):
        monkeypatch.setattr(module, "get_exec", lambda: runtime)
    monkeypatch.setattr(sampler, "get_parallel", lambda: types.SimpleNamespace(tp_group=types.SimpleNamespace(
        device_group=None)))
    monkeypatch.setattr(sampler, "is_dp_attention_enabled", lambda: False)
    monkeypatch.setenv(seeds.ENV, "1")
    monkeypatch.setattr(sampler, "multinomial_with_seed", functools.partial(seeds.eager_on_cpu,
                                                                            sampler.multinomial_with_seed))
    monkeypatch.setattr(sampler, "top_k_top_p_min_p_sampling_from_probs_torch", functools.partial(
        seeds.vocabulary_draw, sampler.top_k_top_p_min_p_sampling_from_probs_torch))
    the_sampler = sampler.Sampler()

    class Batch(types.SimpleNamespace):  # SGLang's penalizers keep a weak reference to the batch
        pass

    def sample(params: list[dict], logits: torch.Tensor, positions: list[int]) -> list[int]:
        reqs = []
        for p in params:
            sampling_params = SamplingParams(**p)
            sampling_params.normalize(None)
            sampling_params.verify(VOCAB)
            reqs.append(types.SimpleNamespace(sampling_params=sampling_params, return_sampling_mask=False,
                                              sampling_logprobs_mode=None, custom_logit_processor=None))
        batch = Batch(reqs=reqs, device="cpu")
        info = seeds.seed_every_request(sampling_batch_info.SamplingBatchInfo.from_schedule_batch(batch, VOCAB), batch)
        return the_sampler(LogitsProcessorOutput(next_token_logits=logits.clone()), info, False, [], [],
                           torch.tensor(positions)).tolist()

    return sample


def decode_logits(steps: int, rows: int = 1, seed: int = 5) -> torch.Tensor:
    """``[steps, rows, VOCAB]`` logits on bf16 values, as a bf16 model's last product gives them."""
    return (torch.randn(steps, rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2).bfloat16().float()


def test_a_seeded_rows_tokens_alone_and_among_rows_of_other_sampling_parameters(seeded_sampler) -> None:
    """Same logits for the row, alone and as the third of six rows with other temperatures, top_p,
    top_k, a greedy one: the same token at each of 12 positions. Also for a row without top_p or
    top_k: alone, its batch takes SGLang's plain draw, among the others its top-k/top-p draw."""
    plain = {"temperature": 1.0, "sampling_seed": 99}
    logits, others = decode_logits(12), decode_logits(12, len(OTHERS), seed=7)
    for row in (TARGET, plain):
        alone, together = [], []
        for step in range(12):
            position = 300 + step
            alone += seeded_sampler([row], logits[step], [position])
            batch = torch.cat([others[step, :2], logits[step], others[step, 2:]])
            together.append(seeded_sampler(OTHERS[:2] + [row] + OTHERS[2:], batch, [40 + step] * 2 + [position] +
                                           [7 + step] * 3)[2])
        assert together == alone, row
    assert len(set(alone)) > 6  # sampled, not one token


def test_a_one_step_change_of_a_few_logits_does_not_change_a_seeded_rows_token(seeded_sampler) -> None:
    """What a batch can do to a row's logits: products whose rounding depends on how many rows
    they have move some of them by one bf16 step. Alone, and among the others with 1% of its
    logits one step up: the same token at each of 12 positions, as a greedy row's would be but at
    a near tie. (SGLang's sorted draw keys the noise on ranks, which such a step moves: there most
    of these tokens changed.)"""
    logits = decode_logits(12)
    moved = torch.rand(logits.shape, generator=torch.Generator().manual_seed(6)) < 0.01
    bf16 = logits.bfloat16()
    nudged = torch.where(moved, torch.nextafter(bf16, torch.full_like(bf16, float("inf"))), bf16).float()
    others = decode_logits(1, len(OTHERS), seed=7)[0]
    for step in range(12):
        position = 300 + step
        alone = seeded_sampler([TARGET], logits[step], [position])
        among = seeded_sampler(OTHERS[:2] + [TARGET] + OTHERS[2:], torch.cat([others[:2], nudged[step], others[2:]]),
                               [40] * 2 + [position] + [7] * 3)
        assert among[2] == alone[0], step


def test_the_cpu_hash_is_murmur3_of_seed_position_and_column() -> None:
    """The CPU stand-in for SGLang's hash kernel, against MurmurHash3 over the four 4-byte blocks
    written out on Python integers."""
    from sglang_ext.cpu.shim import murmur_hash32

    def mix(h: int, k: int) -> int:
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        h ^= (k * 0x1B873593) & 0xFFFFFFFF
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        return (h * 5 + 0xE6546B64) & 0xFFFFFFFF

    def murmur(seed: int, position: int, column: int) -> int:
        h = mix(mix(mix(mix(0, seed & 0xFFFFFFFF), seed >> 32), position), column) ^ 16
        h = ((h ^ (h >> 16)) * 0x85EBCA6B) & 0xFFFFFFFF
        h = ((h ^ (h >> 13)) * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    seeds, positions = [0, 1, 42, 2**63 - 1, 123456789012345], [0, 5, 77, 10**6, 3]
    hashed = murmur_hash32(torch.tensor(seeds).to(torch.uint64), torch.tensor(positions), torch.arange(300))
    assert hashed.tolist() == [[murmur(s, p, c) for c in range(300)] for s, p in zip(seeds, positions, strict=True)]
