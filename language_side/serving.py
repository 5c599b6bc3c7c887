"""The engine's own thread, and what each HTTP request sees of it.

Handlers (on the event loop) ``submit`` a request and read its :class:`Generation`'s events;
they never touch the engine: additions and aborts go through an inbox that the engine thread
applies between steps, so an abort never waits for a long prefill to end and the event loop
never blocks. Each step's tokens go back to their requests' asyncio queues in one call per
request. Text is decoded on the handler's side (:class:`TextStream`), off the engine's thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from connector.failures import FailureKind, TransferFailure
from language_side.engine import Engine, GenRequest, Phase, SamplingParams, StepOutput
from language_side.prompt import Prompt

if TYPE_CHECKING:
    from language_side.model import LanguageModel

log = logging.getLogger(__name__)

UNCLAIMED_SECONDS = 600.0  # how long a generation restored from disk waits for its client to ask again
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass
class Event:
    token_ids: list[int]  # generated since the last event
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last event
    error: str = ""  # why the engine ended it (with "abort"), if not an abort request


@dataclass
class Generation:
    """One request's handle: its events arrive on ``events`` (on the handler's loop). A
    generation restored from a disk checkpoint has no handler (``loop`` None) until a client
    asks for its rid again: its events wait in ``backlog`` meanwhile."""

    rid: str
    request: GenRequest
    loop: asyncio.AbstractEventLoop | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    added_at: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    backlog: list[Event] = field(default_factory=list)
    _posting: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def post(self, event: Event) -> None:
        """From the engine thread: to the handler's queue, or to the backlog until there is one."""
        with self._posting:
            loop = self.loop
            if loop is None:  # one event holds the tokens so far: the backlog does not grow per step
                if self.backlog and self.backlog[-1].finish_reason is None:
                    last = self.backlog.pop()
                    event = Event(last.token_ids + event.token_ids, event.finish_reason, event.error)
                self.backlog.append(event)
                return
        loop.call_soon_threadsafe(self.events.put_nowait, event)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: a client for a handler-less generation; what waited comes first."""
        with self._posting:
            self.loop = loop
            for event in self.backlog:
                self.events.put_nowait(event)
            self.backlog.clear()

    def timings(self) -> dict[str, float]:
        """Milliseconds: waiting for the KV budget, prefill, to the first token, decoding."""
        end = self.last_token_at or time.monotonic()
        first = self.first_token_at or end
        prefill = self.request.prefill_seconds
        return {"kv_wait_ms": _ms(first - self.added_at - prefill), "prefill_ms": _ms(prefill),
                "first_token_ms": _ms(first - self.added_at), "decode_ms": _ms(end - first)}


def _ms(seconds: float) -> float:
    return round(max(seconds, 0.0) * 1e3, 3)


class GenerationMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("epd_time_to_first_token_seconds", "From the engine taking a request to its first "
                              "token (prefill and waiting for KV budget)", buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("epd_inter_token_latency_seconds", "Between two tokens of one request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.tokens = Counter("epd_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("epd_prompt_tokens", "Prompt tokens prefilled (image tokens included)",
                                     registry=r)
        self.finished = Counter("epd_generations", "Generations ended, by finish reason", ["reason"], registry=r)
        self.aborted = Counter("epd_generations_aborted", "Generations aborted, by the phase they were in",
                               ["phase"], registry=r)
        Gauge("epd_generations_running", "Requests decoding", registry=r).set_function(lambda: len(engine.running))
        Gauge("epd_generations_waiting", "Requests waiting for KV budget", registry=r).set_function(
            lambda: len(engine.waiting))
        Gauge("epd_kv_tokens_used", "KV tokens reserved by running requests", registry=r).set_function(
            lambda: engine.kv_used)
        Gauge("epd_kv_tokens_budget", "KV token budget", registry=r).set_function(lambda: engine.kv_budget)


class GenerationService:
    def __init__(self, model: LanguageModel, tokenizer, kv_budget_tokens: int, max_waiting: int = 256,
                 sleep_kv: str = "keep") -> None:
        """``max_waiting``: requests that may wait for KV budget; more are refused (503)."""
        eos = {i for i in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")) if i is not None}
        self.model, self.tokenizer, self.max_waiting = model, tokenizer, max_waiting
        self.engine = Engine(model, tokenizer, kv_budget_tokens, eos, sleep_kv)
        self.metrics = GenerationMetrics(self.engine)
        self._cv = threading.Condition()
        # ("add", Generation) | ("abort", (rid, why))
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._generations: dict[str, Generation] = {}  # every request not ended, by rid
        # restored from a disk checkpoint and not yet asked for again (ended ones too), by rid
        self._unclaimed: dict[str, Generation] = {}
        self._stop = False
        self._suspended = False  # asleep: no step runs; aborts still apply
        self._stepping = threading.RLock()  # held by the engine thread for each step (and see held())
        self._holding = 0  # callers waiting for (or holding) the engine between steps
        self._thread = threading.Thread(target=self._run, name="language-engine", daemon=True)
        self._thread.start()

    # ---- called from handlers ---------------------------------------------------------------------

    def check_room_for(self, rid: str) -> None:
        """TransferFailure for a rid in use (409) or too many requests waiting (503): checked
        before a request's embedding is fetched, and again when it is submitted."""
        with self._cv:
            self._check_room_for(rid)

    def _check_room_for(self, rid: str) -> None:
        if rid in self._generations:
            raise TransferFailure(FailureKind.CONFLICT, f"request {rid!r} is already generating")
        if (waiting := len(self._generations) - len(self.engine.running)) >= self.max_waiting:
            raise TransferFailure(FailureKind.OVERLOADED, f"{waiting} requests wait for KV budget "
                                                          f"(limit {self.max_waiting})")

    def submit(self, rid: str, prompt: Prompt, image_rows: np.ndarray | None, params: SamplingParams,
               admit: Callable[[], None]) -> Generation:
        """Queue a request: ValueError for one that could never run; TransferFailure from
        :meth:`check_room_for`, or from ``admit``, which runs under the lock :meth:`active`
        takes (so a sleep that counts generations either sees this one or refuses it)."""
        request = GenRequest(rid, prompt, image_rows, params)
        self.engine.check(request)
        gen = Generation(rid, request, asyncio.get_running_loop())
        with self._cv:
            admit()
            self._check_room_for(rid)
            self._generations[rid] = gen
            self._inbox.append(("add", gen))
            self._cv.notify()
        return gen

    def claim(self, rid: str) -> Generation | None:
        """The generation ``rid`` restored from a disk checkpoint, for the client that asks for it
        again (its whole output comes first); None when there is none. Unclaimed ones are
        forgotten after ``UNCLAIMED_SECONDS``."""
        with self._cv:
            self._forget_unclaimed()
            self._cv.notify()  # for the aborts it may have queued
            gen = self._unclaimed.pop(rid, None)
        if gen is not None:
            gen.attach(asyncio.get_running_loop())
        return gen

    def _forget_unclaimed(self) -> None:
        """Under ``_cv``: restored generations nobody asked for within ``UNCLAIMED_SECONDS`` go
        (aborted if still running)."""
        now = time.monotonic()
        for old in [g for g in self._unclaimed.values() if now - g.added_at > UNCLAIMED_SECONDS]:
            del self._unclaimed[old.rid]
            log.warning("rid=%s: restored from disk and never asked for again; forgotten", old.rid)
            if old.rid in self._generations:  # still generating, for nobody
                self._inbox.append(("abort", (old.rid, "restored from disk and never asked for again")))

    def abort(self, rid: str, why: str = "") -> bool:
        """End ``rid`` at the next step boundary; False if it is not generating."""
        with self._cv:
            if rid not in self._generations:
                return False
            self._inbox.append(("abort", (rid, why)))
            self._cv.notify()
        return True

    def abort_all(self, why: str) -> int:
        with self._cv:
            rids = list(self._generations)
            self._inbox.extend(("abort", (rid, why)) for rid in rids)
            self._cv.notify()
        return len(rids)

    def active(self) -> int:
        with self._cv:
            return len(self._generations)

    def suspend(self, level: int) -> dict:
        """Sleep: stop at the next decoder layer (the pass under way is dropped, a prefill rolled
        back to its start; see :meth:`Engine.step`), move every running request's KV to the host
        (or drop it, ``--sleep-kv recompute``) and release the weights (level 1: to host memory,
        level 2: dropped). Requests keep their tokens, sampler state and streams. Says how long
        it waited for the layer under way and how long the suspension itself took."""
        asked = time.perf_counter()
        with self._between_steps():
            held = time.perf_counter()
            with self._cv:  # what was submitted is in the engine (and in a snapshot) from now on
                inbox = list(self._inbox)
                self._inbox.clear()
            for op, arg in inbox:
                self._apply(op, arg)
            kv_bytes = self.engine.suspend()  # raises having changed nothing
            try:
                self.model.release_weights(level)
            except BaseException:
                self._deliver(self.engine.resume())
                raise
            with self._cv:
                self._suspended = True
            return {"generations": len(self.engine.running) + len(self.engine.waiting), "kv_bytes": kv_bytes,
                    "step_wait_ms": _ms(held - asked), "suspend_ms": _ms(time.perf_counter() - held)}

    def snapshot(self) -> list[GenRequest]:
        """While suspended: every request in the engine, waiting ones in their order, with the
        state a disk checkpoint needs (KV on the host, or the image embedding to recompute it)."""
        with self._between_steps():
            if not self._suspended:
                raise RuntimeError("a snapshot needs a suspended engine")
            # shallow copies: an abort while asleep clears a request's fields, never these copies
            return [dataclasses.replace(r) for r in [*self.engine.running.values(), *self.engine.waiting]]

    def restore(self, requests: list[GenRequest]) -> None:
        """Take a disk checkpoint's requests (ValueError, changing nothing, if they cannot run
        here); they go on at :meth:`resume`, each waiting for a client to claim it."""
        with self._between_steps():
            self.engine.restore(requests)
            now = time.monotonic()
            with self._cv:
                for req in requests:
                    gen = Generation(req.rid, req, None, first_token_at=now if req.output_ids else 0.0,
                                     last_token_at=now if req.output_ids else 0.0)
                    if req.output_ids:  # what its first client already had: the whole output is replayed
                        gen.backlog.append(Event(list(req.output_ids)))
                    self._generations[req.rid] = self._unclaimed[req.rid] = gen
                self._suspended = True

    def resume(self) -> float:
        """Wake: weights and KV back on the device; every request goes on from its next token.
        Nothing to do unless suspended; if the weights cannot be read again, it stays suspended
        and says why. Returns the milliseconds it took."""
        with self._between_steps():
            if not self._suspended:
                return 0.0
            start = time.perf_counter()
            try:
                self.model.restore_weights()
            except Exception as exc:
                raise TransferFailure(FailureKind.INTERNAL, f"could not load the language model from "
                                                            f"{self.model.folder} again: {type(exc).__name__}: {exc}") from exc
            self._deliver(self.engine.resume())
            with self._cv:
                self._suspended = False
                self._cv.notify()
            return _ms(time.perf_counter() - start)

    def held(self) -> contextlib.AbstractContextManager[None]:
        """No step starts while in it (a wake-up holds the engine until it is done, so that the
        first step does not compete with it for the CPU); :meth:`resume` may be called inside."""
        return self._between_steps()

    def model_geometry(self) -> dict:
        return self.model.geometry

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the engine between two steps. The engine thread waits while anyone asks for this:
        a lock alone is not fair, and a thread that steps again at once could take it first for
        many steps in a row."""
        with self._cv:
            self._holding += 1
        try:
            with self._stepping:
                yield
        finally:
            with self._cv:
                self._holding -= 1
                self._cv.notify_all()

    def render_metrics(self) -> bytes:
        return generate_latest(self.metrics.registry)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # ---- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                if self._unclaimed:
                    self._forget_unclaimed()
                while not self._stop and (self._holding or not self._inbox and (self._suspended or self.engine.idle)):
                    self._cv.wait(timeout=UNCLAIMED_SECONDS if self._unclaimed else None)
                    if self._unclaimed:
                        self._forget_unclaimed()
                stopping, inbox = self._stop, list(self._inbox)
                self._inbox.clear()
            if stopping:
                with self._stepping:  # not while a wake-up rebuilds the KV
                    self._end_all("the language worker is shutting down")
                return
            with self._stepping:  # a suspend waits for the step under way
                for op, arg in inbox:
                    self._apply(op, arg)
                if self._suspended or self.engine.idle:
                    continue
                try:
                    self._step()
                except Exception as exc:  # a failing step ends what is running, never the thread
                    log.exception("engine step failed")
                    self._end_all(f"engine failure: {type(exc).__name__}: {exc}")

    def _apply(self, op: str, arg) -> None:
        if op == "add":
            gen: Generation = arg
            with self._cv:
                if self._generations.get(gen.rid) is not gen:  # ended before it was added
                    return
            try:
                self.engine.add(gen.request)
            except ValueError as exc:  # checked at submit: not expected
                log.error("rid=%s could not be added: %s", gen.rid, exc)
                self._end(gen, "abort")
        else:
            rid, why = arg
            gen = self._generations.get(rid)
            if gen is None:
                return
            phase = gen.request.phase
            if self.engine.abort(rid):
                self.metrics.aborted.labels(phase.value).inc()
                self._end(gen, "abort", error=why)

    def _step(self) -> None:
        # whoever holds the engine (only sleep and wake-up do) waits for one decoder layer
        self._deliver(self.engine.step(pause=lambda: self._holding > 0))

    def _deliver(self, outputs: list[StepOutput]) -> None:
        """Each request's tokens of a step (or its end) to its handler, in one event."""
        now = time.monotonic()
        by_rid: dict[str, list[int]] = {}
        ended: dict[str, StepOutput] = {}
        for out in outputs:
            tokens = by_rid.setdefault(out.rid, [])
            if out.token is not None:
                tokens.append(out.token)
            if out.finish_reason is not None:
                ended[out.rid] = out
        self.metrics.tokens.inc(sum(len(t) for t in by_rid.values()))
        with self._cv:
            gens = {rid: self._generations.get(rid) for rid in by_rid}
        for rid, tokens in by_rid.items():
            gen = gens[rid]
            if gen is None:  # nobody waits for it (cannot happen: every engine request has a handle)
                self.engine.abort(rid)
                continue
            if tokens and not gen.first_token_at:
                gen.first_token_at = now
                self.metrics.ttft.observe(now - gen.added_at)
                self.metrics.prompt_tokens.inc(len(gen.request.prompt.input_ids))
            elif tokens:
                self.metrics.itl.observe(now - gen.last_token_at)
            gen.last_token_at = now
            if rid in ended:
                out = ended[rid]
                if out.error:
                    log.warning("rid=%s ended: %s", rid, out.error)
                self._end(gen, out.finish_reason, tokens, out.error)
            else:
                gen.post(Event(tokens))

    def _end(self, gen: Generation, reason: str, tokens: list[int] | None = None, error: str = "") -> None:
        with self._cv:
            self._generations.pop(gen.rid, None)
        self.metrics.finished.labels(reason).inc()
        gen.post(Event(tokens or [], reason, error))

    def _end_all(self, why: str) -> None:
        """End every request, whatever its phase, with ``why`` (its additions still queued too)."""
        with self._cv:
            gens = list(self._generations.values())
            self._inbox.clear()
        for gen in gens:
            if gen.request.phase in (Phase.WAITING, Phase.RUNNING):
                self.engine.abort(gen.rid)
            log.warning("rid=%s ended: %s", gen.rid, why)
            self._end(gen, "abort", error=why)


class TextStream:
    """Token ids -> text, incrementally. A byte-level token may hold part of a character: text is
    released only up to the last complete character. With stop strings, the text up to the stop
    string is the answer; the last ``longest stop - 1`` characters are held back until it is
    certain they do not begin one."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.decoded_upto = 0  # ids[:decoded_upto] are in ``text``
        self.text = ""  # decoded so far
        self.sent = 0  # characters of ``text`` handed out

    def push(self, ids: list[int], final: bool = False) -> str:
        """The new text after ``ids`` (all of it when ``final``)."""
        self.ids.extend(ids)
        piece = self.tokenizer.decode(self.ids[self.decoded_upto:], skip_special_tokens=True)
        if final or not piece.endswith("\ufffd"):
            self.text += piece
            self.decoded_upto = len(self.ids)
        end = len(self.text)
        # a stop string cannot begin in text already sent (that much was held back)
        cut = min((i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            end = cut
        elif not final:
            end -= self.holdback
        if end <= self.sent:
            return ""
        new, self.sent = self.text[self.sent:end], end
        return new

    def answer(self) -> str:
        return self.text[:self.sent]
