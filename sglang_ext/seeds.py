"""Sampling that does not depend on the batch: every request of our language mode samples with a
seed of its own, and its noise is keyed on token ids.

SGLang draws a sampled token from the process-wide generator unless
``--enable-deterministic-inference`` is on (which refuses the CPU's ``torch_native`` attention
backend): a request's tokens then depend on what else ran in its batches, and its
``sampling_seed`` (OpenAI's ``seed``) is ignored. With a seed tensor on the batch, SGLang's own
sampler takes the seeded path instead (``multinomial_with_seed``: the argmax of the log
probabilities plus Gumbel noise from a hash of the seed, the token's position and a column).
This hook, after ``SamplingBatchInfo.from_schedule_batch``, gives every batch that tensor: the
request's ``sampling_seed``, else one drawn for it once and kept on the request (so a retracted
or restored request goes on with the same noise) (:func:`seed_every_request`). Left alone:
batches built with a tensor already (the deterministic flag) and batches that use ``min_p``,
which SGLang's seeded sampler does not take. Greedy requests do not sample: this does not
change them.

Which column the hash gets is the other half. SGLang's plain draw hashes vocabulary columns; its
top-k/top-p draw (``top_k_top_p_min_p_sampling_from_probs_torch``) hashes each row's columns in
its sorted order, so a token's noise depends on its rank: on the values of every other token of
the row. A row's logits can differ in their last bits with its batch (products whose rounding
depends on how many rows they have; bf16 logits tie often), and a one-step change of any token
then moves the ranks, and the noise, of the tokens between: another token, where the plain
draw only changes at a near tie. :func:`vocabulary_draw` replaces that draw for seeded batches:
the same top-k/top-p cut, made on values (tied tokens are kept or dropped together, whatever
order the sort left them in), and the noise of SGLang's plain draw, on vocabulary columns. A row
without top-k or top-p gets exactly the plain draw's token, so a row's token does not depend on
which of the two its neighbours choose either.

On a CPU the seeded draw runs eagerly (:func:`eager_on_cpu`): SGLang compiles it with
``torch.compile``, which on a CPU builds C++ with the system compiler at the first sampled token
(seconds to minutes, and a failure where there is none); the hash is the CPU shim's.
"""

from __future__ import annotations

import os
import secrets

import torch

ENV = "EPD_RESUME_SEEDED_SAMPLING"  # set by the plugin for our language mode; its schedulers inherit it


def arm() -> None:
    """Called in the server's main process before SGLang starts its scheduler."""
    os.environ[ENV] = "1"


def armed() -> bool:
    return os.environ.get(ENV) == "1"


def seed_every_request(info, batch):
    """``info`` (the ``SamplingBatchInfo`` of ``batch``) with a seed per request."""
    if info.sampling_seed is not None or info.need_min_p_sampling or not batch.reqs:
        return info
    seeds = []
    for req in batch.reqs:
        params = req.sampling_params
        if params.sampling_seed is None:
            params.sampling_seed = secrets.randbits(63)
        seeds.append(params.sampling_seed)
    info.sampling_seed = torch.tensor(seeds, dtype=torch.int64).to(info.temperatures.device, non_blocking=True)
    return info


def vocabulary_draw(original, probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                    need_min_p_sampling: bool, sampling_seed: torch.Tensor | None, positions: torch.Tensor, *args,
                    return_filtered_probs: bool = False, **kwargs):
    """Around SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch`` (its top-k/top-p draw):
    for a seeded batch of our language mode, each row's token from its own probabilities, seed,
    position, top_k and top_p only (see the module docstring); anything else is SGLang's."""
    if sampling_seed is None or need_min_p_sampling or args or not armed():
        return original(probs, top_ks, top_ps, min_ps, need_min_p_sampling, sampling_seed, positions, *args,
                        return_filtered_probs=return_filtered_probs, **kwargs)
    from sglang.srt.layers import sampler

    probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    ahead = torch.cumsum(probs_sort, dim=-1) - probs_sort  # the mass ranked before each token, as SGLang cuts on it
    cut = (ranks < top_ks.view(-1, 1)) & ((ahead <= top_ps.view(-1, 1)) | (top_ps.view(-1, 1) >= 1.0))
    # The cut as a value: every token as probable as the least probable one kept stays (ties
    # together, whatever their order in the sort); top_p 1 keeps all, as the plain draw does.
    floor = probs_sort.masked_fill(~cut, float("inf")).amin(dim=-1, keepdim=True)
    keep = probs >= floor
    greedy = top_ks.view(-1, 1) == 1  # top_k 1 is SGLang's greedy: its argmax, the first of tied maxima
    keep = torch.where(greedy, ranks == probs.argmax(dim=-1, keepdim=True), keep)
    logprobs = torch.log(probs).masked_fill_(~keep, float("-inf"))  # the plain draw's log probabilities
    ids = sampler.multinomial_with_seed(logprobs, sampling_seed, positions).view(-1).to(torch.int32)
    if not return_filtered_probs:
        return ids
    # what a sampling-mask capture reads: the kept weights in sorted order, their ids, the token's weight
    kept_sort = probs_sort * keep.gather(1, probs_idx)
    return ids, kept_sort, probs_idx.to(torch.int32), probs.gather(1, ids.long().view(-1, 1)).view(-1)


def eager_on_cpu(original, logprobs, *args, **kwargs):
    """Around SGLang's ``multinomial_with_seed``: its uncompiled function for CPU tensors (in our
    language mode)."""
    if logprobs.device.type == "cpu" and armed():
        return getattr(original, "_torchdynamo_orig_callable", original)(logprobs, *args, **kwargs)
    return original(logprobs, *args, **kwargs)
