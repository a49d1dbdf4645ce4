"""Streamed batches: windows shuffled and grouped by length, tokenized in a background thread, each
process holding only its rows of every global batch."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flaxheads.data.batching import bucket_length
from flaxheads.data.packing import merge_rare_shapes, packed_batch, packed_shape
from flaxheads.data.splits import Split, batch_plan, collate, iterate_batches, tokenize
from flaxheads.data.streaming.files import PREFETCH_BATCHES, WINDOW_BATCHES
from flaxheads.data.streaming.splits import StreamSource, char_lengths, column_values, source_rows
from flaxheads.data.tables import LabelSpace, TextTable, encode_labels
from flaxheads.errors import UsageError

# ---- batches -----------------------------------------------------------------------------------


@dataclasses.dataclass
class StreamSplit:
    """A split read from its files while it is used (:func:`stream_batches`, :func:`ordered_batches`);
    ``len`` is its row count from the scan."""

    name: str
    source: StreamSource
    n: int
    space: LabelSpace
    tokenizer: Any
    max_length: int
    window_batches: int = WINDOW_BATCHES
    #: one tokenizing thread at a time (a reader left behind by an abandoned iterator may still run)
    lock: Any = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def __len__(self) -> int:
        return self.n

    def windows(self, size: int, order: Sequence[int] | None = None) -> Iterator[tuple[tuple, Any]]:
        """``((file indices, row numbers), chunk)`` of exactly ``size`` rows each (the last one
        shorter), the files in ``order``."""
        import pyarrow as pa

        held, fis, rws, n = [], [], [], 0
        for fi, rows, chunk in source_rows(self.source, order):
            held.append(chunk)
            fis.append(np.full(len(rows), fi, np.int64))
            rws.append(rows)
            n += len(rows)
            while n >= size:
                table = pa.concat_tables(held, promote_options="default")
                f, r = np.concatenate(fis), np.concatenate(rws)
                yield (f[:size], r[:size]), table.slice(0, size)
                n -= size
                held, fis, rws = ([table.slice(size)], [f[size:]], [r[size:]]) if n else ([], [], [])
        if n:
            yield (np.concatenate(fis), np.concatenate(rws)), pa.concat_tables(held, promote_options="default")

    def rows_table(self, where, chunk, idx: np.ndarray) -> TextTable:
        """The rows ``idx`` of a window as a :class:`TextTable` (row numbers for messages)."""
        src, fis, rws = self.source, where[0][idx], where[1][idx]
        sub = chunk.take(idx)
        texts = column_values(sub, src.text_column)
        pairs = column_values(sub, src.pair_column) if src.pair_column else None
        labels = column_values(sub, src.label_column)
        files = dict.fromkeys(src.files[int(f)] for f in fis)
        return TextTable(
            texts,
            labels,
            ", ".join(files) or src.files[0],
            [f"row {r}" for r in rws],
            pairs,
            src.label_column,
            src.text_column,
        )

    def tokenized(self, where, chunk, idx: np.ndarray) -> Split:
        table = self.rows_table(where, chunk, idx)
        with self.lock:
            labels = encode_labels(table, self.space, self.name)
            return tokenize(table, labels, self.tokenizer, self.max_length, self.name)


def _background(produce, limit: int) -> Iterator:
    """Items of the generator ``produce(stop)`` made in a thread, at most ``limit`` ahead (``stop``:
    a ``threading.Event`` set when the consumer is gone); an exception there is raised here. Closing this
    generator stops the thread (it is blocked on a full queue, not polling: a thread waking during a compile
    would interleave its allocations with the compiler's in the one heap arena)."""
    q: queue.Queue = queue.Queue(maxsize=max(limit, 1))
    stop = threading.Event()
    done = object()

    def run():
        try:
            for item in produce(stop):
                q.put((None, item))
                if stop.is_set():
                    return
            q.put((None, done))
        except BaseException as e:  # handed to the consumer, raised there
            q.put((e, None))

    t = threading.Thread(target=run, daemon=True, name="flaxheads-stream")
    t.start()
    try:
        while True:
            err, item = q.get()
            if err is not None:
                raise err
            if item is done:
                return
            yield item
    finally:
        stop.set()
        while t.is_alive():  # unblock its put; it sees `stop` and ends
            try:
                q.get(timeout=0.05)
            except queue.Empty:
                pass


def _epoch_order(n_files: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    return (
        np.random.default_rng([seed, epoch, 2]).permutation(n_files).tolist()
        if shuffle and n_files > 1
        else list(range(n_files))
    )


def agreed_length(local_max: int) -> int:
    """The longest text of a global batch, from each process's longest (one all-gather)."""
    return agreed_shape((local_max,))[0]


def agreed_shape(local: Sequence[int]) -> tuple[int, ...]:
    """The element-wise largest of every process's ``local`` sizes (one all-gather)."""
    import jax

    if jax.process_count() == 1:
        return tuple(int(x) for x in local)
    from jax.experimental import multihost_utils

    got = multihost_utils.process_allgather(np.asarray(local, np.int32))
    return tuple(int(x) for x in np.max(np.asarray(got).reshape(-1, len(local)), axis=0))


def _global_rows(local: dict, process: int, processes: int) -> dict:
    """A global batch of ``processes`` times this process's rows, holding them in its slice (the
    rows :meth:`Parallel.put_rows` places from it); the other rows are weight-0 padding that
    attends to (and, packed, pools over) one position."""
    if processes == 1:
        return local
    k = len(local["input_ids"])
    out = {}
    for key, v in local.items():
        full = np.zeros((k * processes, *v.shape[1:]), v.dtype)
        if key == "attention_mask":
            full[:, 0] = 1
        if key == "segment_mask":
            full[:, :, 0] = 1
        full[process * k : (process + 1) * k] = v
        out[key] = full
    return out


def stream_batches(
    split: StreamSplit,
    batch_size: int,
    buckets: Sequence[int],
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    start: int = 0,
    pad_id: int = 0,
    group_by_length: bool = True,
    pack: bool = False,
    first_position: int = 0,
    row_multiple: int = 1,
) -> Iterator[dict]:
    """The training batches of one epoch of a streamed split from batch ``start`` on, as
    :func:`~flaxheads.data.splits.iterate_batches` gives them (global batches, padded to a
    bucket, weight-0 padding rows), a pure function of ``(seed, epoch, start)``. In a multi-process
    run each process reads and tokenizes only the rows of each batch it places on its devices.

    ``pack``: each batch's texts packed into shared rows (:mod:`~flaxheads.data.packing`; the
    same examples, weights and loss), a shape few batches of a window need padded to a larger one
    in use, and the shape agreed by every process; ``row_multiple`` is the data-parallel width."""
    import jax

    procs, me = jax.process_count(), jax.process_index()
    if batch_size % procs:
        raise UsageError(f"--batch-size {batch_size} must be a multiple of the {procs} processes")
    local = batch_size // procs
    w_batches = split.window_batches
    first_window, skip = divmod(start, w_batches)
    order = _epoch_order(len(split.source.files), seed, epoch, shuffle)

    def produce(stop):
        for w, (where, chunk) in enumerate(split.windows(batch_size * w_batches, order)):
            if stop.is_set():
                return
            if w < first_window:  # resuming: read past (no tokenisation) up to the window of `start`
                continue
            chars = char_lengths(chunk, split.source.text_column)
            plan = batch_plan(
                chars,
                batch_size,
                key=(seed, epoch, w),
                shuffle=shuffle,
                group_by_length=group_by_length,
                group_batches=None,
            )
            if w == first_window and not pack:
                plan = plan[skip:]
            mine = [idx[me * local : (me + 1) * local] for idx in plan]
            flat = np.concatenate(mine) if mine else np.zeros(0, np.int64)
            toks = split.tokenized(where, chunk, flat) if len(flat) else None
            if toks is None:
                toks = Split(split.name, [], np.zeros((0,), np.int32))
            bounds = np.cumsum([0] + [len(idx) for idx in mine])
            rows = [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
            shapes = (
                merge_rare_shapes([packed_shape(toks, r, local, buckets, row_multiple=local_rows) for r in rows])
                if pack
                else [None] * len(rows)
            )
            # packed shapes are merged over the whole window, so a resumed window reads all of it
            first = skip if w == first_window and pack else 0
            for r, shape in zip(rows[first:], shapes[first:]):
                yield toks, r, shape

    local_rows = max(row_multiple // procs, 1)
    for toks, rows, shape in _background(produce, PREFETCH_BATCHES):
        if pack:
            batch = packed_batch(
                toks,
                rows,
                local,
                buckets,
                pad_id=pad_id,
                first_position=first_position,
                row_multiple=local_rows,
                shape=agreed_shape(shape),
            )
        else:
            t = bucket_length(agreed_length(max([len(toks.input_ids[i]) for i in rows] + [1])), buckets)
            batch = collate(toks, rows, local, (t,), pad_id)
        yield _global_rows(batch, me, procs)


def ordered_batches(split, batch_size: int, buckets: Sequence[int], *, pad_id: int = 0) -> Iterator[dict]:
    """Every example of ``split`` once, in order, in padded batches (evaluation and prediction):
    an in-memory :class:`~flaxheads.data.splits.Split`, or a :class:`StreamSplit` read and
    tokenized in the background (every process reads all of it: evaluation batches are global)."""

    if not isinstance(split, StreamSplit):
        yield from iterate_batches(split, batch_size, buckets, shuffle=False, pad_id=pad_id)
        return

    def produce(stop):
        for where, chunk in split.windows(batch_size * split.window_batches):
            if stop.is_set():
                return
            toks = split.tokenized(where, chunk, np.arange(chunk.num_rows))
            for i in range(0, len(toks), batch_size):
                yield toks, np.arange(i, min(i + batch_size, len(toks)))

    for toks, rows in _background(produce, PREFETCH_BATCHES):
        yield collate(toks, rows, batch_size, buckets, pad_id)
