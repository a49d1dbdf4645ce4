"""Files in and out of ``flaxheads predict`` / ``embed``: a table (CSV / TSV / JSON Lines /
Parquet, read by :func:`flaxheads.data.tables.read_table`) or plain text, one text per line,
from a file or stdin; predictions out as CSV or JSON Lines with the input's columns kept;
embeddings as ``.npy`` or Parquet."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from flaxheads.data.tables import TABLE_FORMATS, DataError, TextTable, check_utf8, load_source, load_table, read_table
from flaxheads.disk.files import umask_mode
from flaxheads.errors import UsageError
from flaxheads.losses import MULTI_LABEL, SINGLE_LABEL
from flaxheads.runtime import phases

#: ``--input-format`` values and the extension each reads as.
INPUT_FORMATS = {"csv": ".csv", "tsv": ".tsv", "jsonl": ".jsonl", "json": ".json", "parquet": ".parquet", "txt": ".txt"}
OUTPUT_FORMATS = ("csv", "jsonl")
STDIO = "-"


@dataclasses.dataclass
class InputTable:
    """The input's rows (every column), the texts and pairs to predict, and each row's name for errors."""

    columns: list[str]
    rows: list[dict]
    texts: list[Any]
    pairs: list[Any] | None
    names: list[str]  # "file.csv: row 3, column 'text'"
    source: str


def _ext(path: str, fmt: str | None) -> str:
    if fmt:
        return INPUT_FORMATS[fmt]
    if path == STDIO:
        return ".txt"
    ext = Path(path).suffix.lower()
    if ext not in TABLE_FORMATS and ext != ".txt":
        raise UsageError(
            f"--input {path!r}: unknown file type {ext!r}; use a .csv, .tsv, .jsonl, .json, .parquet or "
            ".txt file (one text per line), or say which with --input-format"
        )
    return ext


def _text_lines(path: str) -> tuple[list[str], str]:
    """The lines of a UTF-8 text file (or stdin), without line ends."""
    if path == STDIO:
        data = sys.stdin.buffer.read()
        try:
            return data.decode("utf-8").splitlines(), "<stdin>"
        except UnicodeDecodeError as e:
            raise DataError(f"<stdin> is not UTF-8 (byte offset {e.start}); convert it, e.g. with iconv") from None
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    check_utf8(path)
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines(), path


def read_input(
    path: str, *, fmt: str | None = None, text_column: str = "text", text_pair_column: str | None = None
) -> InputTable:
    """The rows to predict on; plain text gives one column ``text`` (a line per text)."""
    ext = _ext(path, fmt)
    if ext == ".txt":
        if text_pair_column:
            raise UsageError(
                "--text-pair-column needs a table input (CSV, TSV, JSON Lines, Parquet); plain text "
                "has one text per line"
            )
        lines, source = _text_lines(path)
        if not lines:
            raise DataError(f"{source}: no lines (empty input)")
        return InputTable(
            ["text"],
            [{"text": x} for x in lines],
            lines,
            None,
            [f"{source}: line {i + 1}" for i in range(len(lines))],
            source,
        )
    if path == STDIO:  # a table on stdin: read through a file of its type
        with tempfile.TemporaryDirectory() as tmp:
            p = os.path.join(tmp, "stdin" + ext)
            with open(p, "wb") as f:
                f.write(sys.stdin.buffer.read())
            table = read_input(p, fmt=fmt, text_column=text_column, text_pair_column=text_pair_column)
        return dataclasses.replace(table, names=[n.replace(p, "<stdin>") for n in table.names], source="<stdin>")
    ds = read_table(path, ext=ext)
    cols = list(ds.column_names)
    for col, flag in ((text_column, "--text-column"), (text_pair_column, "--text-pair-column")):
        if col is not None and col not in cols:
            raise DataError(f"{path}: no column {col!r} (columns: {cols}); choose one with {flag}")
    rows = ds.to_list()
    names = [f"{path}: row {i + 1}, column {text_column!r}" for i in range(len(rows))]
    return InputTable(
        cols,
        rows,
        [r[text_column] for r in rows],
        None if text_pair_column is None else [r[text_pair_column] for r in rows],
        names,
        path,
    )


def read_labelled_input(
    path: str,
    *,
    fmt: str | None = None,
    text_column: str = "text",
    label_column: str = "label",
    text_pair_column: str | None = None,
) -> TextTable:
    """A labelled table (``evaluate --input``): a file (its extension, or ``fmt``, says the format), a
    class folder or a packaged corpus, or stdin (``-``, in the table format ``fmt`` names)."""
    opts = dict(text_column=text_column, label_column=label_column, text_pair_column=text_pair_column)
    if path != STDIO and not fmt:
        return load_source(path, **opts)
    if not fmt:
        raise UsageError(
            "--input - (stdin) needs --input-format (csv, tsv, jsonl, json or parquet): evaluation "
            "reads a table with a label column"
        )
    if fmt == "txt":
        raise UsageError("evaluate reads a table with a label column; plain text (--input-format txt) has none")
    source = "<stdin>" if path == STDIO else path
    with tempfile.TemporaryDirectory() as tmp:  # read through a file of the named type
        p = os.path.join(tmp, "input" + INPUT_FORMATS[fmt])
        if path == STDIO:
            with open(p, "wb") as f:
                f.write(sys.stdin.buffer.read())
        elif os.path.isfile(path):
            os.symlink(os.path.abspath(path), p)
        else:
            raise DataError(f"{path}: file not found")
        try:
            table = load_table(p, text_column=text_column, label_column=label_column, text_pair_column=text_pair_column)
        except DataError as e:
            raise DataError(str(e).replace(p, source)) from None
    return dataclasses.replace(table, source=source)


def output_format(path: str, fmt: str | None) -> str:
    if fmt:
        return fmt
    if path == STDIO:
        return "jsonl"
    ext = Path(path).suffix.lower()
    if ext in (".csv", ".jsonl", ".json"):
        return "csv" if ext == ".csv" else "jsonl"
    raise UsageError(f"--output {path!r}: unknown file type {ext!r}; use .csv or .jsonl (or --output-format)")


def check_new_columns(table: InputTable, new: list[str]) -> None:
    clash = [c for c in new if c in table.columns]
    if clash:
        raise DataError(
            f"{table.source}: the input already has column(s) {clash}, which the output adds; rename "
            "them in the input (the output keeps every input column)"
        )


def _csv_value(v):
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return "" if v is None else v


def write_rows(path: str, fmt: str, rows: list[dict], columns: list[str]) -> None:
    """Rows as CSV (lists and dicts JSON-encoded) or JSON Lines, to a file or stdout; a file is
    written beside its final name and renamed, so a failed run leaves no half file."""
    buf = io.StringIO()
    if fmt == "csv":
        w = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n", extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r.get(k)) for k in columns})
    else:
        for r in rows:
            buf.write(json.dumps({k: r.get(k) for k in columns}, ensure_ascii=False, default=_json_default) + "\n")
    if path == STDIO:
        sys.stdout.write(buf.getvalue())
        sys.stdout.flush()
        return
    _atomic_write(path, buf.getvalue().encode("utf-8"))


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return str(v)


def _atomic_write(path: str, data: bytes) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)
    try:
        with phases.temporary(tmp):  # a signal removes it, or waits for the rename
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, umask_mode())  # mkstemp's 0600 would keep the output from other users
            with phases.committing():
                os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_embeddings(path: str, table: InputTable, emb: np.ndarray) -> None:
    """``.npy`` (the [N, D] float32 array) or ``.parquet`` (the input's columns + ``embedding``)."""
    ext = Path(path).suffix.lower()
    if ext == ".npy":
        buf = io.BytesIO()
        np.save(buf, np.asarray(emb, np.float32))
        _atomic_write(path, buf.getvalue())
        return
    if ext != ".parquet":
        raise UsageError(f"--output {path!r}: embeddings are written as .npy or .parquet")
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_new_columns(table, ["embedding"])
    cols = {c: [r.get(c) for r in table.rows] for c in table.columns}
    cols["embedding"] = [row for row in np.asarray(emb, np.float32)]
    pt = pa.table(
        {
            **{c: v for c, v in cols.items() if c != "embedding"},
            "embedding": pa.array(cols["embedding"], type=pa.list_(pa.float32())),
        }
    )
    buf = io.BytesIO()
    pq.write_table(pt, buf)
    _atomic_write(path, buf.getvalue())


def prediction_columns(pred) -> tuple[list[str], list[dict]]:
    """The output columns of a :class:`~flaxheads.predict.Predictions` and one row of them per text."""
    if pred.problem_type == SINGLE_LABEL:
        cols = ["prediction", "score"] + (["top_labels", "top_scores"] if pred.top_k else [])
        return cols, [{"prediction": r["label"], "score": r["score"], **{k: r[k] for k in cols[2:]}} for r in pred]
    if pred.problem_type == MULTI_LABEL:
        names = pred.label_names
        cols = ["prediction"] + [f"score_{n}" for n in names]
        return cols, [{"prediction": r["labels"], **{f"score_{n}": r["scores"][n] for n in names}} for r in pred]
    return ["prediction"], [{"prediction": r["value"]} for r in pred]
