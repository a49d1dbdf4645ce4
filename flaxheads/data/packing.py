"""Packed batches: several short texts share one row, so short-text data stops paying for padding.

A packed batch holds exactly the examples of one ordinary batch (same batch plan, same order,
same per-example weights), laid out differently: texts are placed first-fit into rows of a
bucketed length, each keeps its own positions (restarting at the family's first position) and
attends only to its own tokens (block-diagonal attention), and the pooler and head run on each
text gathered back into its own padded row. The loss is the same weighted mean over the same
examples, so a packed run computes what the unpacked run computes, in fewer token slots.

Shapes are bucketed (rows and texts per row to powers of two, lengths to the training
buckets), and a shape few batches of an epoch need is padded to a larger one in use, so the
number of compiled programs stays small.

Batch keys, besides ``input_ids`` / ``attention_mask`` / ``position_ids`` ``[R, T]``:
``segment_ids [R, T]`` (texts numbered 1, 2, ... per row, padding 0), ``segment_index [R, S, L]``
(the row positions of each text's tokens, padded), ``segment_mask [R, S, L]``, ``labels [R, S, ...]``
and ``weights [R, S]`` (0 for empty text slots and padding rows).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from flaxheads.data.batching import bucket_length
from flaxheads.data.splits import Split, batch_plan
from flaxheads.errors import TrainingError

#: The keys that make a batch packed (the train step dispatches on ``"segment_ids"``).
PACKED_KEYS = ("segment_ids", "position_ids", "segment_index", "segment_mask")


def _pow2_at_least(n: int, cap: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return min(p, max(cap, n))


def first_fit(lengths: Sequence[int], row_length: int) -> list[list[int]]:
    """Indices of ``lengths`` placed first-fit, in order, into rows of ``row_length`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(lengths):
        if n > row_length:
            raise TrainingError(f"a text of {n} tokens does not fit a packed row of {row_length}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(row_length - n)
    return rows


def _layout(split: Split, idx: np.ndarray, batch_size: int, buckets: Sequence[int], row_multiple: int):
    """``(texts, lengths, rows, shape)``: the batch's texts (cut to the largest bucket), their
    lengths, their rows, and ``shape = (rows, row length, texts per row, text length)``."""
    longest = int(buckets[-1])
    texts = [np.asarray(split.input_ids[i][:longest]) for i in idx]
    lengths = [max(len(x), 1) for x in texts]

    def layout(row_length: int) -> tuple[int, int, list[list[int]]]:
        rows = first_fit(lengths, row_length) if len(idx) else []
        n_rows = _pow2_at_least(max(len(rows), 1), batch_size)
        n_rows = -(-n_rows // row_multiple) * row_multiple
        return n_rows, bucket_length(max([sum(lengths[i] for i in r) for r in rows] + [1]), buckets), rows

    # the row length (a bucket) that needs the fewest token slots; ties go to the longer rows
    candidates = [layout(int(b)) for b in buckets if b >= max(lengths + [1])] or [layout(longest)]
    n_rows, t, rows = min(reversed(candidates), key=lambda c: c[0] * c[1])
    n_seg = _pow2_at_least(max([len(r) for r in rows] + [1]), batch_size)
    seg_len = bucket_length(max(lengths + [1]), buckets)
    return texts, lengths, rows, (n_rows, t, n_seg, seg_len)


def packed_shape(
    split: Split, idx: Sequence[int] | np.ndarray, batch_size: int, buckets: Sequence[int], *, row_multiple: int = 1
) -> tuple[int, int, int, int]:
    """The shape :func:`packed_batch` gives these examples on its own: ``(rows, row length,
    texts per row, text length)``."""
    return _layout(split, np.asarray(idx, np.int64), batch_size, buckets, row_multiple)[3]


def packed_batch(
    split: Split,
    idx: Sequence[int] | np.ndarray,
    batch_size: int,
    buckets: Sequence[int],
    *,
    pad_id: int = 0,
    first_position: int = 0,
    row_multiple: int = 1,
    shape: Sequence[int] | None = None,
) -> dict:
    """The examples ``idx`` of ``split`` (one batch of at most ``batch_size``) packed into rows whose
    length is at most the largest bucket; see the module docstring for the keys. The row count is a
    multiple of ``row_multiple`` (the data-parallel width, which splits rows across devices).
    ``shape`` (a :func:`packed_shape` at least as large in every dimension) pads the batch to it."""
    examples = np.asarray(idx, np.int64)
    if len(examples) > batch_size:
        raise ValueError(f"{len(examples)} examples > batch_size {batch_size}")
    texts, lengths, rows, own = _layout(split, examples, batch_size, buckets, row_multiple)
    if shape is not None and any(a < b for a, b in zip(shape, own)):
        raise ValueError(f"packed shape {tuple(shape)} is smaller than the batch's own {own}")
    n_rows, t, n_seg, seg_len = own if shape is None else shape
    types = (
        None
        if split.token_type_ids is None
        else [np.asarray(split.token_type_ids[i][: int(buckets[-1])]) for i in examples]
    )
    out = {
        "input_ids": np.full((n_rows, t), pad_id, np.int32),
        "attention_mask": np.zeros((n_rows, t), np.int32),
        "segment_ids": np.zeros((n_rows, t), np.int32),
        "position_ids": np.full((n_rows, t), first_position, np.int32),
        "segment_index": np.zeros((n_rows, n_seg, seg_len), np.int32),
        "segment_mask": np.zeros((n_rows, n_seg, seg_len), np.int32),
        "weights": np.zeros((n_rows, n_seg), np.float32),
    }
    labels = np.asarray(split.labels)[examples]
    out["labels"] = np.zeros((n_rows, n_seg, *labels.shape[1:]), labels.dtype)
    if types is not None:
        out["token_type_ids"] = np.zeros((n_rows, t), np.int32)
    for r, members in enumerate(rows):
        start = 0
        for s, i in enumerate(members):
            n, x = lengths[i], texts[i]
            span = slice(start, start + n)
            out["input_ids"][r, start : start + len(x)] = x
            out["attention_mask"][r, span] = 1
            out["segment_ids"][r, span] = s + 1
            out["position_ids"][r, span] = first_position + np.arange(n)
            out["segment_index"][r, s, :n] = start + np.arange(n)
            out["segment_mask"][r, s, :n] = 1
            out["labels"][r, s] = labels[i]
            out["weights"][r, s] = 1.0
            if types is not None:
                out["token_type_ids"][r, start : start + len(types[i])] = types[i]
            start += n
    # empty slots and padding rows pool over one position: never a fully masked (NaN) row
    out["segment_mask"][:, :, 0] = 1
    out["attention_mask"][:, 0] = 1
    return out


#: A packed shape held by fewer than this share of an epoch's batches is padded to a larger one
#: in use (:func:`merge_rare_shapes`).
RARE_SHAPE_SHARE = 0.05
#: ... if that one has at most this many times its token slots.
RARE_SHAPE_MAX_GROWTH = 4


def merge_rare_shapes(
    shapes: Sequence[tuple[int, ...]], share: float = RARE_SHAPE_SHARE, max_growth: float = RARE_SHAPE_MAX_GROWTH
) -> list[tuple[int, ...]]:
    """The shape each batch is padded to: its own, or, for a shape fewer than ``share`` of the
    batches hold, the smallest (in token slots) shape held by more that is at least as large in
    every dimension and has at most ``max_growth`` times its slots. Each shape is another
    compiled train step (~6 s for MiniLM on 2 CPU cores, the time of 50 short-text steps), so a
    shape a few batches need is not worth its compile."""
    counts: dict[tuple[int, ...], int] = {}
    for s in shapes:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    floor = share * len(shapes)
    kept = [s for s, c in counts.items() if c >= floor]

    def slots(s):
        return s[0] * s[1]

    target = {}
    for s, c in counts.items():
        larger = [k for k in kept if k != s and all(a >= b for a, b in zip(k, s)) and slots(k) <= max_growth * slots(s)]
        target[s] = min(larger, key=lambda k: (slots(k), k)) if c < floor and larger else s
    return [target[tuple(s)] for s in shapes]


def _epoch_shapes(
    split: Split, plan: Sequence[np.ndarray], batch_size: int, buckets: Sequence[int], row_multiple: int
) -> list[tuple[int, ...]]:
    """The shape each batch of an epoch's plan is packed to (:func:`merge_rare_shapes`)."""
    return merge_rare_shapes([packed_shape(split, idx, batch_size, buckets, row_multiple=row_multiple) for idx in plan])


def iterate_packed_batches(
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
    first_position: int = 0,
    row_multiple: int = 1,
) -> Iterator[dict]:
    """:func:`~flaxheads.data.splits.iterate_batches`' batches (same plan), packed; shapes few
    batches of the epoch need are padded to larger ones in use (:func:`merge_rare_shapes`), a pure
    function of the epoch's plan, so a resumed run gets the same batches."""
    plan = batch_plan(
        split.lengths, batch_size, seed=seed, epoch=epoch, shuffle=shuffle, group_by_length=group_by_length
    )
    shapes = _epoch_shapes(split, plan, batch_size, buckets, row_multiple)
    for idx, shape in zip(plan[start:], shapes[start:]):
        yield packed_batch(
            split,
            idx,
            batch_size,
            buckets,
            pad_id=pad_id,
            first_position=first_position,
            row_multiple=row_multiple,
            shape=shape,
        )


#: ``flaxheads train`` packs on its own (no ``--pack``/``--no-pack``) when an epoch packed needs at
#: most this share of the token slots of the same batches padded.
AUTO_PACK_SHARE = 1 / 3


def packed_slot_share(
    split: Split,
    batch_size: int,
    buckets: Sequence[int],
    *,
    seed: int = 0,
    group_by_length: bool = True,
    row_multiple: int = 1,
) -> float:
    """Token slots of the first epoch packed (the shapes :func:`iterate_packed_batches` gives)
    over those of the same batches padded to their buckets with ``batch_size`` rows each
    (``data.iterate_batches``): what packing saves, before any compile or step."""
    plan = batch_plan(split.lengths, batch_size, seed=seed, epoch=0, group_by_length=group_by_length)
    lengths = split.lengths
    padded = sum(batch_size * bucket_length(int(lengths[idx].max(initial=1)), buckets) for idx in plan)
    packed = sum(r * t for r, t, _, _ in _epoch_shapes(split, plan, batch_size, buckets, row_multiple))
    return packed / max(padded, 1)


def is_packed(batch) -> bool:
    return "segment_ids" in batch


def example_targets(batch) -> tuple:
    """``(labels, weights)`` with one row per example slot (packed ``[R, S, ...]`` flattened to ``[R*S, ...]``)."""
    labels, weights = batch["labels"], batch["weights"]
    if is_packed(batch):
        labels = labels.reshape((-1, *labels.shape[2:]))
        weights = weights.reshape(-1)
    return labels, weights


def padding_fraction(batch) -> float:
    """The share of the batch's token slots that hold padding (logged by ``fit`` as ``padding``)."""
    return 1.0 - float(np.asarray(batch["attention_mask"]).mean())
