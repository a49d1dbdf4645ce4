"""Streamed training data: tables read from disk as training runs, in bounded memory.

For tables too large to hold as Python lists (or given as many shards), the rows are read in
Arrow chunks with Hugging Face ``datasets`` in streaming mode and are never all in memory:

- **Splits by hash**: a row's split is a pure function of ``(seed, file, row number)``
  (:func:`row_hash`), so a split of one big file needs no index and is the same in every run.
- **One scan** (:func:`open_stream`): before training, one pass over every file counts the rows
  of each split, discovers the label space (or checks ``--labels``), rejects bad rows with the
  file, row and column, and keeps the evaluation sample (``eval_limit`` rows with the smallest
  second hash: a uniform sample, however the file is sorted).
- **Windows**: the training rows of an epoch are read in windows of ``window_batches`` batches;
  a window is shuffled by ``(seed, epoch, window)``, grouped by text length (characters, so no
  process needs another's tokens), cut into batches, and its batch order shuffled. The files'
  order is shuffled by ``(seed, epoch)``. The batch at a given step is therefore a pure function
  of ``(seed, epoch, step)``: a resumed run skips to its window and sees the same batches.
- **Per-host rows**: of each global batch, process ``p`` of ``P`` tokenizes and holds only rows
  ``[p * B / P, (p + 1) * B / P)``, the rows it places on its devices; the processes agree on
  the padded length with one small all-gather per step. Every process parses the files' Arrow
  chunks (cheap); the costly parts, tokenisation and the tokenized rows, are split.
- **Background tokenisation**: a thread reads and tokenizes the next windows into a bounded
  queue while the devices train.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import heapq
import json
import math
import os
import queue
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..batching import bucket_length
from ..errors import UsageError
from ..losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL
from ..tables import (PACKAGED, TABLE_FORMATS, DataError, LabelSpace, TextTable, _label_kind, _quiet_datasets,
                      check_csv_quoting, check_utf8, encode_labels)
from .data import SPLITS, Split, collate, tokenize

#: ``--stream`` unset: a table file larger than this streams (smaller ones are read into memory,
#: where the whole epoch is shuffled at once).
STREAM_BYTES = 16 << 20
#: Rows per Arrow chunk read from a file.
CHUNK_ROWS = 8192
#: Batches per shuffle / length-grouping window.
WINDOW_BATCHES = 32
#: Tokenized batches the background thread may hold ahead of the training loop.
PREFETCH_BATCHES = 2 * WINDOW_BATCHES


# ---- files ---------------------------------------------------------------------------------

def table_files(spec: str) -> list[str]:
    """The files of a table: one file, or the sorted matches of a glob (``shards/*.parquet``)."""
    files = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise DataError(f"{spec!r}: no such file" + (" matches" if glob.has_magic(spec) else ""))
    exts = {Path(f).suffix.lower() for f in files}
    bad = sorted(e for e in exts if e not in TABLE_FORMATS)
    if bad:
        raise DataError(f"{spec}: unsupported file type {bad[0]!r}; use one of {sorted(TABLE_FORMATS)}")
    if len({TABLE_FORMATS[e] for e in exts}) > 1:
        raise DataError(f"{spec}: the files mix formats ({sorted(exts)}); give one format per table")
    return files


def streams(spec: str | None, want: bool | None) -> bool:
    """Whether the table ``spec`` is streamed: ``want`` (``--stream`` / ``--no-stream``) when
    given; else for a glob, or a table file larger than :data:`STREAM_BYTES`. Packaged data and
    class folders are read into memory."""
    if spec is None or os.path.isdir(spec) or spec in PACKAGED:
        return False
    if want is not None:
        return want
    if glob.has_magic(spec):
        return True
    return os.path.isfile(spec) and Path(spec).suffix.lower() in TABLE_FORMATS and os.path.getsize(spec) > STREAM_BYTES


_TORCH_FLAG = threading.Lock()


@contextlib.contextmanager
def _torch_unused():
    """``datasets`` makes each streaming dataset a subclass of torch's ``IterableDataset`` when torch
    is installed, importing torch (~0.5 GB resident) in a process that never uses it: while a
    dataset is built, and torch is not imported yet, ``datasets`` is told it is unavailable."""
    import datasets

    if "torch" in sys.modules:
        yield
        return
    with _TORCH_FLAG:
        was = datasets.config.TORCH_AVAILABLE
        datasets.config.TORCH_AVAILABLE = False
        try:
            yield
        finally:
            datasets.config.TORCH_AVAILABLE = was


def read_chunks(path: str, rows: int = CHUNK_ROWS) -> Iterator[Any]:
    """A table file as ``pyarrow.Table`` chunks of up to ``rows`` rows (``datasets`` streaming),
    with one :class:`DataError` naming the file (and line) for a file it cannot read."""
    import datasets

    ext = Path(path).suffix.lower()
    fmt = TABLE_FORMATS[ext]
    kw = {"delimiter": "\t"} if ext == ".tsv" else {}
    datasets.disable_progress_bars()
    n = 0
    try:
        with _quiet_datasets():
            with _torch_unused():
                ds = datasets.load_dataset(fmt, data_files=[path], split="train", streaming=True, **kw)
                chunks = ds.with_format("arrow").iter(batch_size=rows)
            for chunk in chunks:
                n += chunk.num_rows
                yield chunk
    except DataError:
        raise
    except Exception as e:  # the builders raise many types; say what is wrong with the file
        if fmt != "parquet":
            check_utf8(path)
        if fmt == "csv":
            check_csv_quoting(path, kw.get("delimiter", ","))
        raise DataError(f"{path}: could not read it as {fmt}: {e}") from None
    if n == 0:
        raise DataError(f"{path}: no rows (empty dataset)")


# ---- rows and splits ---------------------------------------------------------------------------

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def row_hash(seed: int, file_index: int, rows: np.ndarray, salt: int = 0) -> np.ndarray:
    """A uniform number in [0, 1) per row, from ``(seed, salt, file index, row number)``: the same in
    every run, process and chunking (splitmix64)."""
    key = _mix64(np.asarray([((seed << 8) + salt) % (1 << 64)], np.uint64))[0]
    x = _mix64((np.asarray(rows, np.uint64) + np.uint64(file_index << 40)) ^ key)
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def split_parts(u: np.ndarray, fractions: Sequence[float]) -> np.ndarray:
    """The split index of each row from its hash ``u``: the fractions cut [0, 1)."""
    cuts = np.cumsum(np.asarray(fractions, np.float64))[:-1]
    return np.searchsorted(cuts, u, side="right")


@dataclasses.dataclass(frozen=True)
class StreamSource:
    """The rows of one split: files, columns, and (for a hash split of the files) which part."""

    name: str
    files: tuple[str, ...]
    text_column: str = "text"
    label_column: str = "label"
    pair_column: str | None = None
    fractions: tuple[float, ...] | None = None  # None: every row is this split's
    part: int = 0
    seed: int = 0

    @property
    def columns(self) -> dict[str, str]:
        """The columns read, each with the flag that names it."""
        named = ((self.text_column, "--text-column"), (self.pair_column, "--text-pair-column"),
                 (self.label_column, "--label-column"))
        return {c: flag for c, flag in named if c is not None}


def file_rows(files: Sequence[str], columns: dict[str, str], order: Sequence[int] | None = None,
              ) -> Iterator[tuple[int, np.ndarray, Any]]:
    """``(file index, 1-based row numbers, chunk of the columns)`` for every chunk of the files,
    in ``order`` (file indices; default as given). ``columns``: name -> the flag that chose it,
    named when the column is missing."""
    for fi in (range(len(files)) if order is None else order):
        first = 1
        for chunk in read_chunks(files[fi]):
            if first == 1:
                for col, flag in columns.items():
                    if col not in chunk.column_names:
                        raise DataError(f"{files[fi]}: no column {col!r} (columns: {chunk.column_names}); "
                                        f"choose one with {flag}")
            rows = np.arange(first, first + chunk.num_rows, dtype=np.int64)
            first += chunk.num_rows
            yield fi, rows, chunk.select(list(columns))


def source_rows(src: StreamSource, order: Sequence[int] | None = None) -> Iterator[tuple[int, np.ndarray, Any]]:
    """:func:`file_rows` of the source, only the rows of its split."""
    for fi, rows, chunk in file_rows(src.files, src.columns, order):
        if src.fractions is not None:
            keep = np.flatnonzero(split_parts(row_hash(src.seed, fi, rows), src.fractions) == src.part)
            if len(keep) < len(rows):
                rows, chunk = rows[keep], chunk.take(keep)
        if len(rows):
            yield fi, rows, chunk


def arr_table(arr):
    """One array as a one-column (``v``) table."""
    import pyarrow as pa

    return pa.table({"v": arr})


# ---- the scan: counts, labels, bad rows, evaluation sample -------------------------------------

def _is_json(arr) -> bool:
    """A column of mixed types, which ``datasets`` reads as JSON text per value."""
    import pyarrow as pa

    return isinstance(arr.type, pa.BaseExtensionType) and "json" in str(arr.type)


def column_values(chunk, col: str) -> list:
    """A column of a chunk as Python values (JSON text of a mixed-type column decoded)."""
    arr = chunk.column(col)
    if _is_json(arr):
        chunks = arr.chunks if hasattr(arr, "chunks") else [arr]
        return [None if v is None else json.loads(v) for c in chunks for v in c.storage.to_pylist()]
    return arr.to_pylist()


def char_lengths(chunk, col: str) -> np.ndarray:
    """Characters per text (what windows group by: no tokenizer needed)."""
    import pyarrow.compute as pc

    arr = chunk.column(col)
    if _is_json(arr):
        return np.asarray([len(str(v)) for v in column_values(chunk, col)], np.int64)
    return np.asarray(pc.utf8_length(arr).to_numpy(zero_copy_only=False), np.int64)


def _check_texts(path: str, rows: np.ndarray, chunk, col: str) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = chunk.column(col)
    if _is_json(arr):
        for r, v in zip(rows, column_values(chunk, col)):
            if not isinstance(v, str) or not v.strip():
                what = "missing" if v is None else "empty" if isinstance(v, str) else f"not text ({type(v).__name__})"
                raise DataError(f"{path}: row {r}, column {col!r}: text is {what}. Remove the row or fill in its text.")
        return
    if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
        if pa.types.is_null(arr.type):
            what = "missing"
        else:
            v = arr[0].as_py()
            what = f"not text ({type(v).__name__})"
        raise DataError(f"{path}: row {rows[0]}, column {col!r}: text is {what}. Remove the row or fill in its text.")
    bad = pc.or_kleene(pc.is_null(arr), pc.equal(pc.utf8_trim_whitespace(arr), ""))
    bad = np.asarray(pc.fill_null(bad, True).to_numpy(zero_copy_only=False))
    if bad.any():
        i = int(np.argmax(bad))
        what = "missing" if arr[i].as_py() is None else "empty"
        raise DataError(f"{path}: row {rows[i]}, column {col!r}: text is {what}. Remove the row or fill in its text.")


@dataclasses.dataclass
class _LabelStats:
    """What a streaming pass learns about one split's label column."""

    kinds: dict = dataclasses.field(default_factory=dict)  # kind -> (file, row, value) of its first row
    values: dict = dataclasses.field(default_factory=dict)  # class key -> (file, row, raw value) of its first row
    non_integer: bool = False  # a number that is not an integer (regression)
    width: int | None = None  # list length of the first row (multi-target regression)

    def add(self, path: str, rows: np.ndarray, arr, label_column: str) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        t = arr.type
        if _is_json(arr):
            return self._add_values(path, rows, column_values(arr_table(arr), "v"), label_column)
        missing = pc.is_null(arr, nan_is_null=True)
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            missing = pc.or_kleene(missing, pc.equal(pc.utf8_trim_whitespace(arr), ""))
        missing = np.asarray(pc.fill_null(missing, True).to_numpy(zero_copy_only=False))
        if missing.any():
            i = int(np.argmax(missing))
            raise DataError(f"{path}: row {rows[i]}, column {label_column!r}: label is missing. "
                            "Every row needs a label.")
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            kind = "a list"
            if self.width is None:
                self.width = len(arr[0].as_py())
            flat = pc.list_flatten(arr)
            if pa.types.is_floating(flat.type) and len(flat) and not pc.all(pc.equal(flat, pc.floor(flat))).as_py():
                self.non_integer = True
            parents = np.asarray(pc.list_parent_indices(arr).to_numpy(zero_copy_only=False))
            self._values(path, rows, flat, lambda j: int(parents[j]), arr, as_text=True)
        elif pa.types.is_string(t) or pa.types.is_large_string(t):
            kind = "text"
            self._values(path, rows, arr, lambda j: j, arr, as_text=True)
        elif pa.types.is_integer(t) or pa.types.is_boolean(t) or pa.types.is_floating(t):
            kind = "a number"
            if pa.types.is_floating(t) and not pc.all(pc.equal(arr, pc.floor(arr))).as_py():
                self.non_integer = True
            if not self.non_integer:
                self._values(path, rows, pc.cast(arr, pa.int64()), lambda j: j, arr, as_text=False)
        else:
            kind = f"a {t}"
        if kind not in self.kinds:
            self.kinds[kind] = (path, int(rows[0]), arr[0].as_py())

    def _add_values(self, path: str, rows: np.ndarray, values: list, label_column: str) -> None:
        """The same, from Python values (a column of mixed types)."""
        for r, v in zip(rows, values):
            if v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip()):
                raise DataError(f"{path}: row {r}, column {label_column!r}: label is missing. Every row needs a label.")
            kind = _label_kind(v)
            self.kinds.setdefault(kind, (path, int(r), v))
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, float) and not x.is_integer():
                    self.non_integer = True
                    continue
                key = str(int(x)) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)
                self.values.setdefault(key, (path, int(r), v))

    def _values(self, path, rows, flat, row_of, arr, *, as_text: bool) -> None:
        import pyarrow.compute as pc

        if self.non_integer and not as_text:
            return
        for v in pc.unique(flat).to_pylist():
            key = str(v) if as_text else str(int(v))
            if key not in self.values:
                j = row_of(int(pc.index(flat, v).as_py()))
                self.values[key] = (path, int(rows[j]), arr[j].as_py())


def label_space(stats: _LabelStats, label_column: str, problem_type: str | None = None, *,
                label_ids: bool = False, names: Sequence[str] | None = None) -> LabelSpace:
    """The label space a streaming pass found, by :func:`flaxheads.tables.infer_label_space`'s
    rules (``names``: given by ``--labels`` instead)."""
    if len(stats.kinds) > 1:
        files = {p for p, _, _ in stats.kinds.values()}
        one = files.pop() if len(files) == 1 else None
        seen = ", ".join(f"{'' if one else p + ': '}row {r} has {kind} ({v!r})"
                         for kind, (p, r, v) in stats.kinds.items())
        raise DataError(f"{one + ': ' if one else ''}column {label_column!r} mixes label kinds: {seen}. Use one kind "
                        "in every row: a list of "
                        "label names (multi-label), one class name or integer id (single-label), or a number "
                        "(regression).")
    kind = next(iter(stats.kinds), "text")
    if problem_type is None:
        problem_type = (MULTI_LABEL if kind == "a list" else
                        REGRESSION if kind == "a number" and stats.non_integer else SINGLE_LABEL)
    if problem_type == REGRESSION:
        return LabelSpace(REGRESSION, None, stats.width or 1)
    if problem_type == MULTI_LABEL and kind != "a list":
        p, r, v = next(iter(stats.kinds.values()))
        raise DataError(f"{p}: row {r}, column {label_column!r}: multi-label needs a list of label names per row, "
                        f"got {v!r}")
    if names is not None:
        names = [str(n) for n in names]
    elif kind == "a number":
        ids = sorted(int(k) for k in stats.values)
        if ids and ids[0] < 0:
            raise DataError(f"column {label_column!r}: negative class id {ids[0]}")
        names = [str(i) for i in (range(ids[-1] + 1) if label_ids else ids)]
    else:
        names = sorted(stats.values)
    if problem_type == SINGLE_LABEL and len(names) < 2:
        raise DataError(f"column {label_column!r} has a single class {names}: classification needs at least two")
    return LabelSpace(problem_type, names, len(names))


def _check_known(stats: _LabelStats, space: LabelSpace, split: str, label_column: str, given: bool) -> None:
    if space.names is None:
        return
    known = set(space.names)
    for key, (p, r, v) in stats.values.items():
        if key not in known:
            where = ("--labels" if given else "the training split" if split == "train"
                     else f"the {split} split but not in train")
            what = f"is not among {where}" if given else f"appears only in {where}"
            raise DataError(f"{p}: row {r}, column {label_column!r}: label {v!r} {what} (known labels: "
                            f"{space.names}). A model cannot learn a class it never sees: add training examples of "
                            "it or drop these rows.")


@dataclasses.dataclass
class _Sample:
    """The ``size`` rows with the smallest sample hash (a uniform sample, bounded memory)."""

    size: int
    heap: list = dataclasses.field(default_factory=list)  # (-key, file, row, text, pair, label)

    def add(self, seed: int, fi: int, path: str, rows: np.ndarray, chunk, src: StreamSource) -> None:
        keys = row_hash(seed, fi, rows, salt=1)
        if len(self.heap) >= self.size:
            cand = np.flatnonzero(keys < -self.heap[0][0])
        else:
            cand = np.argsort(keys)[:self.size]
        if not len(cand):
            return
        sub = chunk.take(cand)
        texts = column_values(sub, src.text_column)
        pairs = column_values(sub, src.pair_column) if src.pair_column else [None] * len(cand)
        labels = column_values(sub, src.label_column)
        for j, c in enumerate(cand):
            item = (-float(keys[c]), fi, int(rows[c]), path, texts[j], pairs[j], labels[j])
            if len(self.heap) < self.size:
                heapq.heappush(self.heap, item)
            elif item[0] > self.heap[0][0]:
                heapq.heapreplace(self.heap, item)

    def table(self, src: StreamSource) -> TextTable:
        items = sorted(self.heap, key=lambda x: (x[1], x[2]))  # file order
        return TextTable([x[4] for x in items], [x[6] for x in items], ", ".join(dict.fromkeys(x[3] for x in items)),
                         [f"row {x[2]}" for x in items], [x[5] for x in items] if src.pair_column else None,
                         src.label_column, src.text_column)


@dataclasses.dataclass
class StreamData:
    """What :func:`open_stream` found: the splits' sources and sizes, the label space, and the
    in-memory evaluation sample (``eval_limit``)."""

    sources: dict[str, StreamSource]
    counts: dict[str, int]
    space: LabelSpace
    samples: dict[str, TextTable]

    def splits(self, tokenizer, max_length: int) -> dict[str, Any]:
        """Training and evaluation splits: :class:`StreamSplit` (read as used) or, for a split with
        an evaluation sample, its tokenized sample."""
        out: dict[str, Any] = {}
        for name, src in self.sources.items():
            if name in self.samples:
                t = self.samples[name]
                out[name] = tokenize(t, encode_labels(t, self.space, name), tokenizer, max_length, name)
            else:
                # a copy each: a tokenizer's settings change per call, and splits tokenize in their own threads
                out[name] = StreamSplit(name, src, self.counts[name], self.space, copy.deepcopy(tokenizer), max_length)
        return out


def _sources(cfg) -> list[list[StreamSource]]:
    """The splits' sources, grouped by the files one pass reads (a hash split reads its files once)."""
    topt = dict(text_column=cfg.text_column, label_column=cfg.label_column, pair_column=cfg.text_pair_column)
    if cfg.train_file:
        return [[StreamSource(name, tuple(table_files(f)), **topt)]
                for name, f in zip(SPLITS, (cfg.train_file, cfg.validation_file, cfg.test_file)) if f]
    if not cfg.data:
        raise DataError("no data: give --data (bbc_news, a class folder or a file) or --train-file")
    files = tuple(table_files(cfg.data))
    return [[StreamSource(name, files, **topt, fractions=tuple(cfg.split), part=k, seed=cfg.seed)
             for k, name in enumerate(SPLITS) if cfg.split[k] > 0]]


def open_stream(cfg) -> StreamData:
    """One pass over the files of ``cfg`` (a :class:`~flaxheads.training.data.DataConfig`): row counts
    per split, the label space (from the training rows of a ``--train-file``, from every row of a
    split ``--data``; or ``cfg.labels``), bad rows and labels (:class:`DataError` with file, row and
    column), and the evaluation sample of ``cfg.eval_limit`` validation rows."""
    if cfg.limit:
        raise UsageError("--limit samples a table held in memory; streamed data is read as it trains: use "
                         "--max-steps for a short run, or --no-stream for a small table")
    groups = _sources(cfg)
    counts: dict[str, int] = {}
    stats: dict[str, _LabelStats] = {}
    samples: dict[str, _Sample] = {}
    for group in groups:
        first = group[0]
        for s in group:
            counts[s.name], stats[s.name] = 0, _LabelStats()
            if s.name == "validation" and getattr(cfg, "eval_limit", None):
                samples[s.name] = _Sample(cfg.eval_limit)
        for fi, rows, chunk in file_rows(first.files, first.columns):
            path = first.files[fi]
            parts = (split_parts(row_hash(first.seed, fi, rows), first.fractions) if first.fractions is not None
                     else np.zeros(len(rows), np.int64))
            for s in group:
                keep = np.flatnonzero(parts == s.part) if first.fractions is not None else None
                r, c = (rows, chunk) if keep is None else (rows[keep], chunk.take(keep))
                if not len(r):
                    continue
                counts[s.name] += len(r)
                for col in (s.text_column, s.pair_column):
                    if col is not None:
                        _check_texts(path, r, c, col)
                stats[s.name].add(path, r, c.column(s.label_column), s.label_column)
                if s.name in samples:
                    samples[s.name].add(s.seed, fi, path, r, c, s)
    sources = {s.name: s for g in groups for s in g}
    if not cfg.train_file:
        empty = [n for n in sources if not counts[n]]
        if empty:
            raise DataError(f"{cfg.data}: the split {','.join(f'{f:g}' for f in cfg.split)} of "
                            f"{sum(counts.values())} examples leaves the {' and '.join(empty)} split empty. Use "
                            "more examples, larger fractions, or a fraction of 0 for a split you do not want.")
    if "train" not in sources:
        raise DataError(f"{cfg.data}: the split {cfg.split} leaves no training examples")
    given = getattr(cfg, "labels", None)
    found = stats["train"]
    if not cfg.train_file:  # a split file: the label space of all its rows, as the in-memory path
        found = _LabelStats()
        for n in sources:
            found.kinds = {**stats[n].kinds, **found.kinds}
            found.values = {**stats[n].values, **found.values}
            found.non_integer |= stats[n].non_integer
            found.width = found.width or stats[n].width
    space = label_space(found, cfg.label_column, cfg.problem_type, label_ids=cfg.label_ids, names=given)
    for name in sources:
        _check_known(stats[name], space, name, cfg.label_column, given is not None)
    return StreamData(sources, counts, space, {n: s.table(sources[n]) for n, s in samples.items()})


def split_table(cfg, name: str) -> TextTable | None:
    """One split of streamed data (``cfg``: the run's :class:`~flaxheads.training.data.DataConfig`),
    the same rows as the run's, read into memory: a run's own test split evaluated again. None when
    the run has no such split."""
    src = next((s for g in _sources(cfg) for s in g if s.name == name), None)
    if src is None:
        return None
    texts, labels, rows, pairs, files = [], [], [], [], {}
    for fi, r, chunk in source_rows(src):
        files[src.files[fi]] = None
        texts += column_values(chunk, src.text_column)
        labels += column_values(chunk, src.label_column)
        pairs += column_values(chunk, src.pair_column) if src.pair_column else []
        rows += [f"row {x}" for x in r]
    if not texts:
        return None
    return TextTable(texts, labels, ", ".join(files), rows, pairs if src.pair_column else None, src.label_column,
                     src.text_column)


# ---- batches -----------------------------------------------------------------------------------

def window_plan(char_lengths: np.ndarray, batch_size: int, key: Sequence[int], *, shuffle: bool = True,
                group_by_length: bool = True) -> list[np.ndarray]:
    """A window's batches as index arrays, a pure function of ``key`` (seed, epoch, window):
    shuffled, sorted by length (longest first) when grouping, cut, batch order shuffled."""
    n = len(char_lengths)
    order = np.random.default_rng(list(key)).permutation(n) if shuffle else np.arange(n)
    if group_by_length and shuffle:
        order = order[np.argsort(-char_lengths[order], kind="stable")]
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    if group_by_length and shuffle and len(batches) > 1:
        perm = np.random.default_rng([*key, 1]).permutation(len(batches))
        batches = [batches[i] for i in perm]
    return batches


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
        return TextTable(texts, labels, ", ".join(files) or src.files[0], [f"row {r}" for r in rws], pairs,
                         src.label_column, src.text_column)

    def tokenized(self, where, chunk, idx: np.ndarray) -> Split:
        table = self.rows_table(where, chunk, idx)
        with self.lock:
            labels = encode_labels(table, self.space, self.name)
            return tokenize(table, labels, self.tokenizer, self.max_length, self.name)


def _background(produce, limit: int) -> Iterator:
    """Items of the generator ``produce(stop)`` made in a thread, at most ``limit`` ahead (``stop``:
    a ``threading.Event`` set when the consumer is gone); an exception there is raised here. Closing this generator stops the thread (it is blocked on a
    full queue, not polling: a thread waking during a compile would interleave its allocations
    with the compiler's in the one heap arena)."""
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
    return (np.random.default_rng([seed, epoch, 2]).permutation(n_files).tolist() if shuffle and n_files > 1
            else list(range(n_files)))


def agreed_length(local_max: int) -> int:
    """The longest text of a global batch, from each process's longest (one all-gather)."""
    import jax

    if jax.process_count() == 1:
        return local_max
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray([local_max], np.int32))))


def _global_rows(local: dict, batch_size: int, process: int, processes: int) -> dict:
    """A global batch of ``batch_size`` rows holding this process's rows in its slice (the rows
    :meth:`Parallel.put_rows` places from it); the other rows are weight-0 padding."""
    if processes == 1:
        return local
    k = batch_size // processes
    out = {}
    for key, v in local.items():
        full = np.zeros((batch_size, *v.shape[1:]), v.dtype)
        if key == "attention_mask":
            full[:, 0] = 1
        full[process * k:(process + 1) * k] = v
        out[key] = full
    return out


def stream_batches(split: StreamSplit, batch_size: int, buckets: Sequence[int], *, seed: int = 0, epoch: int = 0,
                   shuffle: bool = True, start: int = 0, pad_id: int = 0,
                   group_by_length: bool = True) -> Iterator[dict]:
    """The training batches of one epoch of a streamed split from batch ``start`` on, as
    :func:`~flaxheads.training.data.iterate_batches` gives them (global batches, padded to a
    bucket, weight-0 padding rows), a pure function of ``(seed, epoch, start)``. In a multi-process
    run each process reads and tokenizes only the rows of each batch it places on its devices."""
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
            plan = window_plan(chars, batch_size, (seed, epoch, w), shuffle=shuffle, group_by_length=group_by_length)
            plan = plan[skip:] if w == first_window else plan
            mine = [idx[me * local:(me + 1) * local] for idx in plan]
            flat = np.concatenate(mine) if mine else np.zeros(0, np.int64)
            toks = split.tokenized(where, chunk, flat) if len(flat) else None
            at = 0
            for idx in mine:
                rows = np.arange(at, at + len(idx))
                at += len(idx)
                yield toks, rows

    for toks, rows in _background(produce, PREFETCH_BATCHES):
        longest = max([len(toks.input_ids[i]) for i in rows] + [1]) if toks is not None else 1
        t = bucket_length(agreed_length(longest), buckets)
        if toks is None:
            toks = Split(split.name, [], np.zeros((0,), np.int32))
        batch = collate(toks, rows, local, (t,), pad_id)
        yield _global_rows(batch, batch_size, me, procs)


def ordered_batches(split, batch_size: int, buckets: Sequence[int], *, pad_id: int = 0) -> Iterator[dict]:
    """Every example of ``split`` once, in order, in padded batches (evaluation and prediction):
    an in-memory :class:`~flaxheads.training.data.Split`, or a :class:`StreamSplit` read and
    tokenized in the background (every process reads all of it: evaluation batches are global)."""
    from .data import iterate_batches

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
