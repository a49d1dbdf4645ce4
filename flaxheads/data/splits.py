"""Data for training: seeded stratified splits of the raw examples of :mod:`flaxheads.data.tables`;
tokenisation with the backbone's tokenizer; bucketed, weighted batches (padded by
:mod:`flaxheads.data.batching`, as prediction pads them).

Batch order is a pure function of ``(seed, epoch)``: a run resumed at step k sees exactly the
batches an uninterrupted run would. Every batch has ``batch_size`` rows; rows past the end of
the data are padding with weight 0 (so every example is trained on and evaluated exactly once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flaxheads.data.batching import bucket_length, pad_rows, token_batch
from flaxheads.data.objects import DataObject, record
from flaxheads.data.tables import DataError, LabelSpace, TextTable, encode_labels, infer_label_space, load_source
from flaxheads.losses import SINGLE_LABEL

SPLITS = ("train", "validation", "test")
#: The fields of :class:`TableSources` that name a source (a path or an in-memory table).
SOURCE_FIELDS = ("data", "train_file", "validation_file", "test_file")


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
    """Tokenise ``table`` (texts, and text pairs when it has them), truncating to ``max_length``.

    ``tokenizer``: a :class:`flaxheads.interop.tokenizers.Tokenizer` (``load_tokenizer(folder)``),
    or any tokenizer called as transformers' are (``tokenizer(texts, pairs, truncation=True,
    max_length=..., padding=False)``). Token types are kept for pairs, when the model takes them."""
    out = tokenizer(
        list(table.texts),
        None if table.pairs is None else list(table.pairs),
        truncation=True,
        max_length=max_length,
        padding=False,
    )
    ids = [np.asarray(x, np.int32) for x in out["input_ids"]]
    tt = (
        [np.asarray(x, np.int32) for x in out["token_type_ids"]]
        if table.pairs is not None and "token_type_ids" in out
        else None
    )
    return Split(name, ids, labels, tt)


def tokenize_shared(
    table: TextTable,
    labels: np.ndarray,
    tokenizer,
    max_length: int,
    name: str = "train",
    *,
    processes: int | None = None,
    process: int | None = None,
    gather=None,
) -> Split:
    """:func:`tokenize`, the work shared among the processes of a multi-host run: process ``p`` of
    ``P`` tokenizes rows ``p, p + P, ...`` (every P-th row, so long and short texts spread evenly),
    and one all-gather gives every process the same whole :class:`Split`, hence the same batch
    plan. One process: plain :func:`tokenize`.

    ``gather(list of int32 arrays) -> one such list per process`` defaults to
    :func:`all_gather_ragged` (a collective: every process calls it, in the same order)."""
    import jax

    procs = jax.process_count() if processes is None else processes
    if procs == 1:
        return tokenize(table, labels, tokenizer, max_length, name)
    me = jax.process_index() if process is None else process
    rows = np.arange(me, len(table), procs)
    part = tokenize(table.take(rows.tolist()), labels[rows], tokenizer, max_length, name)
    gather = all_gather_ragged if gather is None else gather

    def interleave(per_process: list[list[np.ndarray]]) -> list[np.ndarray]:
        out: list = [None] * len(table)
        for p, arrays in enumerate(per_process):
            out[p::procs] = arrays
        return out

    ids = interleave(gather(part.input_ids))
    types = None if part.token_type_ids is None else interleave(gather(part.token_type_ids))
    return Split(name, ids, labels, types)


def all_gather_ragged(arrays: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Every process's list of 1-D int32 arrays (lengths may differ within and between processes),
    in process order: three all-gathers (counts, lengths, the padded concatenation)."""
    from jax.experimental import multihost_utils

    def gather(x: np.ndarray) -> np.ndarray:
        return np.asarray(multihost_utils.process_allgather(x))

    counts = gather(np.asarray([len(arrays)], np.int64))[:, 0]
    lengths = np.zeros(int(counts.max()), np.int64)
    lengths[: len(arrays)] = [len(a) for a in arrays]
    all_lengths = gather(lengths)
    flat = np.zeros(int(all_lengths.sum(axis=1).max()), np.int32)
    mine = np.concatenate(arrays) if arrays else flat[:0]
    flat[: len(mine)] = mine
    all_flat = gather(flat)
    out = []
    for p, count in enumerate(counts):
        cuts = np.cumsum(all_lengths[p, :count])[:-1]
        out.append(list(np.split(all_flat[p, : all_lengths[p, :count].sum()], cuts)) if count else [])
    return out


def batch_plan(
    lengths: np.ndarray,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    key: Sequence[int] | None = None,
    shuffle: bool = True,
    group_by_length: bool = False,
    group_batches: int | None = 32,
) -> list[np.ndarray]:
    """The batches of ``lengths``' rows as index arrays, a pure function of ``key`` (default
    ``(seed, epoch)``): the one planner of in-memory epochs and of streamed windows.

    ``group_by_length``: within windows of ``group_batches`` batches (None: all rows are one
    window, as a streamed window is), sort longest first before cutting batches (less padding),
    then shuffle the batch order."""
    key = [seed, epoch] if key is None else list(key)
    n = len(lengths)
    order = np.random.default_rng(key).permutation(n) if shuffle else np.arange(n)
    if group_by_length and shuffle and n:
        w = batch_size * group_batches if group_batches else n
        order = np.concatenate([c[np.argsort(-lengths[c], kind="stable")] for c in np.split(order, range(w, n, w))])
    batches = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    if group_by_length and shuffle and len(batches) > 1:
        perm = np.random.default_rng([*key, 1]).permutation(len(batches))
        batches = [batches[i] for i in perm]
    return batches


def labelled_rows(labels: np.ndarray, batch_size: int) -> dict:
    """``labels`` of k examples padded to ``batch_size`` rows, and ``weights`` (1 real, 0 padding)."""
    return {"labels": pad_rows(labels, batch_size), "weights": pad_rows(np.ones(len(labels), np.float32), batch_size)}


def collate(split: Split, idx: np.ndarray, batch_size: int, buckets: Sequence[int], pad_id: int = 0) -> dict:
    """Rows ``idx`` padded to the bucket of their longest text, plus weight-0 padding rows up to
    ``batch_size``. Padding rows attend to one pad token (never a fully masked row: NaN * 0 = NaN)."""
    idx = np.asarray(idx, np.int64)
    if len(idx) > batch_size:
        raise ValueError(f"{len(idx)} rows > batch_size {batch_size}")
    t = bucket_length(max([len(split.input_ids[i]) for i in idx] + [1]), buckets)
    return {
        **token_batch(split.input_ids, split.token_type_ids, idx, batch_size, t, pad_id),
        **labelled_rows(split.labels[idx], batch_size),
    }


def iterate_batches(
    split: Split,
    batch_size: int,
    buckets: Sequence[int],
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    start: int = 0,
    pad_id: int = 0,
    group_by_length: bool = False,
) -> Iterator[dict]:
    """Batches of one epoch from batch ``start`` on (for resuming mid-epoch)."""
    plan = batch_plan(
        split.lengths, batch_size, seed=seed, epoch=epoch, shuffle=shuffle, group_by_length=group_by_length
    )
    for idx in plan[start:]:
        yield collate(split, idx, batch_size, buckets, pad_id)


# ---- everything together ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TableSources:
    """Where a run's rows come from: one source split by fractions, or a file per split, and the
    columns to read (shared by the reader's :class:`DataConfig` and the run spec's data group). A
    source is a path or an in-memory table (:class:`~flaxheads.data.objects.DataObject`)."""

    # packaged name, class folder, table file, glob or in-memory table (split with `split`)
    data: str | DataObject | None = "bbc_news"
    train_file: str | DataObject | None = None  # explicit splits instead of `data` (`train=` etc.)
    validation_file: str | DataObject | None = None
    test_file: str | DataObject | None = None
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"


@dataclasses.dataclass(frozen=True)
class DataConfig(TableSources):
    """The readers' settings: the sources, the split and the labels."""

    problem_type: str | None = None
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    limit: int | None = None  # keep a stratified subset of this many examples (quick runs)
    label_ids: bool = False  # integer labels are class ids 0..K-1, not classes by value
    labels: tuple[str, ...] | None = None  # the class names (single/multi-label), instead of discovering them
    eval_limit: int | None = None  # evaluate during training on a sample of this many validation examples
    stream: bool | None = None  # read tables as training runs (None: large files and globs; training/streaming/)


def source_record(cfg: TableSources) -> dict:
    """``cfg`` as a run's ``config.json`` records it: each in-memory source as its description."""
    none: dict[str, Any] = dict.fromkeys(SOURCE_FIELDS)
    plain = dataclasses.replace(cfg, **none)  # asdict would deep-copy the tables
    return {**dataclasses.asdict(plain), **{k: record(getattr(cfg, k)) for k in SOURCE_FIELDS}}


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
        space = infer_label_space(tables["train"], cfg.problem_type, label_ids=cfg.label_ids)
        if cfg.limit:
            tables["train"] = _subset(tables["train"], space, cfg.limit, cfg.seed)
    else:
        if not cfg.data:
            raise DataError("no data: give --data (bbc_news, a class folder or a file) or --train-file")
        full = load_source(cfg.data, **topt)
        space = infer_label_space(full, cfg.problem_type, label_ids=cfg.label_ids)
        if cfg.limit:
            full = _subset(full, space, cfg.limit, cfg.seed)
        strata = encode_labels(full, space) if space.problem_type == SINGLE_LABEL else None
        parts = split_indices(len(full), cfg.split, cfg.seed, strata)
        empty = [name for name, p, f in zip(SPLITS, parts, cfg.split) if f > 0 and not len(p)]
        if empty:
            raise DataError(
                f"{cfg.data}: the split {','.join(f'{f:g}' for f in cfg.split)} of {len(full)} examples "
                f"leaves the {' and '.join(empty)} split empty. Use more examples, larger fractions, or "
                "a fraction of 0 for a split you do not want (e.g. --split 0.9,0.1,0)."
            )
        tables = {name: full.take(p.tolist()) for name, p in zip(SPLITS, parts) if len(p)}
        if "train" not in tables:
            raise DataError(f"{cfg.data}: the split {cfg.split} leaves no training examples")
    if cfg.eval_limit and "validation" in tables:
        tables["validation"] = _subset(tables["validation"], space, cfg.eval_limit, cfg.seed + 1)
    space = _given_names(space, cfg.labels)
    labels = {name: encode_labels(t, space, name) for name, t in tables.items()}
    return tables, space, labels


def _given_names(space: LabelSpace, names: Sequence[str] | None) -> LabelSpace:
    """``space`` with ``names`` (``--labels``) as its classes, in that order. Splits and samples are
    drawn with the inferred space, so naming the classes in another order changes no split."""
    if names is None or space.names is None:
        return space
    return LabelSpace(space.problem_type, [str(n) for n in names], len(names))


def _subset(t: TextTable, space: LabelSpace, limit: int, seed: int) -> TextTable:
    if limit >= len(t):
        return t
    strata = encode_labels(t, space) if space.problem_type == SINGLE_LABEL else np.zeros(len(t), np.int64)
    return t.take(stratified_sample(strata, limit, seed + 1).tolist())


def stratified_sample(strata: np.ndarray, size: int, seed: int) -> np.ndarray:
    """Exactly ``size`` sorted indices of ``strata`` (class ids), each class in proportion: its
    share of ``size`` rounded by largest remainder (ties to the smaller class id), its members
    drawn at random (``seed``). Rounding each class on its own, as a stratified split does, can
    miss ``size`` by a few."""
    classes, counts = np.unique(strata, return_counts=True)
    want = counts * size / len(strata)
    take = np.floor(want).astype(np.int64)
    order = np.lexsort((classes, -(want - take)))  # largest remainder first
    take[order[: size - int(take.sum())]] += 1
    rng = np.random.default_rng(seed)
    parts = [rng.permutation(np.flatnonzero(strata == c))[:k] for c, k in zip(classes, take)]
    return np.sort(np.concatenate(parts))
