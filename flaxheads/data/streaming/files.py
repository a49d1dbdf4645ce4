"""Which tables stream, their files (one or a glob of shards), and their rows read in Arrow chunks."""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flaxheads.data.objects import ITERABLE, DataObject
from flaxheads.data.tables import PACKAGED, TABLE_FORMATS, DataError, _quiet_datasets, check_csv_quoting, check_utf8

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


def streams(spec: str | DataObject | None, want: bool | None) -> bool:
    """Whether the table ``spec`` is streamed: ``want`` (``--stream`` / ``--no-stream``) when
    given; else for a glob, or a table file larger than :data:`STREAM_BYTES`. Packaged data and
    class folders are read into memory; of in-memory tables, an ``IterableDataset`` streams (unless
    ``want`` is False) and the others are in memory already."""
    if isinstance(spec, DataObject):
        return spec.kind == ITERABLE and want is not False
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
