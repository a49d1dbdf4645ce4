"""Packed batches: several short texts share one row, so short-text data stops paying for padding.

A packed batch holds exactly the examples of one ordinary batch (same batch plan, same order,
same per-example weights), laid out differently: texts are placed first-fit into rows of a
bucketed length, each keeps its own positions (restarting at the family's first position) and
attends only to its own tokens (block-diagonal attention), and the pooler and head run on each
text gathered back into its own padded row. The loss is the same weighted mean over the same
examples, so a packed run computes what the unpacked run computes, in fewer token slots.

Shapes are bucketed (rows and texts per row to powers of two, lengths to the training
buckets) so the number of compiled programs stays small.

Batch keys, besides ``input_ids`` / ``attention_mask`` / ``position_ids`` ``[R, T]``:
``segment_ids [R, T]`` (texts numbered 1, 2, ... per row, padding 0), ``segment_index [R, S, L]``
(the row positions of each text's tokens, padded), ``segment_mask [R, S, L]``, ``labels [R, S, ...]``
and ``weights [R, S]`` (0 for empty text slots and padding rows).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from .data import Split, batch_plan, bucket_length
from .errors import TrainingError

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


def packed_batch(split: Split, idx: Sequence[int], batch_size: int, buckets: Sequence[int], *, pad_id: int = 0,
                 first_position: int = 0, row_multiple: int = 1) -> dict:
    """The examples ``idx`` of ``split`` (one batch of at most ``batch_size``) packed into rows whose
    length is at most the largest bucket; see the module docstring for the keys. The row count is a
    multiple of ``row_multiple`` (the data-parallel width, which splits rows across devices)."""
    idx = np.asarray(idx, np.int64)
    if len(idx) > batch_size:
        raise ValueError(f"{len(idx)} examples > batch_size {batch_size}")
    longest = int(buckets[-1])
    texts = [np.asarray(split.input_ids[i][:longest]) for i in idx]
    types = None if split.token_type_ids is None else [np.asarray(split.token_type_ids[i][:longest]) for i in idx]
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
    out = {"input_ids": np.full((n_rows, t), pad_id, np.int32), "attention_mask": np.zeros((n_rows, t), np.int32),
           "segment_ids": np.zeros((n_rows, t), np.int32),
           "position_ids": np.full((n_rows, t), first_position, np.int32),
           "segment_index": np.zeros((n_rows, n_seg, seg_len), np.int32),
           "segment_mask": np.zeros((n_rows, n_seg, seg_len), np.int32),
           "weights": np.zeros((n_rows, n_seg), np.float32)}
    labels = np.asarray(split.labels)[idx]
    out["labels"] = np.zeros((n_rows, n_seg, *labels.shape[1:]), labels.dtype)
    if types is not None:
        out["token_type_ids"] = np.zeros((n_rows, t), np.int32)
    for r, members in enumerate(rows):
        start = 0
        for s, i in enumerate(members):
            n, x = lengths[i], texts[i]
            span = slice(start, start + n)
            out["input_ids"][r, start:start + len(x)] = x
            out["attention_mask"][r, span] = 1
            out["segment_ids"][r, span] = s + 1
            out["position_ids"][r, span] = first_position + np.arange(n)
            out["segment_index"][r, s, :n] = start + np.arange(n)
            out["segment_mask"][r, s, :n] = 1
            out["labels"][r, s] = labels[i]
            out["weights"][r, s] = 1.0
            if types is not None:
                out["token_type_ids"][r, start:start + len(types[i])] = types[i]
            start += n
    # empty slots and padding rows pool over one position: never a fully masked (NaN) row
    out["segment_mask"][:, :, 0] = 1
    out["attention_mask"][:, 0] = 1
    return out


def iterate_packed_batches(split: Split, batch_size: int, buckets: Sequence[int], *, seed: int = 0, epoch: int = 0,
                           shuffle: bool = True, start: int = 0, pad_id: int = 0, group_by_length: bool = False,
                           first_position: int = 0, row_multiple: int = 1) -> Iterator[dict]:
    """:func:`~flaxheads.training.data.iterate_batches`' batches (same plan), packed."""
    plan = batch_plan(split.lengths, batch_size, seed=seed, epoch=epoch, shuffle=shuffle,
                      group_by_length=group_by_length)
    for idx in plan[start:]:
        yield packed_batch(split, idx, batch_size, buckets, pad_id=pad_id, first_position=first_position,
                           row_multiple=row_multiple)


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
