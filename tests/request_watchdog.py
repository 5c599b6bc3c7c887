"""No client request of a test goes unanswered: a test in which one got no answer within its
deadline fails, naming the request.

Every request a test sends through ``requests`` or ``httpx`` (what the ``openai`` client uses)
is tracked until its answer starts (a streamed body's later chunks are the test's to time),
whatever thread sends it; requests our own code sends in this process (a language
manager probing an encoder's health, in the fast tier) are not client requests, and their
timeouts are the product's to handle. Its deadline is the longest its own timeout lets the client
wait for the answer to start (connect, then read), or ``DEFAULT_DEADLINE_S`` (270 s, before
pytest-timeout) for a request sent without one. A request still without an answer past its deadline, or one that
ended in a read timeout, is *unanswered*: the moment it is found, the stacks of every thread
here and in every worker process the tests started (``SIGUSR1``, which our workers answer
with a ``faulthandler`` dump into their logs) are written to this test's output, so a hang
shows where it stopped even if pytest-timeout ends the test later. A test that means to leave
a request unanswered says so with ``@pytest.mark.unanswered_ok("why")``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import requests
import requests.adapters

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = tuple(f"{ROOT / package}{os.sep}" for package in ("connector", "embedding_side", "language_side", "sglang_ext"))
CLIENTS = tuple(f"{ROOT / folder}{os.sep}" for folder in ("tests", "scripts"))
# For a request sent without a timeout: before faulthandler (290 s) and pytest-timeout (300 s).
DEFAULT_DEADLINE_S = 270.0
BETWEEN_TESTS = "(between tests)"
CHECK_EVERY_S = 1.0


@dataclass
class InFlight:
    what: str  # "POST http://127.0.0.1:1234/generate"
    test: str  # the test that sent it
    started: float
    deadline_s: float
    thread: str
    reported: bool = False

    def describe(self, outcome: str) -> str:
        return (f"{self.what} (sent by {self.test} on thread {self.thread}): {outcome} "
                f"(deadline {self.deadline_s:g} s)")


def _thread_stacks() -> str:
    """Every thread's stack in this process (what faulthandler prints, as text that pytest's
    output capture keeps)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        out.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(out)


def _sent_by_product() -> bool:
    """Whether the nearest caller of ours on the stack is the product, not a test or script."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PRODUCT):
            return True
        if name.startswith(CLIENTS) and not name.endswith("request_watchdog.py"):
            return False
        frame = frame.f_back
    return False


def _requests_deadline(timeout: object) -> float:
    """The longest ``requests`` itself would wait for the answer to start: connect, then read
    (one number is each of the two), and a second for the watch's own tick."""
    if timeout is None:
        return DEFAULT_DEADLINE_S
    if isinstance(timeout, tuple):
        return min(DEFAULT_DEADLINE_S, sum(t if t is not None else DEFAULT_DEADLINE_S for t in timeout) + 1)
    return min(DEFAULT_DEADLINE_S, 2 * float(timeout) + 1)  # type: ignore[arg-type]


def _httpx_deadline(request: httpx.Request) -> float:
    timeout = request.extensions.get("timeout") or {}
    parts = [timeout.get("connect"), timeout.get("read")]
    return min(DEFAULT_DEADLINE_S, sum(t if t is not None else DEFAULT_DEADLINE_S for t in parts) + 1)


class RequestWatchdog:
    def __init__(self, dump_workers: Callable[[], str] = lambda: "", check_every_s: float = CHECK_EVERY_S) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[int, InFlight] = {}
        self._ids = iter(range(1, 1 << 62))
        self._unanswered: list[tuple[str, str]] = []  # (test it counts against, description)
        self._current_test = BETWEEN_TESTS
        self._allowed = False
        self._dump_workers = dump_workers
        self._check_every_s = check_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="request-watchdog", daemon=True)

    # ---- wiring -----------------------------------------------------------------------------

    def install(self) -> None:
        """Wrap the clients' send functions (once per process) and start watching."""
        watchdog = self
        sent_by_requests = requests.adapters.HTTPAdapter.send
        sent_by_httpx = httpx.HTTPTransport.handle_request

        def send(adapter, request, stream=False, timeout=None, **kwargs):  # noqa: ANN001, ANN202
            if _sent_by_product():
                return sent_by_requests(adapter, request, stream=stream, timeout=timeout, **kwargs)
            with watchdog.track(f"{request.method} {request.url}", _requests_deadline(timeout)):
                return sent_by_requests(adapter, request, stream=stream, timeout=timeout, **kwargs)

        def handle_request(transport, request):  # noqa: ANN001, ANN202
            if _sent_by_product():
                return sent_by_httpx(transport, request)
            with watchdog.track(f"{request.method} {request.url}", _httpx_deadline(request)):
                return sent_by_httpx(transport, request)

        requests.adapters.HTTPAdapter.send = send  # type: ignore[method-assign]
        httpx.HTTPTransport.handle_request = handle_request  # type: ignore[method-assign]
        self.start()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def begin_test(self, nodeid: str, allowed: bool) -> None:
        """From now on, requests and reports count against ``nodeid``; so does what was found
        between tests (in a module fixture's setup or teardown, or sent by an earlier test)."""
        with self._lock:
            self._current_test, self._allowed = nodeid, allowed
            self._unanswered = [(nodeid if test == BETWEEN_TESTS else test, text) for test, text in self._unanswered]

    def recorded(self, nodeid: str) -> list[str]:
        """What went unanswered so far during the test, allowed or not."""
        with self._lock:
            return [text for test, text in self._unanswered if test == nodeid]

    def end_test(self, nodeid: str) -> list[str]:
        """What went unanswered during the test (none if it was allowed to)."""
        with self._lock:
            found = [text for test, text in self._unanswered if test == nodeid]
            self._unanswered = [(test, text) for test, text in self._unanswered if test != nodeid]
            allowed, self._current_test, self._allowed = self._allowed, BETWEEN_TESTS, False
        return [] if allowed else found

    # ---- tracking ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def track(self, what: str, deadline_s: float) -> Iterator[None]:
        with self._lock:
            key = next(self._ids)
            entry = InFlight(what, self._current_test, time.monotonic(), deadline_s, threading.current_thread().name)
            self._in_flight[key] = entry
        try:
            yield
        except (requests.exceptions.ReadTimeout, httpx.ReadTimeout) as exc:
            self._report(entry, f"no answer: {type(exc).__name__} after {time.monotonic() - entry.started:.1f} s")
            raise
        finally:
            with self._lock:
                del self._in_flight[key]

    def _report(self, entry: InFlight, outcome: str) -> None:
        with self._lock:
            if entry.reported:
                return
            entry.reported = True
            # Counted against the test running now: the sender's, or (if it sent the request from
            # a thread that outlived it) the one that is running when the deadline passes.
            self._unanswered.append((self._current_test, entry.describe(outcome)))
            allowed = self._allowed
        if allowed:
            return  # expected: no stacks to print, no worker to disturb
        print(f"\n[request watchdog] UNANSWERED {entry.describe(outcome)}\n{_thread_stacks()}\n{self._dump_workers()}",
              file=sys.stderr, flush=True)

    def _watch(self) -> None:
        while not self._stop.wait(self._check_every_s):
            now = time.monotonic()
            with self._lock:
                overdue = [e for e in self._in_flight.values()
                           if not e.reported and now - e.started > e.deadline_s]
            for entry in overdue:
                self._report(entry, f"still no answer after {now - entry.started:.1f} s")
