"""Rows of streamed files, their split (a pure function of (seed, file, row number)) and the
columns of their Arrow chunks as Python values."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flaxheads.data.objects import iter_chunks
from flaxheads.data.streaming.files import CHUNK_ROWS, read_chunks
from flaxheads.data.tables import DataError

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
    #: an ``IterableDataset`` read instead of ``files`` (then its one name, for messages)
    dataset: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def columns(self) -> dict[str, str]:
        """The columns read, each with the flag that names it."""
        named = (
            (self.text_column, "--text-column"),
            (self.pair_column, "--text-pair-column"),
            (self.label_column, "--label-column"),
        )
        return {c: flag for c, flag in named if c is not None}


def file_rows(
    files: Sequence[str],
    columns: dict[str, str],
    order: Sequence[int] | None = None,
    dataset: Any = None,
) -> Iterator[tuple[int, np.ndarray, Any]]:
    """``(file index, 1-based row numbers, chunk of the columns)`` for every chunk of the files,
    in ``order`` (file indices; default as given). ``columns``: name -> the flag that chose it,
    named when the column is missing. ``dataset``: an ``IterableDataset`` read instead (``files``
    is then its one name)."""
    for fi in range(len(files)) if order is None else order:
        first = 1
        for chunk in read_chunks(files[fi]) if dataset is None else iter_chunks(dataset, CHUNK_ROWS):
            if first == 1:
                for col, flag in columns.items():
                    if col not in chunk.column_names:
                        raise DataError(
                            f"{files[fi]}: no column {col!r} (columns: {chunk.column_names}); choose one with {flag}"
                        )
            rows = np.arange(first, first + chunk.num_rows, dtype=np.int64)
            first += chunk.num_rows
            yield fi, rows, chunk.select(list(columns))


def source_rows(src: StreamSource, order: Sequence[int] | None = None) -> Iterator[tuple[int, np.ndarray, Any]]:
    """:func:`file_rows` of the source, only the rows of its split."""
    for fi, rows, chunk in file_rows(src.files, src.columns, order, src.dataset):
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
