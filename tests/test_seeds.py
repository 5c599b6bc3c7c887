"""Per-request sampling seeds on every batch of our language mode (``sglang_ext/seeds.py``), on
SGLang's own ``SamplingBatchInfo`` and sampler."""

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
    assert info.need_top_k_sampling  # the sorted draw for every row, whatever its neighbours
    again = seeds.seed_every_request(info_for(3), batch)  # the next batch of the same requests
    assert again.sampling_seed.tolist() == [7, drawn, 7]


def test_batches_seeded_already_or_using_min_p_are_left_to_sglang() -> None:
    assert seeds.seed_every_request(info_for(1, min_p=True), batch_of(None)).sampling_seed is None
    given = info_for(1)
    given.sampling_seed = torch.tensor([42])
    assert seeds.seed_every_request(given, batch_of(None)).sampling_seed.tolist() == [42]


def test_sglangs_seeded_sampler_draws_a_rows_token_whatever_the_other_rows(monkeypatch) -> None:
    """What the seed tensor and the sorted draw buy: SGLang's own sampler draws the same token for
    a row (its seed, its position) alone and beside other rows, a greedy one (top_k 1) among
    them. Its seeded draw runs eagerly, as the plugin has it on a CPU (SGLang's is
    ``torch.compile``'d)."""
    monkeypatch.setenv(seeds.ENV, "1")
    monkeypatch.setattr(sampler, "multinomial_with_seed", functools.partial(seeds.eager_on_cpu,
                                                                            sampler.multinomial_with_seed))
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(1)), dim=-1)
    positions, seed = torch.tensor([5, 9, 5, 30]), torch.tensor([11, 12, 13, 14])
    top_ks, top_ps, min_ps = torch.tensor([1000, 1, 1000, 50]), torch.ones(4), torch.zeros(4)

    def draw(rows: slice) -> list[int]:
        return top_k_top_p_min_p_sampling_from_probs_torch(probs[rows], top_ks[rows], top_ps[rows], min_ps[rows],
                                                           False, seed[rows], positions[rows]).tolist()

    together = draw(slice(0, 4))
    assert together == [t for row in range(4) for t in draw(slice(row, row + 1))]
    assert together[1] == probs[1].argmax().item()  # the greedy row
    many = top_k_top_p_min_p_sampling_from_probs_torch(probs[:1].repeat(8, 1), torch.full((8,), 1000), torch.ones(8),
                                                       torch.zeros(8), False, torch.arange(100, 108),
                                                       positions[:1].repeat(8))
    assert len(set(many.tolist())) > 1  # the seed decides, not the row's values alone


def test_the_cpu_hash_is_murmur3_of_seed_position_and_column() -> None:
    """The CPU stand-in for SGLang's hash kernel, against MurmurHash3 over the four 4-byte blocks
    written out on Python integers."""
    from sglang_ext.cpu_shim import murmur_hash32

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
