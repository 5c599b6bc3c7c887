"""Worker sleep state: an explicit state machine, one lock serialising sleep and wake."""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from connector import FailureKind, TransferFailure
from worker_infra.http import asleep_error

log = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    AWAKE = "awake"
    FALLING_ASLEEP = "falling_asleep"
    ASLEEP = "asleep"
    WAKING = "waking"
    STOPPING = "stopping"  # shutting down: every request is refused, for good


class SleepGate:
    """Serialises sleep and wake; tells requests whether they may run now.

    A second sleep (or a wake while awake) is a no-op with a warning. Requests arriving while
    the worker is not awake get 503 with Retry-After, or wait when ``queue_while_sleeping``.
    """

    def __init__(self, role: str, queue_while_sleeping: bool = False, max_wait: float = 3600.0) -> None:
        self.role, self.queue_while_sleeping, self.max_wait = role, queue_while_sleeping, max_wait
        self.state = WorkerState.AWAKE
        self._serial = threading.Lock()
        self._state_lock = threading.Lock()

    def is_sleeping(self) -> bool:
        return self.state not in (WorkerState.AWAKE, WorkerState.STOPPING)

    def check_admission(self) -> None:
        """Raise the 503 for a request that may neither run nor wait now."""
        if self.state == WorkerState.STOPPING:
            raise TransferFailure(FailureKind.SHUTTING_DOWN, f"the {self.role} worker is shutting down")
        if self.is_sleeping() and not self.queue_while_sleeping:
            raise asleep_error(self.role)

    def require_awake(self) -> None:
        """Raise the 503 unless the worker is awake now (no waiting: for a last check)."""
        if self.state != WorkerState.AWAKE:
            raise TransferFailure(FailureKind.SHUTTING_DOWN, f"the {self.role} worker is shutting down") \
                if self.state == WorkerState.STOPPING else asleep_error(self.role)

    async def wait_awake(self) -> None:
        """Wait (without holding a thread) until the worker is awake, or raise the 503."""
        deadline = time.monotonic() + self.max_wait
        while self.state != WorkerState.AWAKE:
            self.check_admission()
            if time.monotonic() > deadline:
                raise asleep_error(self.role)
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        """The worker shuts down: refuse everything from now on (final, even for a sleep under way)."""
        self._set(WorkerState.STOPPING)

    def falling_asleep(self) -> AbstractContextManager[bool]:
        """Yields False (and does nothing) unless awake; the worker is asleep once the block ends."""
        return self._moving(WorkerState.AWAKE, WorkerState.FALLING_ASLEEP, WorkerState.ASLEEP, "sleep")

    def waking(self) -> AbstractContextManager[bool]:
        """Yields False (and does nothing) unless asleep; on error the worker stays asleep."""
        return self._moving(WorkerState.ASLEEP, WorkerState.WAKING, WorkerState.AWAKE, "wake-up")

    @contextmanager
    def _moving(self, start: WorkerState, during: WorkerState, end: WorkerState, what: str) -> Iterator[bool]:
        """``during`` for the block, then ``end``; back to ``start`` if it raises. Yields False
        (and changes nothing) unless the worker is in ``start``."""
        with self._serial:
            if self.state != start:
                log.warning("%s worker: %s requested while %s; ignored", self.role, what, self.state.value)
                yield False
                return
            self._set(during)
            try:
                yield True
            except BaseException:
                self._set(start)
                raise
            self._set(end)

    def start_asleep(self) -> None:
        """A worker that boots with a checkpoint on disk waits for its wake-up."""
        self._set(WorkerState.ASLEEP)

    def _set(self, state: WorkerState) -> None:
        with self._state_lock:
            if self.state != WorkerState.STOPPING:
                self.state = state
