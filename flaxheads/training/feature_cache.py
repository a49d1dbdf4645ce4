"""The feature cache itself: what :func:`~flaxheads.training.features.cache_features` fills and
head training reads.

* :class:`FeatureCache`: encoder outputs grouped by padded length (:class:`Bucket`), batched for
  ``make_head_train_step`` (``hidden``, ``pool_mask``, ``labels``, ``weights``);
* its layout: the cache level a pooler allows (:func:`choose_level`), the length groups examples are
  encoded and stored in (:func:`encode_groups`, :func:`bucket_sizes`), and where the arrays live (in
  memory, or ``.npy`` memory maps in a directory past ``max_bytes``);
* :func:`predict_cache`: a prediction function over every cached example, in example order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from flaxheads.data.batching import bucket_length, pad_mask, pad_rows, predict_batches
from flaxheads.data.splits import labelled_rows
from flaxheads.errors import TrainingError
from flaxheads.heads.poolers import DensePooler, Pool

LEVELS = ("auto", "pooled", "token")


def reduction(pooler) -> str | None:
    """The fixed sequence reduction in front of ``pooler``'s params, or None (needs tokens)."""
    if isinstance(pooler, Pool):
        return pooler.mode
    if isinstance(pooler, DensePooler):
        return pooler.source
    return None


@dataclasses.dataclass
class Bucket:
    """Cached rows of one padded length: ``hidden [n, T, H]``, ``mask [n, T]``, source ``index [n]``."""

    length: int
    index: np.ndarray
    hidden: np.ndarray
    mask: np.ndarray


@dataclasses.dataclass
class FeatureCache:
    """Encoder outputs for ``n`` examples, grouped by padded length (one bucket when pooled)."""

    level: str
    reductions: tuple[str, ...]  # pooled: the reduction cached at each position of axis 1; token: ()
    hidden_size: int
    buckets: list[Bucket]
    labels: np.ndarray | None
    encode_seconds: float = 0.0
    directory: str | None = None

    def __len__(self) -> int:
        return int(sum(len(b.index) for b in self.buckets))

    @property
    def nbytes(self) -> int:
        return int(sum(b.hidden.nbytes + b.mask.nbytes for b in self.buckets))

    def batches(
        self, batch_size: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True, labels: np.ndarray | None = None
    ) -> Iterator[dict]:
        """One epoch of batches ``{hidden, pool_mask, labels, weights, index}``.

        Each batch comes from one bucket and is padded to ``batch_size`` with weight-0 rows
        (so the compile count is the bucket count); the order is a pure function of
        ``(seed, epoch)``. ``labels`` (indexed by example) overrides the cached ones."""
        labels = self.labels if labels is None else np.asarray(labels)
        if labels is None:
            raise TrainingError("no labels: pass labels= here or to cache_features")
        rng = np.random.default_rng([seed, epoch])
        plan = []
        for bi, b in enumerate(self.buckets):
            rows = rng.permutation(len(b.index)) if shuffle else np.arange(len(b.index))
            plan += [(bi, rows[i : i + batch_size]) for i in range(0, len(rows), batch_size)]
        if shuffle:
            plan = [plan[i] for i in rng.permutation(len(plan))]
        for bi, rows in plan:
            yield self._collate(self.buckets[bi], np.sort(rows), batch_size, labels)

    def _collate(self, b: Bucket, rows: np.ndarray, batch_size: int, labels: np.ndarray) -> dict:
        idx = b.index[rows]
        return {
            "hidden": pad_rows(b.hidden[rows], batch_size),
            "pool_mask": pad_mask(b.mask[rows], batch_size),
            **labelled_rows(labels[idx], batch_size),
            "index": pad_rows(idx, batch_size, fill=-1),
        }

    @property
    def num_examples(self) -> int:
        """One past the largest cached example index (predictions are indexed by example)."""
        return int(max(int(b.index.max()) for b in self.buckets) + 1)

    def gather(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pooled caches only: ``(hidden [k, R, H], mask [k, R])`` of examples ``index``."""
        if self.level != "pooled":
            raise TrainingError("gather() needs a pooled cache (one bucket of length 1)")
        b = self.buckets[0]
        pos = np.empty(int(b.index.max()) + 1, np.int64)
        pos[b.index] = np.arange(len(b.index))
        rows = pos[np.asarray(index)]
        return np.asarray(b.hidden[rows]), np.asarray(b.mask[rows])


def choose_level(pooler, level: str = "auto") -> str:
    if level not in LEVELS:
        raise TrainingError(f"level must be one of {LEVELS}, got {level!r}")
    if level == "auto":
        return "pooled" if reduction(pooler) is not None else "token"
    if level == "pooled" and reduction(pooler) is None:
        raise TrainingError(
            f"{type(pooler).__name__} reads every token (learned weighting); it cannot train on "
            "pooled features. Use level='token' (or 'auto')."
        )
    return level


def _storage(groups: dict, lvl: str, width: int, h: int, dtype, max_bytes: int, directory) -> tuple[Callable, bool]:
    """``(alloc, on_disk)``: ``alloc(t, n) -> (hidden, mask)`` arrays for bucket ``t``, in memory, or
    memory maps in ``directory`` when the whole cache would exceed ``max_bytes``."""
    itemsize = np.dtype(dtype).itemsize
    need = sum(len(ix) * (width if lvl == "pooled" else t) * (h * itemsize + 4) for t, ix in groups.items())
    to_disk = need > max_bytes
    if to_disk and directory is None:
        raise TrainingError(
            f"the {lvl} feature cache needs {need / 2**20:.0f} MiB > max_bytes="
            f"{max_bytes / 2**20:.0f} MiB: pass directory= to keep it on disk (memory-mapped), "
            "raise max_bytes, store dtype=np.float16, or shorten the texts (smaller buckets)."
        )
    if to_disk:
        os.makedirs(directory, exist_ok=True)

    def alloc(t: int, n: int):
        shape = (n, width if lvl == "pooled" else t, h)
        if not to_disk:
            return np.empty(shape, dtype), np.empty(shape[:2], np.int32)
        return (
            np.lib.format.open_memmap(os.path.join(directory, f"hidden_{t}.npy"), "w+", dtype, shape),
            np.lib.format.open_memmap(os.path.join(directory, f"mask_{t}.npy"), "w+", np.int32, shape[:2]),
        )

    return alloc, to_disk


def _bucket_groups(lengths: Sequence[int], batch_size: int, buckets: Sequence[int]) -> dict[int, np.ndarray]:
    """``{padded length: example indices}``: each example in its own bucket, in example order."""
    padded = np.asarray([bucket_length(max(int(n), 1), buckets) for n in lengths])
    return {t: np.flatnonzero(padded == t) for t in buckets if np.any(padded == t)}


def bucket_sizes(pooler, lengths: Sequence[int], buckets: Sequence[int]) -> list[int]:
    """The rows of each bucket of the cache :func:`cache_features` makes (``level="auto"``) of texts
    of ``lengths``: one bucket of them all for pooled features, else one per padded length. Its
    batches cut each bucket on its own, so these give the batches of an epoch before encoding."""
    if choose_level(pooler) == "pooled":
        return [len(lengths)]
    return [len(ix) for ix in _bucket_groups(lengths, 0, tuple(sorted(buckets))).values()]


def encode_groups(lengths: Sequence[int], batch_size: int, buckets: Sequence[int]) -> dict[int, np.ndarray]:
    """``{padded length: example indices}`` for encoding pooled features: the examples longest
    first, cut into batches of ``batch_size``, each padded to the bucket of its longest text.
    Sliced into ``batch_size`` rows, each group gives back those batches.

    Only the last batch is partial, so a bucket's leftover texts fill the batch that a longer
    bucket pads anyway: the padding rows are the fewest possible, and no length gets a batch that
    one bucket per text would not have given it (same compiles). 500 BBC News articles at 256
    tokens in batches of 32: 16 batches of 256 tokens instead of those and one of 192 for 11 texts."""
    lens = np.asarray([max(int(n), 1) for n in lengths])
    order = np.argsort(-lens, kind="stable")
    padded = np.empty(len(order), np.int64)
    for s in range(0, len(order), batch_size):
        batch = order[s : s + batch_size]
        padded[s : s + len(batch)] = bucket_length(int(lens[batch[0]]), buckets)
    return {int(t): order[padded == t] for t in sorted(set(padded.tolist()))}


def predict_cache(
    predict: Callable[[dict], np.ndarray], cache: FeatureCache, batch_size: int = 256, *, axis: int = 0
) -> np.ndarray:
    """``predict(batch)`` for every cached example, in example order: its outputs carry the batch
    rows on ``axis`` (0; 1 for a sweep's ``[K, B, N]``), the result has ``num_examples`` there."""
    n = cache.num_examples
    batches = cache.batches(batch_size, shuffle=False, labels=np.zeros((n,), np.int32))
    out, kept = predict_batches(predict, batches, keys=("index",), axis=axis)
    assert out is not None, "a feature cache holds at least one example"
    shape = list(out.shape)
    shape[axis] = n
    full = np.zeros(shape, np.float32)
    full[(slice(None),) * axis + (kept["index"],)] = out
    return full
