"""sglang_ext/cpu/attention.py against SGLang's own torch_native extend, on the same caches: a
batch mixing a fresh prompt, a cached prefix extended by a chunk, a one-token extension (a
decode request in a mixed batch) and grouped-query heads gives the same attention output.
(Greedy ids through the whole server are checked against transformers in test_sglang_language.)"""

from __future__ import annotations

import pytest
import torch
from monolithic import bf16_step

pytestmark = pytest.mark.fast

HEADS, KV_HEADS, DIM = 4, 2, 16


def rounding_step(values: torch.Tensor, dtype: torch.dtype) -> float:
    """One step of ``dtype`` at ``values``' largest magnitude: a bf16 step, for float32 16 bits finer."""
    bits_finer = torch.finfo(torch.bfloat16).eps / torch.finfo(dtype).eps
    return float(bf16_step(values.float().abs().max()) / bits_finer)


def upstream_extend():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    function = TorchNativeAttnBackend._run_sdpa_forward_extend
    return getattr(function, "__wrapped__", function)  # SGLang's own, whether or not the plugin hooked it


def batch(prefixes: list[int], news: list[int], dtype: torch.dtype):
    generator = torch.Generator().manual_seed(7)
    totals = [p + n for p, n in zip(prefixes, news, strict=True)]
    slots = torch.randperm(sum(totals) + 5, generator=generator)  # a request's tokens scattered in the pool
    req_to_token = torch.zeros(len(totals), max(totals), dtype=torch.long)
    taken = 0
    for row, total in enumerate(totals):
        req_to_token[row, :total] = slots[taken:taken + total]
        taken += total
    k_cache = torch.randn(len(slots), KV_HEADS, DIM, generator=generator).to(dtype)
    v_cache = torch.randn(len(slots), KV_HEADS, DIM, generator=generator).to(dtype)
    query = torch.randn(sum(news), HEADS, DIM, generator=generator).to(dtype)
    as_long = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return (query, k_cache, v_cache, req_to_token, torch.arange(len(totals)), as_long(totals), as_long(prefixes),
            as_long(news))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_the_unpadded_extend_equals_sglangs_padded_one(dtype: torch.dtype, causal: bool) -> None:
    from sglang_ext.cpu.attention import extend_without_padding

    query, k_cache, v_cache, req_to_token, pool_rows, totals, prefixes, news = batch([0, 37, 90, 5], [23, 11, 1, 64],
                                                                                     dtype)
    theirs, ours = torch.empty_like(query), torch.empty_like(query)
    upstream = upstream_extend()
    common = dict(scaling=DIM ** -0.5, enable_gqa=True, causal=causal)
    upstream(None, query, theirs, k_cache, v_cache, req_to_token, pool_rows, totals, prefixes, news, **common)
    returned = extend_without_padding(upstream, None, query, ours, k_cache, v_cache, req_to_token, pool_rows, totals,
                                      prefixes, news, **common)
    assert returned is ours
    # Each side rounds the attention weights and the output in ``dtype`` (and sums in its own order):
    # its result is within about one step of ``dtype`` at the largest |v| (the output is an average of
    # v's rows) from the exact one, so the two are within two such steps of each other.
    assert (ours.float() - theirs.float()).abs().max() <= 2 * rounding_step(v_cache, dtype)


def test_a_sliding_window_keeps_sglangs_code() -> None:
    from sglang_ext.cpu.attention import extend_without_padding

    windows = []

    def recording(*args, **kwargs):
        windows.append(kwargs["sliding_window_size"])
        return args[2]

    query, *rest = batch([3], [5], torch.float32)
    output = torch.empty_like(query)
    assert extend_without_padding(recording, None, query, output, *rest, causal=True, sliding_window_size=4) is output
    assert windows == [4]
