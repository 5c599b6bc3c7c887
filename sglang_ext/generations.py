"""SGLang's generations in the language worker's disk checkpoint: a worker killed after a sleep
with ``--checkpoint-dir`` and started again goes on with them.

At a sleep that keeps state (``preserve_state=true``), every request SGLang's tokenizer manager
has not finished is written beside the connector's checkpoint (role ``sglang``): its rid, its
prompt as token ids (one placeholder per image), its sampling parameters, the ids generated so
far, its images' sources and, once received, their embedding (rows and grids). A wake-up in the
same process discards the file: SGLang goes on with its own requests.

A worker started on the folder boots asleep; its wake-up submits each saved generation to
SGLang again as its prompt followed by the ids so far (what SGLang's own retract recomputes),
with the rest of its token budget; its embedding comes from the checkpoint, or, for a request
whose images were still at the encoders, they are encoded again (an encoder ends a room whose
``/encode`` caller went away, and the process that called died). A client asking again by rid (native ``/generate``, streamed or not) gets the
whole output: the ids from before the restart, then the rest. Each choice of an ``n>1`` request
is one generation under the rid SGLang gave it (its ``meta_info["id"]``), with its prompt's
embedding. A result nobody asks for within ``UNCLAIMED_SECONDS`` is forgotten.

The file is input like any other: every field is checked (types, token ids within the
vocabulary, the embedding's width) and one bad entry refuses the whole checkpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np

from connector import FailureKind, checkpoint
from sglang_ext.language_flags import GENERATIONS_ROLE
from sglang_ext.mm_receiver import EmbeddingUnavailable, media_sources

log = logging.getLogger(__name__)

ROLE = GENERATIONS_ROLE
UNCLAIMED_SECONDS = 600.0
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's, when a request names none


@dataclasses.dataclass
class SavedGeneration:
    rid: str
    prompt_ids: list[int]  # the prompt as tokenized, one placeholder per image
    output_ids: list[int]  # generated before the sleep
    sampling_params: dict
    images: list[str]  # sources, in prompt order
    rows: np.ndarray | None = None  # uint8 [tokens, 2 * hidden]: the images' bf16 embedding, once received
    grids: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    @property
    def tokens_left(self) -> int:
        budget = self.sampling_params.get("max_new_tokens")
        return (DEFAULT_MAX_NEW_TOKENS if budget is None else int(budget)) - len(self.output_ids)


def snapshot(manager, receiver) -> list[SavedGeneration]:
    """The unfinished generate requests of SGLang's tokenizer manager, as they stand (call with
    SGLang paused: no token comes meanwhile)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    saved = []
    for rid, state in list(manager.rid_to_state.items()):
        obj = state.obj
        if state.finished or not isinstance(obj, GenerateReqInput) or not isinstance(rid, str):
            continue
        if isinstance(obj.text, str):
            prompt_ids = list(manager.tokenizer.encode(obj.text))
        elif isinstance(obj.input_ids, list) and all(isinstance(t, int) for t in obj.input_ids):
            prompt_ids = list(obj.input_ids)
        else:
            log.warning("rid=%s: a prompt given as embeddings or a batch is not kept across a restart", rid)
            continue
        if obj.video_data or obj.audio_data:
            log.warning("rid=%s: a request with videos or audio is not kept across a restart (images only)", rid)
            continue
        rows, grids = receiver.inputs_of(rid, obj.image_data)
        # each choice of an n>1 request is saved as one generation: submitted again with its n,
        # it would be n generations
        params = {key: value for key, value in (obj.sampling_params or {}).items() if key != "n"}
        saved.append(SavedGeneration(rid, prompt_ids, list(state.output_ids), params, media_sources(obj.image_data),
                                     rows, grids))
    return saved


def save(folder: str | Path, generations: list[SavedGeneration], geometry: dict) -> int:
    entries, tensors = [], {}
    for i, gen in enumerate(generations):
        entries.append({"rid": gen.rid, "output_ids": gen.output_ids, "sampling_params": gen.sampling_params,
                        "images": gen.images, "grids": [list(g) for g in gen.grids]})
        tensors[f"g{i}.prompt_ids"] = np.asarray(gen.prompt_ids, dtype=np.int64)
        if gen.rows is not None:
            tensors[f"g{i}.rows"] = gen.rows
    return checkpoint.save(folder, ROLE, {**geometry, "generations": entries}, tensors)


def load(folder: str | Path, geometry: dict) -> list[SavedGeneration]:
    """The checkpoint's generations, every field checked, or :class:`checkpoint.CheckpointError`."""
    return checkpoint.load_entries(folder, ROLE, geometry, "generations",
                                   lambda i, entry, tensors: _generation(i, entry, tensors, geometry))


def _generation(i: int, entry: dict, tensors: dict[str, np.ndarray], geometry: dict) -> SavedGeneration:
    vocab, width = geometry["vocab_size"], 2 * geometry["hidden_size"]
    prompt = tensors.get(f"g{i}.prompt_ids")
    if prompt is None or prompt.dtype != np.int64 or prompt.ndim != 1 or not len(prompt):
        raise ValueError(f"generation {i}: no prompt ids")
    output_ids = [int(t) for t in entry["output_ids"]]
    if not (0 <= prompt.min() and prompt.max() < vocab) or any(not 0 <= t < vocab for t in output_ids):
        raise ValueError(f"generation {i}: token ids outside the vocabulary of {vocab}")
    params = entry["sampling_params"]
    images = entry["images"]
    if not isinstance(params, dict) or not isinstance(images, list) or not all(isinstance(s, str) for s in images):
        raise ValueError(f"generation {i}: malformed sampling_params or images")
    grids = [tuple(int(v) for v in g) for g in entry["grids"]]
    if any(len(g) != 3 or min(g) < 1 for g in grids):
        raise ValueError(f"generation {i}: malformed grids {grids}")
    rows = tensors.get(f"g{i}.rows")
    if rows is not None and (rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != width
                             or len(grids) != len(images)):
        raise ValueError(f"generation {i}: its embedding is {rows.shape} {rows.dtype}, expected [tokens, {width}] "
                         f"uint8 for {len(images)} image(s)")
    gen = SavedGeneration(str(entry["rid"]), prompt.tolist(), output_ids, params, images, rows, grids)
    if gen.tokens_left < 0:
        raise ValueError(f"generation {i}: {len(output_ids)} ids generated of {params.get('max_new_tokens')}")
    return gen


class Restored:
    """Generations a disk checkpoint brought back, run again in SGLang, until their client asks."""

    def __init__(self, manager, receiver) -> None:
        self.manager, self.receiver = manager, receiver
        self._results: dict[str, asyncio.Future] = {}  # rid -> its whole output
        self._own: set[int] = set()  # id() of the requests this class submitted

    def start(self, generations: list[SavedGeneration]) -> None:
        loop = asyncio.get_running_loop()
        for gen in generations:
            result = self._results[gen.rid] = loop.create_future()
            loop.call_later(UNCLAIMED_SECONDS, self._forget, gen.rid, result)
            if gen.tokens_left == 0:
                result.set_result(self._whole(gen, {"output_ids": [], "meta_info": {}}))
                continue
            asyncio.ensure_future(self._run(gen, result))
        log.info("%d generations restored from disk; a client gets each by asking again with its rid",
                 len(generations))

    def claims(self, obj) -> bool:
        """Whether ``obj`` is a client asking again for a restored generation."""
        return isinstance(obj.rid, str) and obj.rid in self._results and id(obj) not in self._own

    async def answer(self, rid: str):
        """The whole output of ``rid``, as SGLang's last event for it (an async generator, like
        SGLang's ``generate_request``)."""
        result = self._results[rid]
        yield await asyncio.shield(result)
        self._results.pop(rid, None)

    async def _run(self, gen: SavedGeneration, result: asyncio.Future) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        if gen.rows is not None:
            self.receiver.restore(gen.rid, gen.rows, gen.grids)
        obj = GenerateReqInput(rid=gen.rid, input_ids=gen.prompt_ids + gen.output_ids, image_data=gen.images or None,
                               sampling_params={**gen.sampling_params, "max_new_tokens": gen.tokens_left})
        self._own.add(id(obj))
        last: dict[str, Any] = {}
        try:
            async for out in self.manager.generate_request(obj):
                last = out
            result.set_result(self._whole(gen, last))
        except Exception as exc:  # noqa: BLE001 - whatever SGLang raised goes to the client that asks
            log.error("rid=%s: restored generation failed: %s", gen.rid, exc)
            result.set_exception(exc)
        finally:
            self._own.discard(id(obj))
            if not result.done():  # cancelled: the server is going down
                result.set_exception(EmbeddingUnavailable(FailureKind.SHUTTING_DOWN,
                                                          f"request {gen.rid}: its restored generation was "
                                                          f"cancelled"))

    def _whole(self, gen: SavedGeneration, last: dict) -> dict:
        ids = gen.output_ids + list(last.get("output_ids") or [])
        skip = gen.sampling_params.get("skip_special_tokens", True)
        meta = dict(last.get("meta_info") or {})
        if "prompt_tokens" in meta:
            meta["prompt_tokens"] -= len(gen.output_ids)
        return {"text": self.manager.tokenizer.decode(ids, skip_special_tokens=skip), "output_ids": ids,
                "meta_info": meta | {"id": gen.rid, "completion_tokens": len(ids),
                                     "restored_tokens": len(gen.output_ids)}}

    def _forget(self, rid: str, result: asyncio.Future) -> None:
        if self._results.get(rid) is result:
            del self._results[rid]
            log.warning("rid=%s: restored from disk and never asked for again; forgotten", rid)
