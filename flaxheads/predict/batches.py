"""Texts in, model outputs out, in input order: input checks, tokenisation with a truncation
count, batches grouped by length into the training buckets (one compile per bucket), and a
forward over all local devices.

Batches come from :mod:`flaxheads.data.batching` (``bucket_length``, ``token_batch``, ``pad_rows``)
and outputs are gathered by :func:`flaxheads.data.batching.predict_batches`, the pieces training's
evaluation uses, so a text is padded and computed here as it was there.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from flaxheads.data.batching import bucket_length, pad_rows, predict_batches, token_batch
from flaxheads.data.tables import DataError
from flaxheads.runtime.parallel import DATA_AXIS, Parallel
from flaxheads.training.programs import constants_program, make_eval_step

#: Above this many batches a call shows a progress bar (when tqdm is installed).
PROGRESS_BATCHES = 8


class TruncationWarning(UserWarning):
    """Some texts were longer than the model takes and were cut to its maximum length."""


def check_texts(values, what: str = "texts", rows: Sequence[str] | None = None) -> list[str]:
    """``values`` as a list of non-empty strings; else a :class:`DataError` naming the first bad
    position (``rows[i]`` when given, e.g. ``"input.csv: row 4, column 'text'"``)."""
    if isinstance(values, str):
        raise DataError(f"{what}: expected a list of texts, got one string; wrap it in a list ([text])")
    try:
        values = list(values)
    except TypeError:
        raise DataError(f"{what}: expected a list of texts, got {type(values).__name__}") from None
    for i, v in enumerate(values):
        if isinstance(v, str) and v.strip():
            continue
        where = rows[i] if rows is not None else f"{what}[{i}]"
        kind = "missing (None)" if v is None else "empty" if isinstance(v, str) else f"not text ({type(v).__name__})"
        raise DataError(f"{where}: text is {kind}; every input needs a non-empty text. Remove it or fill it in.")
    return values


@dataclasses.dataclass
class Encoded:
    """Token ids per text (no padding), token types for pairs, and how many texts were cut."""

    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray] | None
    truncated: np.ndarray  # positions of the texts that were cut to max_length

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(x) for x in self.input_ids], np.int64)


def encode(
    tokenizer,
    texts: list[str],
    pairs: list[str] | None,
    max_length: int,
    *,
    truncate: bool = True,
    rows: Sequence[str] | None = None,
    add_special_tokens: bool = True,
) -> Encoded:
    """Tokenise with the model's tokenizer, cutting to ``max_length`` tokens (longest first for
    pairs, as training did). Texts that needed cutting are found by encoding to one token
    more; ``truncate=False`` refuses them (a :class:`DataError` naming them)."""

    def run(t, p, n):
        special = {} if add_special_tokens else {"add_special_tokens": False}  # texts that already hold them
        out = tokenizer(t, p, truncation=True, max_length=n, padding=False, **special)
        ids = [np.asarray(x, np.int32) for x in out["input_ids"]]
        tt = (
            [np.asarray(x, np.int32) for x in out["token_type_ids"]]
            if p is not None and "token_type_ids" in out
            else None
        )
        return ids, tt

    ids, tt = run(texts, pairs, max_length + 1)
    over = np.flatnonzero(np.asarray([len(x) for x in ids]) > max_length)
    if len(over) and not truncate:
        names = [rows[i] if rows is not None else f"texts[{i}]" for i in over[:5]]
        raise DataError(
            f"{len(over)} input(s) are longer than the model's {max_length} tokens, e.g. "
            f"{', '.join(names)}; shorten them, or allow truncation (truncate=True, the default; "
            "the command line truncates unless --no-truncate)"
        )
    if len(over):
        cut_ids, cut_tt = run([texts[i] for i in over], None if pairs is None else [pairs[i] for i in over], max_length)
        for j, i in enumerate(over):
            ids[i] = cut_ids[j]
            if tt is not None:
                tt[i] = cut_tt[j]
        warnings.warn(
            f"{len(over)} of {len(texts)} texts were longer than {max_length} tokens and were truncated "
            f"to {max_length}",
            TruncationWarning,
            stacklevel=3,
        )
    return Encoded(ids, tt, over)


#: Padded lengths prediction adds below a model's smallest bucket.
SHORT_BUCKETS = (8, 16)


def short_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    """``buckets`` with :data:`SHORT_BUCKETS` below the smallest of them added. A single word or
    a short phrase is 3-6 tokens: in a training bucket of 32 every one of its batches did ~8x
    the work (all-MiniLM-L6-v2 on 512 single words, Intel Xeon: 480 texts/s against the
    transformers pipeline's 1172, which pads to the longest text). Two more programs at most."""
    low = min(buckets)
    return tuple(sorted({*buckets, *(b for b in SHORT_BUCKETS if b < low)}))


def plan(lengths: np.ndarray, batch_size: int, buckets: Sequence[int]) -> list[tuple[np.ndarray, int]]:
    """``(indices, padded length)`` per batch: texts sorted by length, cut into batches of
    ``batch_size``, each padded to the bucket of its longest text."""
    order = np.argsort(lengths, kind="stable")
    return [
        (idx, bucket_length(int(lengths[idx].max()), buckets))
        for idx in (order[i : i + batch_size] for i in range(0, len(order), batch_size))
    ]


def batch_rows(n: int, batch_size: int, width: int) -> int:
    """Rows per batch: ``batch_size``, or fewer for a short input (the next power of two, so the
    compile count stays bounded), a multiple of the ``width`` devices that share a batch."""
    rows = min(batch_size, 1 << max(n - 1, 0).bit_length())
    return -(-rows // width) * width


class Runner:
    """A model's forward, compiled once per padded shape and placed on the local devices (a
    1-D mesh, batch sharded, params replicated, when there are several). On one device where
    :meth:`~flaxheads.runtime.plan.ComputePlan.constant_weights` says so, the parameters are compiled into the
    program (oneDNN's products then take weights reordered once)."""

    def __init__(self, model, params, devices=None):
        devices = list(devices if devices is not None else jax.local_devices())
        # a 1-D data mesh over this process's devices: every device computes a slice of each batch
        self.parallel = (
            Parallel("mesh", Mesh(np.asarray(devices), (DATA_AXIS,))) if len(devices) > 1 else Parallel("single")
        )
        self.model = model
        self.params = self.parallel.put_state(params)
        step = make_eval_step(model)
        # program(batch) with the parameters compiled in; otherwise program(params, batch)
        fixed = (
            constants_program(step, self.params, model.plan, getattr(model.backbone, "dtype", jnp.float32))
            if self.parallel.mode == "single"
            else None
        )
        self.program = fixed or self.parallel.compile(step, donate=False)
        self._forward = fixed or functools.partial(self.program, self.params)

    @property
    def width(self) -> int:
        return self.parallel.width

    def __call__(
        self, enc: Encoded, *, batch_size: int, buckets: Sequence[int], pad_id: int, progress: bool | None = None
    ) -> np.ndarray:
        """Outputs ``[N, K]`` float32 for the encoded texts, in their order."""
        n = len(enc.input_ids)
        if n == 0:
            return np.zeros((0, self.model.num_labels), np.float32)
        rows = batch_rows(n, batch_size, self.width)
        batches = plan(enc.lengths, rows, buckets)
        order = np.concatenate([idx for idx, _ in batches])

        def make(idx, length):
            b = token_batch(enc.input_ids, enc.token_type_ids, idx, rows, length, pad_id)
            return {**b, "weights": pad_rows(np.ones(len(idx), np.float32), rows)}

        def forward(b: dict) -> np.ndarray:
            inputs = {k: v for k, v in b.items() if k != "weights"}
            return self.parallel.get_rows(self._forward(self.parallel.put_batch(inputs)))

        stream = (make(idx, length) for idx, length in batches)
        out, _ = predict_batches(forward, _progress(stream, len(batches), progress))
        result = np.empty_like(out)
        result[order] = out
        return result


def _progress(batches, total: int, show: bool | None):
    """``batches`` with a tqdm bar when asked (or, by default, for more than PROGRESS_BATCHES)."""
    if show is False or (show is None and total <= PROGRESS_BATCHES):
        return batches
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return batches
    return tqdm(batches, total=total, unit="batch", dynamic_ncols=True, leave=False)
