"""A few threads that run the encode side's writes, so a slow peer never holds up the others."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
Job = TypeVar("Job")


class WriteWorkers(Generic[Job]):
    """``count`` threads running ``run(job)`` for submitted jobs, in submission order.

    ``run`` must not raise; if it does, the error is logged and the thread goes on.
    """

    def __init__(self, count: int, name: str, run: Callable[[Job], None]) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._run = run
        self._threads = [threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(count)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._run(job)
            except Exception:  # a bug must never stop a worker: its room would stay in flight
                log.exception("write worker: unexpected error")

    def close(self, timeout: float = 10.0) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join(timeout)
