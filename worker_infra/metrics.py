"""Prometheus metrics both workers export on ``/metrics`` (one registry per worker)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from connector import FailureKind

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class WorkerMetrics:
    def __init__(self, role: str, pool_blocks: Callable[[], tuple[int, int]],
                 queues: Callable[[], dict[str, int]], rejected: Callable[[], dict[str, int]]) -> None:
        """``pool_blocks`` returns ``(free, total)``; ``(0, 0)`` while the pool is released.
        ``queues`` returns the current length of each of the worker's queues, by name;
        ``rejected`` the control messages rejected so far, by reason."""
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_RejectedMessages(role, rejected))
        self.requests = Counter("epd_requests", "Requests finished, by outcome", ["role", "outcome"], registry=r)
        self.cancellations = Counter("epd_cancelled", "Requests cancelled by their client, by phase",
                                     ["role", "phase"], registry=r)
        queue = Gauge("epd_queue", "Requests (or bytes, for staged_bytes) waiting in each queue", ["role", "queue"],
                      registry=r)
        for name in queues():
            queue.labels(role, name).set_function(lambda name=name: queues().get(name, 0))
        self.tokens = Counter("epd_tokens", "Embedding tokens moved", ["role"], registry=r)
        self.bytes = Counter("epd_bytes", "Embedding bytes moved", ["role"], registry=r)
        self.resume_rounds = Counter("epd_resume_rounds", "Resume rounds", ["role"], registry=r)
        self.failures = Counter("epd_failures", "Failed requests by kind", ["role", "reason"], registry=r)
        self.latency = Histogram("epd_transfer_latency_seconds", "Request latency from start to embedding ready",
                                 ["role"], buckets=LATENCY_BUCKETS, registry=r)
        free = Gauge("epd_pool_blocks_free", "Free blocks in the pool", ["role"], registry=r)
        used = Gauge("epd_pool_blocks_used", "Blocks handed out", ["role"], registry=r)
        free.labels(role).set_function(lambda: pool_blocks()[0])
        used.labels(role).set_function(lambda: pool_blocks()[1] - pool_blocks()[0])
        self.sleeps = Counter("epd_sleeps", "Sleeps", ["role", "level", "preserve_state"], registry=r)
        self.wakes = Counter("epd_wakes", "Wake-ups", ["role"], registry=r)
        self.sleep_seconds = Histogram("epd_sleep_seconds", "Time to fall asleep", ["role"], buckets=LATENCY_BUCKETS,
                                       registry=r)
        self.wake_seconds = Histogram("epd_wake_seconds", "Time to wake up", ["role"], buckets=LATENCY_BUCKETS,
                                      registry=r)
        self.checkpoint_bytes = Counter("epd_checkpoint_bytes", "Bytes kept over sleep", ["role"], registry=r)
        self.restored = Counter("epd_restored_requests", "Requests restored on wake", ["role"], registry=r)
        self.role = role

    def slept(self, level: int, preserve_state: bool, seconds: float, kept_bytes: int) -> None:
        self.sleeps.labels(self.role, str(level), str(preserve_state).lower()).inc()
        self.sleep_seconds.labels(self.role).observe(seconds)
        self.checkpoint_bytes.labels(self.role).inc(kept_bytes)

    def woke(self, seconds: float, restored: int) -> None:
        self.wakes.labels(self.role).inc()
        self.wake_seconds.labels(self.role).observe(seconds)
        self.restored.labels(self.role).inc(restored)

    def success(self, tokens: int, nbytes: int, rounds: int, seconds: float) -> None:
        self.requests.labels(self.role, "success").inc()
        self.tokens.labels(self.role).inc(tokens)
        self.bytes.labels(self.role).inc(nbytes)
        self.resume_rounds.labels(self.role).inc(rounds)
        self.latency.labels(self.role).observe(seconds)

    def failure(self, kind: FailureKind) -> None:
        self.requests.labels(self.role, "failure").inc()
        self.failures.labels(self.role, kind.value).inc()

    def cancelled(self, phase: str) -> None:
        self.cancellations.labels(self.role, phase).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RejectedMessages:
    """``epd_rejected_messages_total{role, reason}``, read from the connector's own counts."""

    def __init__(self, role: str, counts: Callable[[], dict[str, int]]) -> None:
        self._role, self._counts = role, counts

    def collect(self):
        family = CounterMetricFamily("epd_rejected_messages", "Control messages rejected, by reason",
                                     labels=["role", "reason"])
        for reason, count in sorted(self._counts().items()):
            family.add_metric([self._role, reason], count)
        yield family
