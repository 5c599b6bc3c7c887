"""The `/dev/shm` segment that carries a received embedding from SGLang's main process to its
scheduler, made on a worker thread instead of SGLang's event loop.

SGLang hands each CPU tensor of a request to its scheduler in a new shared-memory segment
(``mm_utils.wrap_shm_features``: ``posix_fallocate``, then a copy), on the tokenizer manager's
event loop, which every stream's tokens pass through: 35-55 ms for a 3840x2160 image's 75.6 MB
on a 2-vCPU machine, a gap in every decoding stream. An item given to SGLang already as its
``ShmPointerMMData`` is sent as it is. The scheduler unlinks a segment when it maps it (or
discards the request); one that never reaches it (the request refused after its embedding
arrived, or aborted before SGLang sent it on) is unlinked by :func:`unlink` when the request
ends, which is after the scheduler is done with it.
"""

from __future__ import annotations

import asyncio
import logging
from multiprocessing import shared_memory

log = logging.getLogger(__name__)


def sglang_sends_shm() -> bool:
    """Whether SGLang hands CPU tensors to its scheduler in shared memory (the condition
    ``wrap_shm_features`` itself checks)."""
    from sglang.srt.managers.mm_utils import _get_is_default_transport, get_serving

    return not _get_is_default_transport() and not get_serving().skip_tokenizer_init


async def hand_over(items: list) -> list[str]:
    """Each item's ``precomputed_embeddings`` (a CPU tensor whose hash is set) replaced by its
    shared-memory segment, made on a worker thread; the segments' names. An item no segment can
    be made for (``/dev/shm`` full) keeps its tensor, for SGLang to hand over its own way. A
    cancelled call unlinks the segment its thread was making once it is made."""
    from sglang.srt.managers.mm_utils import ShmPointerMMData

    loop = asyncio.get_running_loop()
    names = []
    try:
        for item in items:
            making = loop.run_in_executor(None, ShmPointerMMData, item.precomputed_embeddings, item.hash)
            try:
                segment = await asyncio.shield(making)
            except asyncio.CancelledError:
                making.add_done_callback(lambda made: made.cancelled() or made.exception() is not None
                                         or unlink([made.result().shm_name]))
                raise
            except OSError as exc:
                log.warning("no shared memory for an embedding's handover (%s); SGLang hands it over itself", exc)
                continue
            item.precomputed_embeddings = segment
            names.append(segment.shm_name)
    except BaseException:
        unlink(names)
        raise
    return names


def unlink(names: list[str]) -> None:
    """The segments ``names`` removed, where the scheduler has not removed them already."""
    for name in names:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cannot open handover segment %s to remove it: %s", name, exc)
            continue
        segment.close()
        try:
            segment.unlink()
        except FileNotFoundError:
            pass
