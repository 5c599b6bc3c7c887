"""The language worker's checkpoint on disk: its queued and half-received requests, and the
language engine's generations (waiting or running) with everything needed to go on exactly.

Per generation, the JSON holds its rid, phase, sampling parameters, generated ids and prompt
delta; the tensors (``g{i}.*``) its prompt ids, M-RoPE positions and image mask, the image
embedding while it is still needed (not yet prefilled, or ``--sleep-kv recompute``), the state
of its random generator and, with ``--sleep-kv keep``, the keys and values of every layer
(``[tokens, kv_heads, head_dim]``, the model dtype's bits stored as same-width integers:
safetensors' numpy side has no bfloat16). The worker's ``model`` geometry (config hash, dtype,
layers, KV heads, head size, vocabulary) must match for any of it to load.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from connector import checkpoint
from connector.bootstrap import RankRoute
from connector.buffers import Embedding
from connector.receiver import ReceiverCheckpoint
from language_side.engine import GenRequest, Phase, SamplingParams
from language_side.prompt import Prompt

ROLE = "language"
_SAME_WIDTH_INT = {2: (torch.int16, np.int16), 4: (torch.int32, np.int32)}  # by element size
MAX_POSITION = 1 << 31  # M-RoPE positions beyond any context length
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass
class SavedRequest:
    """One request as it stood at sleep: queued (``transfer is None``) or mid-transfer."""

    rid: str
    bootstrap_addr: str
    room: int
    transfer: ReceiverCheckpoint | None


def save(folder: str | Path, geometry: dict, requests: list[SavedRequest], zmq_port: int,
         generations: Sequence[GenRequest] = ()) -> int:
    """``zmq_port``: where this worker's connector listens. A worker restarted on the checkpoint
    listens there again, so encoders see its rooms' owner come back at the same endpoint.
    ``generations``: the suspended engine's requests."""
    entries, tensors = [], {}
    generation_entries = []
    for i, gen in enumerate(generations):
        generation_entries.append(_generation_entry(gen))
        tensors.update(_generation_tensors(f"g{i}", gen))
    for i, req in enumerate(requests):
        entry = {"rid": req.rid, "bootstrap_addr": req.bootstrap_addr, "room": req.room, "transfer": None}
        t = req.transfer
        if t is not None:
            entry["transfer"] = {"landed": t.landed, "total_tokens": t.total_tokens, "resume_rounds": t.resume_rounds,
                                 "rank_ip": t.route.rank_ip, "rank_port": t.route.rank_port,
                                 "incarnation": t.route.incarnation}
            if t.aux is not None:
                tensors[f"{i}.aux"] = t.aux
            if t.landed:
                assert t.data is not None
                tensors.update(checkpoint.embedding_tensors(str(i), t.data, t.landed))
        entries.append(entry)
    return checkpoint.save(folder, ROLE, {**geometry, "requests": entries, "generations": generation_entries,
                                          "zmq_port": zmq_port}, tensors)


def stored_zmq_port(folder: str | Path) -> int:
    """The connector port of the worker that wrote the checkpoint (0 when unknown)."""
    port = checkpoint.peek(folder, ROLE, "zmq_port")
    return port if isinstance(port, int) and 0 < port < 65536 else 0


def load(folder: str | Path, geometry: dict) -> tuple[list[SavedRequest], list[GenRequest]]:
    """Verified requests and generations of a checkpoint, or :class:`CheckpointError` (nothing
    half-loaded)."""
    meta, tensors = checkpoint.load(folder, ROLE, geometry)
    requests = checkpoint.parse_entries(folder, meta, tensors, "requests", lambda i, e, t: _request(i, e, t, geometry))
    generations = checkpoint.parse_entries(folder, {"generations": [], **meta}, tensors, "generations",
                                           lambda i, e, t: _generation(i, e, t, geometry))
    return requests, generations


def _generation_entry(gen: GenRequest) -> dict:
    return {"rid": gen.rid, "phase": gen.phase.value, "delta": gen.prompt.delta, "output_ids": gen.output_ids,
            "params": dataclasses.asdict(gen.params), "prefill_seconds": gen.prefill_seconds,
            "kv": gen.saved_kv is not None}


def _generation_tensors(prefix: str, gen: GenRequest) -> dict[str, np.ndarray]:
    tensors = {f"{prefix}.input_ids": gen.prompt.input_ids, f"{prefix}.positions": gen.prompt.positions,
               f"{prefix}.image_mask": gen.prompt.image_mask, f"{prefix}.generator": gen.generator.get_state().numpy()}
    if gen.image_rows is not None:
        tensors[f"{prefix}.image_rows"] = gen.image_rows
    for layer, (keys, values) in enumerate(gen.saved_kv or []):  # torch lays out a transposed view fastest
        tensors[f"{prefix}.k{layer}"] = keys.contiguous().view(_SAME_WIDTH_INT[keys.element_size()][0]).numpy()
        tensors[f"{prefix}.v{layer}"] = values.contiguous().view(_SAME_WIDTH_INT[values.element_size()][0]).numpy()
    return tensors


def _array(tensors: dict[str, np.ndarray], name: str, dtype, shape: tuple[int | None, ...]) -> np.ndarray:
    """``tensors[name]``, checked: ``ValueError`` when missing or of another dtype or shape
    (``None`` in ``shape``: any length)."""
    array = tensors.get(name)
    if array is None:
        raise ValueError(f"tensor {name} is missing")
    if array.dtype != dtype or len(array.shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(array.shape, shape, strict=True)):
        raise ValueError(f"tensor {name} is {array.shape} {array.dtype}, expected {shape} {np.dtype(dtype)}")
    return array


def _generation(i: int, entry: dict, tensors: dict[str, np.ndarray], geometry: dict) -> GenRequest:
    try:
        return _checked_generation(i, entry, tensors, geometry)
    except (OverflowError, RuntimeError) as exc:  # an infinite number in the JSON, a generator state torch refuses
        raise ValueError(f"generation {i}: {exc}") from None


def _checked_generation(i: int, entry: dict, tensors: dict[str, np.ndarray], geometry: dict) -> GenRequest:
    model = geometry.get("model")
    if model is None:
        raise ValueError("the checkpoint holds generations and this worker has no language model")
    prefix, vocab = f"g{i}", model["vocab_size"]
    phase = Phase(entry["phase"])
    raw = entry["params"]
    params = SamplingParams(int(raw["max_new_tokens"]), float(raw["temperature"]), float(raw["top_p"]),
                            int(raw["top_k"]), None if raw["seed"] is None else int(raw["seed"]),
                            tuple(str(s) for s in raw["stop"]), tuple(int(t) for t in raw["stop_token_ids"]))
    params.check()
    input_ids = _array(tensors, f"{prefix}.input_ids", np.int64, (None,))
    n = len(input_ids)
    positions = _array(tensors, f"{prefix}.positions", np.int64, (3, n))
    prompt = Prompt(input_ids, positions, _array(tensors, f"{prefix}.image_mask", np.bool_, (n,)), int(entry["delta"]))
    if n and (positions.min() < 0 or positions.max() >= MAX_POSITION or prompt.delta != positions.max() + 1 - n):
        raise ValueError(f"generation {entry['rid']!r}: its positions (up to {positions.max()}) and delta "
                         f"{prompt.delta} do not agree")
    prefill_seconds = float(entry["prefill_seconds"])
    if not 0.0 <= prefill_seconds < 1e9:
        raise ValueError(f"generation {entry['rid']!r}: prefill_seconds {prefill_seconds}")
    output_ids = [int(t) for t in entry["output_ids"]]
    if n == 0 or not (0 <= input_ids.min() and input_ids.max() < vocab) or any(not 0 <= t < vocab for t in output_ids):
        raise ValueError(f"generation {entry['rid']!r} has token ids outside the vocabulary of {vocab}")
    if phase not in (Phase.WAITING, Phase.RUNNING) or (phase == Phase.WAITING) != (not output_ids) \
            or len(output_ids) >= params.max_new_tokens:  # a running one has at least one token to go
        raise ValueError(f"generation {entry['rid']!r} is {phase.value} with {len(output_ids)} tokens generated")
    image_rows = None
    if f"{prefix}.image_rows" in tensors:
        image_rows = _array(tensors, f"{prefix}.image_rows", np.uint8, (prompt.image_tokens, geometry["hidden_size"] * 2))
    if prompt.image_tokens and image_rows is None and not (phase == Phase.RUNNING and entry["kv"]):
        raise ValueError(f"generation {entry['rid']!r} needs its image embedding, which is not in the checkpoint")
    generator = torch.Generator()
    state = _array(tensors, f"{prefix}.generator", np.uint8, tuple(generator.get_state().shape))
    generator.set_state(torch.from_numpy(state.copy()))
    gen = GenRequest(str(entry["rid"]), prompt, image_rows, params, phase=phase, output_ids=output_ids,
                     prefill_seconds=prefill_seconds, generator=generator)
    if entry["kv"]:
        dtype = _DTYPES[model["dtype"]]
        stored = _SAME_WIDTH_INT[torch.empty((), dtype=dtype).element_size()][1]
        shape = (gen.seq_tokens, model["kv_heads"], model["head_dim"])
        gen.saved_kv = [tuple(torch.from_numpy(_array(tensors, f"{prefix}.{kind}{layer}", stored, shape).copy())
                              .view(dtype) for kind in "kv") for layer in range(model["layers"])]
    return gen


def _request(i: int, entry: dict, tensors: dict[str, np.ndarray], geometry: dict) -> SavedRequest:
    t = entry["transfer"]
    transfer = None
    if t is not None:
        landed, total = int(t["landed"]), t["total_tokens"]
        data = None
        if landed:
            data = Embedding.empty(int(total), geometry["hidden_size"], geometry["dtype"])
            checkpoint.fill_embedding(tensors, str(i), data, landed)
        aux = tensors.get(f"{i}.aux")
        transfer = ReceiverCheckpoint(int(entry["room"]), str(entry["bootstrap_addr"]),
                                      RankRoute(str(t["rank_ip"]), int(t["rank_port"]), t.get("incarnation")), landed,
                                      None if total is None else int(total), aux, int(t["resume_rounds"]), data)
    return SavedRequest(str(entry["rid"]), str(entry["bootstrap_addr"]), int(entry["room"]), transfer)
