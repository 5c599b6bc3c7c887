"""The generation engine: requests in, tokens out, one step at a time, over a KV budget.

Interface (what another backend, e.g. SGLang's ``Engine`` on a GPU, would implement): ``add``,
``step``, ``abort``, ``suspend`` / ``resume`` (sleep: the running requests' KV to the host and
back), and the explicit per-request state below (phase, tokens so far, sampler state, KV cache).

A step: first every waiting request whose KV fits the budget is prefilled (in arrival order)
and gets its first token; then every request that was already running decodes one token. So a
new request's first token never waits for more than the step under way plus its own prefill,
however long the others run. Each request keeps its own KV cache and decodes with its own
forward pass: the scheduling is batched, the arithmetic is exactly that of the request alone
(padding requests of different lengths into one batch changes bf16 results).

KV budget: a request reserves ``prompt + max_new_tokens`` tokens when it is admitted and gives
them back when it ends; one that could never fit is refused when added.
"""

from __future__ import annotations

import collections
import enum
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from connector.transitions import checked_move
from language_side.prompt import Prompt

if TYPE_CHECKING:  # the model's module imports transformers: a transfer-only worker never does
    from language_side.model import LanguageModel, Sequence


class PassInterrupted(Exception):
    """The model stopped a forward pass between two layers because the engine asked it to;
    nothing the pass computed was kept."""


class Phase(enum.Enum):
    WAITING = "waiting"  # added; waits for KV budget (and is still waiting while its prefill runs)
    RUNNING = "running"  # prefilled; decodes one token per step
    FINISHED = "finished"  # stop token, stop string or length; KV given back
    ABORTED = "aborted"  # ended by abort; KV given back


TRANSITIONS = {
    Phase.WAITING: {Phase.RUNNING, Phase.FINISHED, Phase.ABORTED},  # FINISHED: max_new_tokens 1 at prefill
    Phase.RUNNING: {Phase.FINISHED, Phase.ABORTED},
    Phase.FINISHED: set(),
    Phase.ABORTED: set(),
}


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    seed: int | None = None  # sampling is deterministic per request given a seed
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()

    def check(self) -> None:
        """ValueError naming the bad field (the API answers 400 with it)."""
        if not 1 <= self.max_new_tokens <= 1 << 20:
            raise ValueError(f"max_new_tokens must be in 1..{1 << 20}, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (all) or positive, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, got {self.seed}")
        if len(self.stop) > 16 or any(not s or len(s) > 256 for s in self.stop):
            raise ValueError("stop must be at most 16 non-empty strings of at most 256 characters")
        if len(self.stop_token_ids) > 64:
            raise ValueError("stop_token_ids must hold at most 64 ids")


@dataclass
class GenRequest:
    rid: str
    prompt: Prompt
    image_rows: np.ndarray | None  # the received embedding, bf16 bytes [image tokens, hidden * 2]
    params: SamplingParams
    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once finished, "abort" once aborted
    seq: Sequence | None = field(default=None, repr=False)
    saved_kv: list | None = field(default=None, repr=False)  # the KV on the host while the engine sleeps
    prefill_seconds: float = 0.0
    generator: torch.Generator = field(default_factory=torch.Generator, repr=False)

    @property
    def seq_tokens(self) -> int:
        """Tokens in its KV cache now (the prompt and every generated token but the last)."""
        return len(self.prompt.input_ids) + max(len(self.output_ids) - 1, 0)

    @property
    def kv_tokens(self) -> int:
        """What it reserves: the prompt and every token it may generate."""
        return len(self.prompt.input_ids) + self.params.max_new_tokens

    def move(self, phase: Phase) -> None:
        self.phase = checked_move(TRANSITIONS, self.phase, phase, self.rid)


@dataclass(frozen=True)
class StepOutput:
    rid: str
    token: int | None  # generated in this step; None when its prefill failed
    finish_reason: str | None  # set on the request's last output
    error: str = ""  # why a prefill failed (finish_reason "abort")


class Engine:
    def __init__(self, model: LanguageModel, tokenizer, kv_budget_tokens: int, eos_ids: set[int],
                 sleep_kv: str = "keep") -> None:
        """``sleep_kv``: what a suspend does with the KV: ``keep`` (to the host) or
        ``recompute`` (drop it; resume replays the prompt and the generated tokens)."""
        if kv_budget_tokens <= 0:
            raise ValueError(f"the KV budget must be positive, got {kv_budget_tokens}")
        if sleep_kv not in ("keep", "recompute"):
            raise ValueError(f"sleep_kv must be keep or recompute, got {sleep_kv!r}")
        self.model, self.tokenizer, self.eos_ids, self.sleep_kv = model, tokenizer, set(eos_ids), sleep_kv
        self.kv_budget, self.kv_used = kv_budget_tokens, 0
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.running: dict[str, GenRequest] = {}
        self.suspended = False  # asleep: the running requests' KV is on the host (or dropped), no step runs

    def check(self, req: GenRequest) -> None:
        """ValueError (HTTP 400) for a request that could never run: bad sampling parameters, or
        more KV than the whole budget."""
        req.params.check()
        if req.kv_tokens > self.kv_budget:
            raise ValueError(f"{len(req.prompt.input_ids)} prompt tokens + {req.params.max_new_tokens} new "
                             f"tokens need {req.kv_tokens} KV tokens; the KV budget is {self.kv_budget}")

    def add(self, req: GenRequest) -> None:
        self.check(req)
        if req.rid in self.running or any(w.rid == req.rid for w in self.waiting):
            raise ValueError(f"request {req.rid!r} is already in the engine")
        req.generator.manual_seed(req.params.seed if req.params.seed is not None else secrets.randbits(63))
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """End a request in any phase; its KV comes back at once."""
        req = self.running.pop(rid, None) or next((w for w in self.waiting if w.rid == rid), None)
        if req is None:
            return False
        if req.phase == Phase.WAITING:
            self.waiting.remove(req)
        self._end(req, Phase.ABORTED, "abort")
        return True

    def step(self, pause: Callable[[], bool] = lambda: False) -> list[StepOutput]:
        """Prefill what fits, then one decode step for the rest; every token generated. When
        ``pause()`` turns true the step ends at the next decoder layer: the forward pass under
        way is dropped (its request's cache as before it; a prefill is simply run again later,
        from the start: there are no chunks to keep) and the requests not reached take their
        pass in the next step. Each request's tokens depend on its own passes only, so where
        the step ends changes no token; a sleep waits for one layer, not a whole step."""
        if self.suspended:
            raise RuntimeError("the engine is suspended")
        outputs = []
        prefilled: set[str] = set()
        while self.waiting and self.kv_used + self.waiting[0].kv_tokens <= self.kv_budget and not pause():
            req = self.waiting[0]
            start = time.perf_counter()
            try:
                seq = self.model.prefill(req.prompt, req.image_rows, interrupt=pause)
            except PassInterrupted:  # first in line still
                break
            except Exception as exc:  # this request's input (or memory): it alone ends
                self.waiting.popleft()
                self._end(req, Phase.ABORTED, "abort")
                outputs.append(StepOutput(req.rid, None, "abort", f"prefill failed: {type(exc).__name__}: {exc}"))
                continue
            self.waiting.popleft()
            self.kv_used += req.kv_tokens
            req.move(Phase.RUNNING)
            req.seq, req.prefill_seconds = seq, time.perf_counter() - start
            if self.sleep_kv == "keep":
                req.image_rows = None  # in the KV cache now (recompute keeps it to replay the prompt)
            self.running[req.rid] = req
            prefilled.add(req.rid)
            outputs.append(self._emit(req))
        for req in list(self.running.values()):
            if req.rid in prefilled:
                continue
            assert req.seq is not None
            try:
                self.model.decode(req.seq, req.output_ids[-1], interrupt=pause)
            except PassInterrupted:  # its cache as before: it decodes this token in the next step
                break
            outputs.append(self._emit(req))
        return outputs

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def suspend(self) -> int:
        """Between steps: move every running request's KV cache to the host, or drop it with
        ``recompute``; returns the bytes kept. Waiting requests and each request's tokens,
        sampler state and parameters stay as they are."""
        if self.suspended:
            raise RuntimeError("the engine is already suspended")
        saved = {rid: self.model.export_kv(req.seq) for rid, req in self.running.items() if self.sleep_kv == "keep"}
        for rid, req in self.running.items():  # all exported (or it raised, changing nothing): commit
            req.saved_kv, req.seq = saved.get(rid), None
        self.suspended = True
        return sum(k.nbytes + v.nbytes for kv in saved.values() for k, v in kv)

    def restore(self, requests: list[GenRequest]) -> None:
        """Take the requests of a disk checkpoint (written by :meth:`suspend`'s caller in an
        earlier process) into this idle engine, suspended, as they stood: waiting ones wait
        again in their order, running ones hold their KV reservation; :meth:`resume` goes on.
        ValueError, changing nothing, for requests that cannot run here."""
        if not self.idle:
            raise ValueError("the engine already has requests")
        running = [r for r in requests if r.phase == Phase.RUNNING]
        if len({r.rid for r in requests}) != len(requests):
            raise ValueError("two generations have the same rid")
        for req in requests:
            self.check(req)
        if (need := sum(r.kv_tokens for r in running)) > self.kv_budget:
            raise ValueError(f"the running generations reserve {need} KV tokens; the KV budget is {self.kv_budget}")
        self.waiting.extend(r for r in requests if r.phase == Phase.WAITING)
        self.running.update((r.rid, r) for r in running)
        self.kv_used = need
        self.suspended = True

    def resume(self) -> list[StepOutput]:
        """Put every running request's KV back on the device, or recompute it exactly as it was
        built (the prompt's prefill, then one decode per generated token but the last) where it
        was dropped (``recompute``); the next step goes on from it. A request whose KV cannot be
        rebuilt ends alone: its output says why."""
        ended = []
        for req in list(self.running.values()):
            try:
                if req.saved_kv is not None:
                    req.seq, req.saved_kv = self.model.import_kv(req.saved_kv, req.prompt.delta), None
                else:
                    req.seq = self.model.prefill(req.prompt, req.image_rows)
                    for token in req.output_ids[:-1]:
                        self.model.decode(req.seq, token)
            except Exception as exc:
                del self.running[req.rid]
                self._end(req, Phase.ABORTED, "abort")
                ended.append(StepOutput(req.rid, None, "abort", f"its KV could not be restored: "
                                                                f"{type(exc).__name__}: {exc}"))
        self.suspended = False
        return ended

    def _emit(self, req: GenRequest) -> StepOutput:
        """Sample the request's next token from its last logits; end it if that was its last."""
        assert req.seq is not None
        token = sample(req.seq.last_logits, req.params, req.generator)
        req.output_ids.append(token)
        reason = self._finish_reason(req, token)
        if reason is not None:
            del self.running[req.rid]
            self._end(req, Phase.FINISHED, reason)
        return StepOutput(req.rid, token, reason)

    def _finish_reason(self, req: GenRequest, token: int) -> str | None:
        if token in self.eos_ids or token in req.params.stop_token_ids:
            return "stop"
        if req.params.stop:
            longest = max(len(s) for s in req.params.stop)
            # The tail decoded from enough tokens to hold any stop string: a byte-level token
            # holds at least one byte, a character at most four.
            tail = self.tokenizer.decode(req.output_ids[-(4 * longest + 8):])
            if any(s in tail for s in req.params.stop):
                return "stop"
        if len(req.output_ids) >= req.params.max_new_tokens:
            return "length"
        return None

    def _end(self, req: GenRequest, phase: Phase, reason: str) -> None:
        if req.phase == Phase.RUNNING:  # admitted: its reservation comes back
            self.kv_used -= req.kv_tokens
        req.move(phase)
        req.finish_reason, req.seq, req.saved_kv, req.image_rows = reason, None, None, None  # its KV goes with it


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from float32 logits ``[vocab]``: greedy at temperature 0, else top-k, then
    top-p (the smallest set of most likely tokens whose probability reaches it), then a draw
    from the request's own generator."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    scaled = logits.cpu() / params.temperature  # the request's generator lives on the CPU, on any device
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p  # mass before it already enough
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
