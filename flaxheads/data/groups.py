"""Grouped data for rankers and reward models: tables -> groups -> tokenised splits -> batches.

A group is one query (or prompt) with its candidates and their relevance labels. Tables:

* preference: ``prompt`` (or ``query``), ``chosen``, ``rejected`` [, ``margin``]: one group of two
  candidates per row, labels ``[1, 0]``; ``margin`` (TRL's column): how far the chosen score
  must exceed the rejected one, for the pairwise objectives;
* ranking, one row per candidate: ``query``, ``passage``, ``label``: rows with the same query
  text form a group, in order of first appearance;
* ranking, one row per query: ``query``, ``passages`` (a list), ``labels`` (a list).

The packaged ``bbc_news`` becomes a relevance set (:func:`bbc_news_groups`). A group without a
relevant candidate, a missing column, an empty text or a bad label is a :class:`DataError` that
names the file and row.

Batches hold whole groups: ``batch_size`` groups of ``group_size`` rows each (the largest group of
the run; shorter groups padded with weight-0 rows), so a batch split over devices by rows keeps
each group on one device when ``batch_size`` is a multiple of the device count. A real row's
weight is its group's weight shared among the group's real rows (see
:func:`flaxheads.tasks.ranking.objectives.objective_loss`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np

from flaxheads.data.batching import bucket_length, token_batch
from flaxheads.data.objects import Columns, DataObject
from flaxheads.data.splits import SPLITS, batch_plan, split_indices
from flaxheads.data.tables import DataError, _read_text, bbc_news_path, read_table


@dataclasses.dataclass
class GroupTable:
    """Raw groups: per group a query, its candidates, their labels, and where it came from."""

    queries: list[str]
    candidates: list[list[str]]
    labels: list[list[float]]
    source: str
    rows: list[str]  # per group, for messages ("row 7", "rows 3-5")
    kind: str = "ranking"  # "preference": two candidates, chosen first
    margins: list[float] | None = None  # per group (preference tables with a margin column)

    def __len__(self) -> int:
        return len(self.queries)

    def take(self, idx: Sequence[int] | np.ndarray) -> GroupTable:
        at = [int(i) for i in idx]
        return dataclasses.replace(
            self,
            queries=[self.queries[i] for i in at],
            candidates=[self.candidates[i] for i in at],
            labels=[self.labels[i] for i in at],
            rows=[self.rows[i] for i in at],
            margins=None if self.margins is None else [self.margins[i] for i in at],
        )

    @property
    def max_group(self) -> int:
        return max((len(c) for c in self.candidates), default=1)


# ---- loading and checks --------------------------------------------------------------------------


def _text(value, source: str, row: str, column: str) -> str:
    if not isinstance(value, str) or not value.strip():
        what = (
            "missing" if value is None else "empty" if isinstance(value, str) else f"not text ({type(value).__name__})"
        )
        raise DataError(f"{source}: {row}, column {column!r}: text is {what}. Remove the row or fill in its text.")
    return value


def _finite(value, source: str, row: str, column: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(float(value)):
        raise DataError(f"{source}: {row}, column {column!r}: {value!r} is not a finite number")
    return float(value)


def _number(value, source: str, row: str, column: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(float(value)):
        raise DataError(
            f"{source}: {row}, column {column!r}: relevance {value!r} is not a finite number "
            "(use 1 / 0 for relevant / not, or a graded relevance >= 0)"
        )
    if value < 0:
        raise DataError(f"{source}: {row}, column {column!r}: relevance {value!r} is negative (use grades >= 0)")
    return float(value)


def check_groups(t: GroupTable) -> GroupTable:
    """Every group has a candidate more relevant than another (else it teaches nothing and
    ranking metrics are undefined); preference groups have distinct chosen and rejected texts."""
    for i, (c, y) in enumerate(zip(t.candidates, t.labels)):
        if t.kind == "preference":
            if c[0] == c[1]:
                raise DataError(
                    f"{t.source}: {t.rows[i]}: chosen and rejected are the same text; a preference "
                    "needs two different responses"
                )
        elif max(y) <= 0:
            raise DataError(
                f"{t.source}: {t.rows[i]}: the group of query {t.queries[i][:60]!r} has no relevant "
                "candidate (every label is 0); give each query at least one candidate with label > 0"
            )
        elif len(c) < 2:
            raise DataError(
                f"{t.source}: {t.rows[i]}: the group of query {t.queries[i][:60]!r} has a single "
                "candidate; ranking needs at least two per query (a relevant one and another)"
            )
    return t


def check_unit_relevance(t: GroupTable, objective: str) -> None:
    """Pointwise binary cross-entropy reads relevance as a probability: every label in [0, 1]."""
    for i, ys in enumerate(t.labels):
        bad = [y for y in ys if y > 1]
        if bad:
            raise DataError(
                f"{t.source}: {t.rows[i]}: relevance {bad[0]:g} is above 1; --objective {objective} "
                "(binary cross-entropy) needs relevance in [0, 1]: divide graded labels by the top "
                "grade, or train with --objective listwise / pairwise, which take any grades"
            )


def _require(cols: list[str], names: Sequence[str], path: str, layout: str) -> None:
    missing = [n for n in names if n not in cols]
    if missing:
        raise DataError(
            f"{path}: no column {missing[0]!r} (columns: {cols}); a {layout} table needs columns {', '.join(names)}"
        )


def detect_layout(cols: Sequence[str]) -> str:
    """``preference`` (chosen/rejected), ``lists`` (passages) or ``rows`` (passage + label)."""
    if "chosen" in cols or "rejected" in cols:
        return "preference"
    if "passages" in cols:
        return "lists"
    return "rows"


def load_group_table(path: str | os.PathLike | DataObject, *, query_column: str | None = None) -> GroupTable:
    """A preference or ranking table (CSV / TSV / JSON Lines / Parquet, or an in-memory table of
    :mod:`flaxheads.data.objects`); the layout follows the columns."""
    if isinstance(path, DataObject):
        return _group_table(Columns(path), str(path), query_column)
    path = os.fspath(path)
    return _group_table(read_table(path), path, query_column)


def _group_table(ds, path: str, query_column: str | None) -> GroupTable:
    """The groups of ``ds`` (a ``datasets.Dataset`` or :class:`~flaxheads.data.objects.Columns`)."""
    cols = list(ds.column_names)
    layout = detect_layout(cols)
    q = query_column or ("prompt" if layout == "preference" and "prompt" in cols else "query")
    if layout == "preference":
        _require(cols, (q, "chosen", "rejected"), path, "preference")
        data = {c: list(ds[c]) for c in (q, "chosen", "rejected", *(["margin"] if "margin" in cols else []))}
        rows = [f"row {i + 1}" for i in range(len(ds))]
        cand = [
            [_text(a, path, r, "chosen"), _text(b, path, r, "rejected")]
            for a, b, r in zip(data["chosen"], data["rejected"], rows)
        ]
        margins = [_finite(m, path, r, "margin") for m, r in zip(data["margin"], rows)] if "margin" in data else None
        t = GroupTable(
            [_text(x, path, r, q) for x, r in zip(data[q], rows)],
            cand,
            [[1.0, 0.0]] * len(cand),
            path,
            rows,
            "preference",
            margins,
        )
    elif layout == "lists":
        _require(cols, (q, "passages", "labels"), path, "ranking (one row per query)")
        queries, passages, labels = list(ds[q]), list(ds["passages"]), list(ds["labels"])
        rows = [f"row {i + 1}" for i in range(len(ds))]
        for p, y, r in zip(passages, labels, rows):
            if not isinstance(p, list) or not isinstance(y, list) or len(p) != len(y):
                raise DataError(
                    f"{path}: {r}: columns 'passages' and 'labels' must be lists of the same length, "
                    f"got {type(p).__name__} of {len(p) if isinstance(p, list) else '?'} and "
                    f"{type(y).__name__} of {len(y) if isinstance(y, list) else '?'}"
                )
        t = GroupTable(
            [_text(x, path, r, q) for x, r in zip(queries, rows)],
            [[_text(x, path, r, "passages") for x in p] for p, r in zip(passages, rows)],
            [[_number(v, path, r, "labels") for v in y] for y, r in zip(labels, rows)],
            path,
            rows,
        )
    else:
        _require(cols, (q, "passage", "label"), path, "ranking (one row per candidate)")
        t = _rows_to_groups(list(ds[q]), list(ds["passage"]), list(ds["label"]), path, q)
    return check_groups(t)


def _rows_to_groups(queries, passages, labels, path: str, qcol: str) -> GroupTable:
    order: dict[str, int] = {}
    cand: list[list[str]] = []
    lab: list[list[float]] = []
    where: list[list[int]] = []
    for i, (q, p, y) in enumerate(zip(queries, passages, labels)):
        row = f"row {i + 1}"
        g = order.setdefault(_text(q, path, row, qcol), len(order))
        if g == len(cand):
            cand.append([])
            lab.append([])
            where.append([])
        cand[g].append(_text(p, path, row, "passage"))
        lab[g].append(_number(y, path, row, "label"))
        where[g].append(i + 1)
    rows = [
        f"row {w[0]}" if len(w) == 1 else f"rows {', '.join(map(str, w[:6]))}{', ...' if len(w) > 6 else ''}"
        for w in where
    ]
    return GroupTable(list(order), cand, lab, path, rows)


def bbc_news_groups(negatives: int = 3, seed: int = 0, limit: int | None = None, passage: str = "topic") -> GroupTable:
    """A relevance set from the packaged BBC News corpus (2,225 articles in 5 classes). Per article,
    the query is its headline (first line) and there are ``1 + negatives`` candidates, one relevant:

    * ``"topic"`` (default): the last paragraph of another article of the same class (relevant)
      and of ``negatives`` articles of other classes, each of a different class when there are
      enough: relevance is the topic, with few words shared;
    * ``"last"``: the article's own last paragraph (relevant) and the last paragraphs of
      ``negatives`` other articles of the same class;
    * ``"body"``: the same with whole bodies, whose opening repeats the headline's words
      (lexical overlap alone ranks nearly all of them right).

    Articles and candidates are drawn with ``seed``; ``limit``: that many articles at random."""
    if passage not in ("topic", "last", "body"):
        raise DataError(f"bbc_news passage {passage!r}: expected 'topic', 'last' or 'body'")
    root = bbc_news_path()
    rng = np.random.default_rng(seed)
    heads: list[str] = []
    bodies: list[str] = []
    class_names: list[str] = []
    rows: list[str] = []
    for c in sorted(d.name for d in root.iterdir() if d.is_dir()):
        for f in sorted((root / c).glob("*.txt")):
            head, _, body = _read_text(f).strip().partition("\n")
            paragraphs = [p.strip() for p in body.split("\n") if p.strip()]
            if head.strip() and paragraphs:
                heads.append(head.strip())
                class_names.append(c)
                rows.append(f"file {c}/{f.name}")
                bodies.append("\n".join(paragraphs) if passage == "body" else paragraphs[-1])
    classes = np.asarray(class_names)
    names = sorted(set(classes.tolist()))
    keep = (
        np.arange(len(heads)) if limit is None or limit >= len(heads) else np.sort(rng.permutation(len(heads))[:limit])
    )
    queries: list[str] = []
    cand: list[list[str]] = []
    labels: list[list[float]] = []
    where: list[str] = []
    for i in keep:
        same = np.flatnonzero(classes == classes[i])
        same = same[same != i]
        if passage == "topic":
            other = [c for c in names if c != classes[i]]
            pick = rng.permutation(other)[np.arange(negatives) % len(other)]
            chosen = [int(rng.choice(same))] + [int(rng.choice(np.flatnonzero(classes == c))) for c in pick]
        else:
            chosen = [int(i), *rng.choice(same, size=negatives, replace=False).tolist()]
        queries.append(heads[i])
        where.append(rows[i])
        cand.append([bodies[j] for j in chosen])
        labels.append([1.0] + [0.0] * negatives)
    return check_groups(GroupTable(queries, cand, labels, f"bbc_news ({passage} relevance set)", where))


def load_groups(spec: str | DataObject, **options) -> GroupTable:
    """``bbc_news`` (the relevance set of :func:`bbc_news_groups`), a table file or an in-memory table."""
    if isinstance(spec, DataObject):
        return load_group_table(spec, query_column=options.get("query_column"))
    if spec == "bbc_news":
        return bbc_news_groups(**{k: v for k, v in options.items() if k in ("negatives", "seed", "limit", "passage")})
    if not os.path.exists(spec):
        raise DataError(f"{spec!r}: no such file, and not the packaged dataset name 'bbc_news'")
    return load_group_table(spec, query_column=options.get("query_column"))


def split_groups(table: GroupTable, fractions: Sequence[float], seed: int) -> dict[str, GroupTable]:
    """Seeded train / validation / test split of the groups (a group is never split)."""
    parts = split_indices(len(table), fractions, seed)
    return {name: table.take(p) for name, p in zip(SPLITS, parts) if len(p)}


# ---- tokenised splits and batches ---------------------------------------------------------------


@dataclasses.dataclass
class GroupedSplit:
    """A tokenised split of groups: token ids per (query, candidate) row, rows of a group adjacent
    (group ``g`` is rows ``offsets[g]:offsets[g + 1]``) and relevance per row."""

    name: str
    input_ids: list[np.ndarray]
    labels: np.ndarray
    offsets: np.ndarray
    token_type_ids: list[np.ndarray] | None = None
    margins: np.ndarray | None = None  # per group: batches then carry [relevance, margin] per row

    def __len__(self) -> int:  # batches, epochs and steps count groups
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def lengths(self) -> np.ndarray:
        """The longest row of each group (what its batch pads to)."""
        row = np.asarray([len(x) for x in self.input_ids], np.int64)
        return np.maximum.reduceat(row, self.offsets[:-1]) if len(self) else np.zeros(0, np.int64)


def tokenize_groups(table: GroupTable, tokenizer, max_length: int, name: str = "train") -> GroupedSplit:
    """Every (query, candidate) pair of ``table`` as a text pair, truncated to ``max_length``."""
    q = [x for x, c in zip(table.queries, table.candidates) for _ in c]
    p = [x for c in table.candidates for x in c]
    out = tokenizer(q, p, truncation=True, max_length=max_length, padding=False)
    ids = [np.asarray(x, np.int32) for x in out["input_ids"]]
    tt = [np.asarray(x, np.int32) for x in out["token_type_ids"]] if "token_type_ids" in out else None
    offsets = np.concatenate([[0], np.cumsum([len(c) for c in table.candidates])]).astype(np.int64)
    labels = np.asarray([y for ys in table.labels for y in ys], np.float32)
    margins = None if table.margins is None else np.asarray(table.margins, np.float32)
    return GroupedSplit(name, ids, labels, offsets, tt, margins)


def group_rows(split: GroupedSplit, groups: np.ndarray, batch_size: int, group_size: int) -> np.ndarray:
    """Row index of each slot of a batch of ``batch_size`` groups x ``group_size`` (-1: padding)."""
    slots = np.full((batch_size, group_size), -1, np.int64)
    for b, g in enumerate(groups):
        lo, hi = split.offsets[g], split.offsets[g + 1]
        if hi - lo > group_size:
            raise ValueError(f"group {g} has {hi - lo} candidates > group_size {group_size}")
        slots[b, : hi - lo] = np.arange(lo, hi)
    return slots.reshape(-1)


def collate_groups(
    split: GroupedSplit, groups: np.ndarray, batch_size: int, group_size: int, buckets: Sequence[int], pad_id: int = 0
) -> dict:
    """Groups ``groups`` as ``batch_size * group_size`` rows padded to the bucket of their longest
    row: ``input_ids``, ``attention_mask`` (, ``token_type_ids``), ``labels`` (relevance; with margins
    ``[relevance, group margin]`` per row),
    ``weights`` (a group's weight 1 shared among its real rows; 0 for padding) and ``group`` (the
    group's index in the split, -1 for padding)."""
    groups = np.asarray(groups, np.int64)
    if len(groups) > batch_size:
        raise ValueError(f"{len(groups)} groups > batch_size {batch_size}")
    slots = group_rows(split, groups, batch_size, group_size)
    real = slots >= 0
    rows = np.flatnonzero(real)
    t = bucket_length(max([len(split.input_ids[i]) for i in slots[real]] + [1]), buckets)
    pad = [np.asarray([pad_id], np.int32)]
    ids = [split.input_ids[i] for i in slots[real]] + pad
    tts = None if split.token_type_ids is None else [split.token_type_ids[i] for i in slots[real]] + [pad[0] * 0]
    take = np.full(len(slots), len(ids) - 1, np.int64)
    take[rows] = np.arange(len(rows))
    out = token_batch(ids, tts, take, len(slots), t, pad_id)
    sizes = real.reshape(batch_size, group_size).sum(1)
    weights = np.where(real.reshape(batch_size, group_size), 1.0 / np.maximum(sizes, 1)[:, None], 0.0)
    labels = np.zeros(len(slots), np.float32)
    labels[rows] = split.labels[slots[real]]
    if split.margins is not None:  # each row carries its group's margin beside its relevance
        margin = np.zeros((batch_size, group_size), np.float32)
        margin[: len(groups)] = split.margins[groups][:, None]
        labels = np.stack([labels, margin.reshape(-1)], axis=1)
    group = np.full((batch_size, group_size), -1, np.int64)
    group[: len(groups)] = groups[:, None]
    out.update(
        labels=labels,
        weights=weights.reshape(-1).astype(np.float32),
        group=np.where(real, group.reshape(-1), -1).astype(np.int32),
    )
    return out


def iterate_group_batches(
    split: GroupedSplit,
    batch_size: int,
    buckets: Sequence[int],
    *,
    group_size: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    start: int = 0,
    pad_id: int = 0,
    group_by_length: bool = False,
) -> Iterator[dict]:
    """One epoch of group batches from batch ``start`` on, a pure function of ``(seed, epoch)``."""
    plan = batch_plan(
        split.lengths, batch_size, seed=seed, epoch=epoch, shuffle=shuffle, group_by_length=group_by_length
    )
    for idx in plan[start:]:
        yield collate_groups(split, idx, batch_size, group_size, buckets, pad_id)
