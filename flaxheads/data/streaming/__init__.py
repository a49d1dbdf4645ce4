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

from flaxheads.data.streaming.batches import StreamSplit, agreed_length, ordered_batches, stream_batches
from flaxheads.data.streaming.files import (
    CHUNK_ROWS,
    PREFETCH_BATCHES,
    STREAM_BYTES,
    WINDOW_BATCHES,
    read_chunks,
    streams,
    table_files,
)
from flaxheads.data.streaming.scan import StreamData, label_space, open_stream, split_table
from flaxheads.data.streaming.splits import (
    StreamSource,
    char_lengths,
    column_values,
    file_rows,
    row_hash,
    source_rows,
    split_parts,
)

__all__ = [
    "CHUNK_ROWS",
    "PREFETCH_BATCHES",
    "STREAM_BYTES",
    "WINDOW_BATCHES",
    "StreamData",
    "StreamSource",
    "StreamSplit",
    "agreed_length",
    "char_lengths",
    "column_values",
    "file_rows",
    "label_space",
    "open_stream",
    "ordered_batches",
    "read_chunks",
    "row_hash",
    "source_rows",
    "split_parts",
    "split_table",
    "stream_batches",
    "streams",
    "table_files",
]
