"""The one scan before training: row counts per split, the label space, bad rows, the evaluation
sample; and the splits it opens."""

from __future__ import annotations

import copy
import dataclasses
import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from flaxheads.data.objects import DataObject, missing_message
from flaxheads.data.splits import SPLITS, tokenize
from flaxheads.data.streaming.batches import StreamSplit
from flaxheads.data.streaming.files import table_files
from flaxheads.data.streaming.splits import (
    StreamSource,
    _is_json,
    arr_table,
    column_values,
    file_rows,
    row_hash,
    source_rows,
    split_parts,
)
from flaxheads.data.tables import DataError, LabelSpace, TextTable, _label_kind, encode_labels
from flaxheads.errors import UsageError
from flaxheads.losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL


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
            raise DataError(
                f"{path}: row {rows[i]}, column {label_column!r}: label is missing. Every row needs a label."
            )
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
            for x in v if isinstance(v, list) else [v]:
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


def label_space(
    stats: _LabelStats,
    label_column: str,
    problem_type: str | None = None,
    *,
    label_ids: bool = False,
    names: Sequence[str] | None = None,
) -> LabelSpace:
    """The label space a streaming pass found, by :func:`flaxheads.data.tables.infer_label_space`'s
    rules (``names``: given by ``--labels`` instead)."""
    if len(stats.kinds) > 1:
        files = {p for p, _, _ in stats.kinds.values()}
        one = files.pop() if len(files) == 1 else None
        seen = ", ".join(
            f"{'' if one else p + ': '}row {r} has {kind} ({v!r})" for kind, (p, r, v) in stats.kinds.items()
        )
        raise DataError(
            f"{one + ': ' if one else ''}column {label_column!r} mixes label kinds: {seen}. Use one kind "
            "in every row: a list of "
            "label names (multi-label), one class name or integer id (single-label), or a number "
            "(regression)."
        )
    kind = next(iter(stats.kinds), "text")
    if problem_type is None:
        problem_type = (
            MULTI_LABEL
            if kind == "a list"
            else REGRESSION
            if kind == "a number" and stats.non_integer
            else SINGLE_LABEL
        )
    if problem_type == REGRESSION:
        return LabelSpace(REGRESSION, None, stats.width or 1)
    if problem_type == MULTI_LABEL and kind != "a list":
        p, r, v = next(iter(stats.kinds.values()))
        raise DataError(
            f"{p}: row {r}, column {label_column!r}: multi-label needs a list of label names per row, got {v!r}"
        )
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
            where = (
                "--labels"
                if given
                else "the training split"
                if split == "train"
                else f"the {split} split but not in train"
            )
            what = f"is not among {where}" if given else f"appears only in {where}"
            raise DataError(
                f"{p}: row {r}, column {label_column!r}: label {v!r} {what} (known labels: "
                f"{space.names}). A model cannot learn a class it never sees: add training examples of "
                "it or drop these rows."
            )


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
            cand = np.argsort(keys)[: self.size]
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
        return TextTable(
            [x[4] for x in items],
            [x[6] for x in items],
            ", ".join(dict.fromkeys(x[3] for x in items)),
            [f"row {x[2]}" for x in items],
            [x[5] for x in items] if src.pair_column else None,
            src.label_column,
            src.text_column,
        )


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


def _files(source) -> tuple[tuple[str, ...], Any]:
    """A streamed source's files, or an in-memory table (an ``IterableDataset``) under its one name."""
    if isinstance(source, DataObject):
        if source.obj is None:
            raise UsageError(missing_message({source.given_as: source}))
        return (str(source),), source.obj
    return tuple(table_files(source)), None


def _sources(cfg) -> list[list[StreamSource]]:
    """The splits' sources, grouped by the files one pass reads (a hash split reads its files once)."""
    topt = dict(text_column=cfg.text_column, label_column=cfg.label_column, pair_column=cfg.text_pair_column)
    if cfg.train_file:
        named = [(n, _files(f)) for n, f in zip(SPLITS, (cfg.train_file, cfg.validation_file, cfg.test_file)) if f]
        return [[StreamSource(name, files, **topt, dataset=dataset)] for name, (files, dataset) in named]
    if not cfg.data:
        raise DataError("no data: give --data (bbc_news, a class folder or a file) or --train-file")
    files, dataset = _files(cfg.data)
    return [
        [
            StreamSource(name, files, **topt, fractions=tuple(cfg.split), part=k, seed=cfg.seed, dataset=dataset)
            for k, name in enumerate(SPLITS)
            if cfg.split[k] > 0
        ]
    ]


def open_stream(cfg) -> StreamData:
    """One pass over the files of ``cfg`` (a :class:`~flaxheads.data.splits.DataConfig`): row counts
    per split, the label space (from the training rows of a ``--train-file``, from every row of a
    split ``--data``; or ``cfg.labels``), bad rows and labels (:class:`DataError` with file, row and
    column), and the evaluation sample of ``cfg.eval_limit`` validation rows."""
    if cfg.limit:
        raise UsageError(
            "--limit samples a table held in memory; streamed data is read as it trains: use "
            "--max-steps for a short run, or --no-stream for a small table"
        )
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
        for fi, rows, chunk in file_rows(first.files, first.columns, dataset=first.dataset):
            path = first.files[fi]
            parts = (
                split_parts(row_hash(first.seed, fi, rows), first.fractions)
                if first.fractions is not None
                else np.zeros(len(rows), np.int64)
            )
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
            raise DataError(
                f"{cfg.data}: the split {','.join(f'{f:g}' for f in cfg.split)} of "
                f"{sum(counts.values())} examples leaves the {' and '.join(empty)} split empty. Use "
                "more examples, larger fractions, or a fraction of 0 for a split you do not want."
            )
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
    """One split of streamed data (``cfg``: the run's :class:`~flaxheads.data.splits.DataConfig`),
    the same rows as the run's, read into memory: a run's own test split evaluated again. None when
    the run has no such split."""
    src = next((s for g in _sources(cfg) for s in g if s.name == name), None)
    if src is None:
        return None
    texts, labels, rows, pairs = [], [], [], []
    files: dict[str, None] = {}  # the files read, in order
    for fi, r, chunk in source_rows(src):
        files[src.files[fi]] = None
        texts += column_values(chunk, src.text_column)
        labels += column_values(chunk, src.label_column)
        pairs += column_values(chunk, src.pair_column) if src.pair_column else []
        rows += [f"row {x}" for x in r]
    if not texts:
        return None
    return TextTable(
        texts, labels, ", ".join(files), rows, pairs if src.pair_column else None, src.label_column, src.text_column
    )
