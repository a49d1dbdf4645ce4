"""Padded batches of token ids, as training and prediction both build them, and the real rows
of their outputs: lengths rounded up to a few buckets (one compiled program per bucket), rows
padded up to the batch size, and weight-0 padding rows dropped again from the outputs.

Every batch has ``batch_size`` rows; rows past the end of the data are padding rows that attend
to their first token only (never a fully masked row, whose pooled value would be NaN, and
NaN * weight 0 is still NaN). Training's batch plans and labels are in
:mod:`flaxheads.data.splits`, prediction's in :mod:`flaxheads.predict.batches`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

#: Batch keys passed through to the backbone besides ids and mask.
EXTRA_INPUTS = ("token_type_ids",)


def extra_inputs(batch: dict) -> dict:
    """The optional backbone inputs a batch carries (token types)."""
    return {k: batch[k] for k in EXTRA_INPUTS if k in batch}


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


def pad_rows(rows, batch_size: int, fill=0) -> np.ndarray:
    """``rows`` [k, ...] followed by rows of ``fill`` up to ``batch_size`` (the weight-0 padding rows)."""
    rows = np.asarray(rows)
    if len(rows) > batch_size:
        raise ValueError(f"{len(rows)} rows > batch_size {batch_size}")
    out = np.full((batch_size, *rows.shape[1:]), fill, rows.dtype)
    out[: len(rows)] = rows
    return out


def pad_mask(mask_rows, batch_size: int) -> np.ndarray:
    """A mask padded to ``batch_size`` rows that see their first position only: never a fully
    masked row, whose pooled value would be NaN (and NaN * weight 0 is still NaN)."""
    mask = pad_rows(mask_rows, batch_size)
    mask[len(mask_rows) :, 0] = 1
    return mask


def _token_rows(seqs: Sequence, idx, length: int, fill: int) -> np.ndarray:
    out = np.full((len(idx), length), fill, np.int32)
    for r, i in enumerate(idx):
        x = np.asarray(seqs[i][:length])
        out[r, : len(x)] = x
    return out


def token_batch(
    input_ids: Sequence, token_type_ids: Sequence | None, idx, batch_size: int, length: int, pad_id: int = 0
) -> dict:
    """``input_ids``, ``attention_mask`` (and ``token_type_ids``) ``[batch_size, length]`` for the
    sequences ``idx``, truncated to ``length``, then padding rows. Every row attends to its first token."""
    idx = np.asarray(idx, np.int64)
    ids = _token_rows(input_ids, idx, length, pad_id)
    lengths = np.asarray([min(len(input_ids[i]), length) for i in idx], np.int64)
    mask = (np.arange(length) < lengths[:, None]).astype(np.int32)
    mask[:, :1] = 1
    out = {"input_ids": pad_rows(ids, batch_size, pad_id), "attention_mask": pad_mask(mask, batch_size)}
    if token_type_ids is not None:
        out["token_type_ids"] = pad_rows(_token_rows(token_type_ids, idx, length, 0), batch_size)
    return out


def predict_batches(
    predict: Callable[[dict], Any], batches: Iterable[dict], *, keys: Sequence[str] = (), axis: int = 0
) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """Run ``predict(batch)`` (outputs with the batch rows on ``axis``) over ``batches`` and keep the
    rows of real examples (weight > 0), in order: ``(outputs, {key: kept rows of batch[key]})``.
    ``(None, {})`` when there is no batch."""
    outs: list[np.ndarray] = []
    kept: dict[str, list[np.ndarray]] = {k: [] for k in keys}
    for b in batches:
        rows = np.flatnonzero(np.asarray(b["weights"]) > 0)
        outs.append(np.take(np.asarray(predict(b), np.float32), rows, axis=axis))
        for k in keys:
            kept[k].append(np.asarray(b[k])[rows])
    if not outs:
        return None, {}
    return np.concatenate(outs, axis=axis), {k: np.concatenate(v) for k, v in kept.items()}
