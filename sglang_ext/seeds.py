"""Sampling that does not depend on the batch: every request of our language mode samples with a
seed of its own.

SGLang draws a sampled token from the process-wide generator unless
``--enable-deterministic-inference`` is on (which refuses the CPU's ``torch_native`` attention
backend): a request's tokens then depend on what else ran in its batches, and its
``sampling_seed`` (OpenAI's ``seed``) is ignored. With a seed tensor on the batch, SGLang's own
sampler takes the seeded path instead (``multinomial_with_seed``: Gumbel noise from a hash of the
seed, the token's position and the vocabulary column), which is the same for a request whatever
its batch. This hook, after ``SamplingBatchInfo.from_schedule_batch``, gives every batch that
tensor: the request's ``sampling_seed``, else one drawn for it once and kept on the request
(so a retracted or restored request goes on with the same noise), and the same draw for every
row whatever its neighbours (:func:`seed_every_request`). Left alone: batches built with
a tensor already (the deterministic flag) and batches that use ``min_p``, which SGLang's seeded
sampler does not take. Greedy requests do not sample: this does not change them.

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
    # Every seeded batch takes SGLang's sorted (top-k/top-p) draw, which hashes each row's columns
    # in its own sorted order. Its plain draw hashes vocabulary columns instead, and SGLang picks
    # between the two per batch (a neighbour with top_k, greedy ones included, switches the whole
    # batch), so a row's token would depend on its neighbours. Costs a sort of each row per step.
    info.need_top_k_sampling = True
    return info


def eager_on_cpu(original, logprobs, *args, **kwargs):
    """Around SGLang's ``multinomial_with_seed``: its uncompiled function for CPU tensors (in our
    language mode)."""
    if logprobs.device.type == "cpu" and armed():
        return getattr(original, "_torchdynamo_orig_callable", original)(logprobs, *args, **kwargs)
    return original(logprobs, *args, **kwargs)
