"""Dynamic batching: texts of concurrent requests are queued and run together, by a token budget
and a maximum wait, in the padded shapes the model compiles once each (:class:`Shapes`).

Requests come from the event loop, the forward runs on one worker thread (JAX releases the GIL
while it computes, so the loop keeps accepting and tokenising), and each request's future is
resolved on its loop when its last text is done. Every padded shape is compiled by
:meth:`Batcher.warm_up`, so no request compiles.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from flaxheads.data.batching import bucket_length
from flaxheads.predict import Classifier
from flaxheads.predict.batches import Encoded, Runner
from flaxheads.training.programs import jit_count


class QueueFull(Exception):
    """The queue holds too many texts to take this request now (answered 429 with Retry-After)."""


class Closed(Exception):
    """The batcher is draining for shutdown and takes no new request (answered 503)."""


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The padded ``(rows, length)`` shapes of every batch: lengths are the classifier's buckets,
    rows one of :meth:`sizes` (powers of two, and 12, 24, 48, ... in between from 8 up) at most
    ``max_batch_size`` and with ``rows * length <= max_batch_tokens`` (at least one row). The
    sizes keep the count of programs at ~1.5 log2(rows) per bucket and the padding rows of a
    batch of 8 texts or more under a quarter of it (powers of two alone: under half)."""

    buckets: tuple[int, ...]
    max_batch_tokens: int
    max_batch_size: int
    width: int = 1  # devices that share a batch: rows are a multiple of it

    def cap(self, length: int) -> int:
        """The most texts one batch of padded ``length`` takes."""
        return max(1, min(_pow2_floor(self.max_batch_size), _pow2_floor(self.max_batch_tokens // length)))

    def sizes(self, length: int) -> list[int]:
        """The row counts of batches of padded ``length`` (before rounding to the width)."""
        out, p = [], 1
        while p <= self.cap(length):
            out.append(p)
            if p >= 8 and p + p // 2 <= self.cap(length):
                out.append(p + p // 2)
            p *= 2
        return out

    def rows(self, n: int, length: int) -> int:
        """Padded rows of a batch of ``n`` texts (the next of :meth:`sizes`, a multiple of the width)."""
        sizes = self.sizes(length)
        rows = next((s for s in sizes if s >= n), sizes[-1])
        return -(-rows // self.width) * self.width

    def all(self) -> list[tuple[int, int]]:
        """Every ``(rows, length)``: what the warm-up compiles."""
        return sorted({(self.rows(r, length), length) for length in self.buckets for r in self.sizes(length)})


def pick(lengths: Sequence[int], shapes: Shapes) -> tuple[int, set[int]]:
    """The next batch of a queue of padded ``lengths`` (oldest first): its length and which texts.

    The oldest text is always in it. The batch's length is one of the buckets from the oldest
    text's up; each takes the texts no longer than it, oldest first, up to its row cap, and the one
    with the fewest padded tokens per text wins (ties: more texts). Short texts then do not pad to
    a long one's length when there are enough of them to fill a batch of their own; a text left
    out goes in a later batch, at the latest the one it leads."""
    lead = lengths[0]
    best, best_cost = lead, None
    for length in (b for b in shapes.buckets if b >= lead):
        n = min(shapes.cap(length), sum(1 for x in lengths if x <= length))
        cost = (shapes.rows(n, length) * length / n, -n)
        if best_cost is None or cost < best_cost:
            best, best_cost = length, cost
    take = [i for i, x in enumerate(lengths) if x <= best][: shapes.cap(best)]
    return best, set(take)


@dataclasses.dataclass(eq=False)
class Job:
    """One request's texts, tokenised; ``future`` gets the outputs ``[n, K]`` in request order."""

    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray] | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False
    out: np.ndarray | None = None
    remaining: int = 0
    started: float | None = None  # when the first batch with one of its texts began
    finished: float | None = None  # when its last text was computed


@dataclasses.dataclass
class _Item:
    job: Job
    index: int
    length: int  # padded length (bucket)


class Batcher:
    """Queue texts, run them in batches on one worker thread, answer each request's future.

    ``max_batch_tokens``: padded tokens (rows x length) per batch; ``max_batch_size``: texts per
    batch; ``max_wait_s``: how long the oldest queued text waits for others before its batch runs
    anyway; ``max_queue``: texts queued at most (a request that would pass it gets
    :class:`QueueFull`); ``devices``: where the forward runs (default: the classifier's runner,
    every local device). ``observe``: called as ``observe(texts, rows, length, seconds, waited)``
    after each batch (metrics)."""

    def __init__(
        self,
        clf: Classifier,
        *,
        max_batch_tokens: int = 16384,
        max_batch_size: int = 32,
        max_wait_s: float = 0.002,
        max_queue: int = 1024,
        devices: Sequence | None = None,
        observe: Callable[[int, int, int, float, Sequence[float]], None] | None = None,
    ):
        if min(max_batch_tokens, max_batch_size, max_queue) < 1 or max_wait_s < 0:
            raise ValueError("max_batch_tokens, max_batch_size and max_queue must be positive, max_wait_s >= 0")
        self.clf = clf
        # the classifier's own runner (shared compiled programs) unless other devices are asked for
        self.runner = clf.runner() if devices is None else Runner(clf.model, clf.params, devices)
        self.shapes = Shapes(tuple(clf.buckets), int(max_batch_tokens), int(max_batch_size), self.runner.width)
        self.max_wait_s = float(max_wait_s)
        self.max_queue = int(max_queue)
        self.observe = observe
        self.token_types = uses_token_types(clf)
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self.compiles_after_warm_up: int | None = None  # programs once warm (None: not warmed up)

    # ---- life ---------------------------------------------------------------------------------
    def warm_up(self) -> int:
        """Compile every padded shape (:meth:`Shapes.all`); returns how many programs there are."""
        for rows, length in self.shapes.all():
            ids = [np.full(length, self.clf.pad_id, np.int32) for _ in range(rows)]
            tt = [np.zeros(length, np.int32) for _ in range(rows)] if self.token_types else None
            self._forward(Encoded(ids, tt, np.zeros(0, np.int64)), rows, length)
        self.compiles_after_warm_up = self.compiles
        return len(self.shapes.all())

    @property
    def compiles(self) -> int:
        """Programs compiled so far (one per padded shape seen)."""
        return jit_count(self.runner.program)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="flaxheads-batcher", daemon=True)
            self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Take no new request, finish the queued ones, stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def queued(self) -> int:
        """Texts waiting (not yet in a running batch)."""
        return len(self._queue)

    # ---- requests (event loop thread) ---------------------------------------------------------
    def submit(self, input_ids: list[np.ndarray], token_type_ids: list[np.ndarray] | None) -> Job:
        """Queue a request's texts; ``await job.future`` gives ``[n, K]`` float32 in their order."""
        loop = asyncio.get_running_loop()
        job = Job(input_ids, token_type_ids, loop.create_future(), loop, remaining=len(input_ids))
        lengths = [bucket_length(len(x), self.shapes.buckets) for x in input_ids]
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down")
            if len(self._queue) + len(input_ids) > self.max_queue:
                raise QueueFull(f"{len(self._queue)} texts are queued, the most is {self.max_queue}")
            self._queue.extend(_Item(job, i, n) for i, n in enumerate(lengths))
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> int:
        """Drop the queued texts of a request whose client left; returns how many were dropped."""
        with self._cond:
            job.cancelled = True
            before = len(self._queue)
            self._queue = collections.deque(it for it in self._queue if it.job is not job)
            return before - len(self._queue)

    # ---- the worker thread --------------------------------------------------------------------
    def _take(self) -> list[_Item] | None:
        """The next batch (None: closing and nothing left). Waits for the first text, then up
        to ``max_wait_s`` for a full batch."""
        with self._cond:
            while True:
                if self._queue:
                    first = self._queue[0]
                    waited = time.perf_counter() - first.job.queued_at
                    if waited >= self.max_wait_s or self._closing or len(self._queue) >= self.shapes.cap(first.length):
                        return self._select()
                    self._cond.wait(self.max_wait_s - waited)
                elif self._closing:
                    return None
                else:
                    self._cond.wait()

    def _select(self) -> list[_Item]:
        """Take the next batch out of the queue (:func:`pick`)."""
        length, take = pick([it.length for it in self._queue], self.shapes)
        chosen: list[_Item] = []
        rest: collections.deque[_Item] = collections.deque()
        for i, it in enumerate(self._queue):
            (chosen if i in take else rest).append(it)
        self._queue = rest
        return chosen

    def _forward(self, enc: Encoded, rows: int, length: int) -> np.ndarray:
        return self.runner(enc, batch_size=rows, buckets=(length,), pad_id=self.clf.pad_id, progress=False)

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            length = max(it.length for it in batch)
            rows = self.shapes.rows(len(batch), length)
            types = [it.job.token_type_ids[it.index] for it in batch if it.job.token_type_ids is not None]
            enc = Encoded(
                [it.job.input_ids[it.index] for it in batch],
                types if len(types) == len(batch) else None,
                np.zeros(0, np.int64),
            )
            started = time.perf_counter()
            for it in batch:
                if it.job.started is None:
                    it.job.started = started
            try:
                out, error = self._forward(enc, rows, length), None
            except Exception as e:  # a bug or a device error: the requests get it, the worker goes on
                out, error = None, e
            if self.observe is not None:
                self.observe(
                    len(batch),
                    rows,
                    length,
                    time.perf_counter() - started,
                    [started - it.job.queued_at for it in batch],
                )
            self._answer(batch, out, error)

    @staticmethod
    def _answer(batch: list[_Item], out: np.ndarray | None, error: Exception | None) -> None:
        for r, it in enumerate(batch):
            job = it.job
            if error is not None:
                if job.remaining > 0:
                    job.remaining = 0
                    _call(job, None, error)
                continue
            if job.remaining <= 0 or out is None:
                continue
            if job.out is None:
                job.out = np.empty((len(job.input_ids), out.shape[1]), np.float32)
            job.out[it.index] = out[r]
            job.remaining -= 1
            if job.remaining == 0:
                job.finished = time.perf_counter()
            if job.remaining == 0 and not job.cancelled:
                _call(job, job.out, None)


def uses_token_types(clf: Classifier) -> bool:
    """Whether every batch carries token types: the tokenizer gives them and the backbone takes
    them. Single texts then send their zeros (what the backbone assumes without them), so texts
    and text pairs share one program per shape instead of two."""
    return "token_type_ids" in clf.tokenizer.model_input_names and "token_type_ids" in getattr(
        clf.model.backbone, "features", ()
    )


def _call(job: Job, value, error: Exception | None) -> None:
    try:
        job.loop.call_soon_threadsafe(_set, job.future, value, error)
    except RuntimeError:  # the loop has closed: nobody waits for the answer any more
        pass


def _set(future: asyncio.Future, value, error: Exception | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
