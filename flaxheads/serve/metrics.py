"""Prometheus metrics of one server (its own registry, so several servers in one process do not
share counts): requests by route and status, latency, batch sizes and padded tokens, queue depth
and wait, texts dropped for clients that left, and compiled programs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Latency buckets (seconds): a tiny model answers in ~1 ms, a loaded queue in seconds.
LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The server's metrics; :meth:`text` is the ``/metrics`` body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], int], compiles: Callable[[], int]):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "flaxheads_requests", "HTTP requests answered, by route and status", ("route", "status"), registry=r
        )
        self.latency = Histogram(
            "flaxheads_request_duration_seconds",
            "Request latency, arrival to answer",
            ("route",),
            buckets=LATENCY,
            registry=r,
        )
        self.batch_size = Histogram("flaxheads_batch_size", "Texts per batch run", buckets=SIZES, registry=r)
        self.batch_tokens = Histogram(
            "flaxheads_batch_tokens",
            "Padded tokens (rows x length) per batch run",
            buckets=tuple(128 * 2**i for i in range(10)),
            registry=r,
        )
        self.inference = Histogram(
            "flaxheads_batch_duration_seconds", "Forward time per batch", buckets=LATENCY, registry=r
        )
        self.queue_wait = Histogram(
            "flaxheads_queue_duration_seconds", "Time a text waited before its batch ran", buckets=LATENCY, registry=r
        )
        self.texts = Counter("flaxheads_texts", "Texts computed", registry=r)
        self.cancelled = Counter(
            "flaxheads_cancelled_texts", "Queued texts dropped because their client left", registry=r
        )
        self.rejected = Counter(
            "flaxheads_rejected_requests", "Requests refused: 429 (queue full) or 503 (shutting down)", registry=r
        )
        Gauge("flaxheads_queue_depth", "Texts waiting for a batch", registry=r).set_function(queue_depth)
        Gauge(
            "flaxheads_compiled_programs", "Programs the model holds (one per padded shape)", registry=r
        ).set_function(compiles)

    def observe_batch(self, texts: int, rows: int, length: int, seconds: float, waited: Sequence[float]) -> None:
        """The batcher's ``observe`` callback (worker thread; prometheus_client is thread-safe)."""
        self.batch_size.observe(texts)
        self.batch_tokens.observe(rows * length)
        self.inference.observe(seconds)
        self.texts.inc(texts)
        for w in waited:
            self.queue_wait.observe(w)

    def text(self) -> bytes:
        return generate_latest(self.registry)
