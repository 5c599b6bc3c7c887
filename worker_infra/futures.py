"""A worker's work (a ``concurrent.futures.Future`` its threads complete) awaited from a handler."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future


async def wait_for_future(future: Future, on_cancel: Callable[[], object]) -> object:
    """Await a worker's future without cancelling it when the client goes away (the worker
    still completes it); ``on_cancel`` is called then, to cancel the work instead."""
    wrapped = asyncio.wrap_future(future)
    wrapped.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if nobody awaits it
    try:
        return await asyncio.shield(wrapped)
    except asyncio.CancelledError:
        on_cancel()
        raise
