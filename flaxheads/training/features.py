"""Cached backbone features: encode a dataset once, train heads on the cache for many epochs.

With a frozen backbone, every epoch of head training recomputes the same encoder outputs.
:func:`cache_features` runs the encoder once (inference mode, length-bucketed batches, so
short texts do not pay for the longest) and keeps only what the pooler reads:

* ``level="pooled"``: poolers that reduce the sequence with a fixed rule (``Pool(mode)``,
  ``DensePooler(source=...)``) get that reduction cached as a one-token sequence
  ``[N, 1, H]`` with mask 1. Every pool function returns a lone unmasked token unchanged
  (mean, max, cls, last, sum/sqrt(1), position weight 1), so the *unchanged* pooler + head
  (same params tree, dropout included) gives exactly the recomputed logits.
* ``level="token"``: poolers with learned token weighting (``AttentionPool``, ``Concat``,
  ``SequenceSummary``) get the full hidden states ``[n, T_bucket, H]`` per length bucket.

Memory is bounded: when the cache would exceed ``max_bytes`` it is written to
``directory`` as ``.npy`` memory maps (read back batch by batch), or, with no directory,
refused with the size it would need. Batches from :meth:`FeatureCache.batches` have the
shape ``make_head_train_step`` takes: ``hidden``, ``pool_mask``, ``labels``, ``weights``.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..nn.poolers import POOL_FUNCTIONS, DensePooler, Pool

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

    def batches(self, batch_size: int, *, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                labels: np.ndarray | None = None) -> Iterator[dict]:
        """One epoch of batches ``{hidden, pool_mask, labels, weights, index}``.

        Each batch comes from one bucket and is padded to ``batch_size`` with weight-0 rows
        (so the compile count is the bucket count); the order is a pure function of
        ``(seed, epoch)``. ``labels`` (indexed by example) overrides the cached ones."""
        labels = self.labels if labels is None else np.asarray(labels)
        if labels is None:
            raise ValueError("no labels: pass labels= here or to cache_features")
        rng = np.random.default_rng([seed, epoch])
        plan = []
        for bi, b in enumerate(self.buckets):
            rows = rng.permutation(len(b.index)) if shuffle else np.arange(len(b.index))
            plan += [(bi, rows[i:i + batch_size]) for i in range(0, len(rows), batch_size)]
        if shuffle:
            plan = [plan[i] for i in rng.permutation(len(plan))]
        for bi, rows in plan:
            yield self._collate(self.buckets[bi], np.sort(rows), batch_size, labels)

    def _collate(self, b: Bucket, rows: np.ndarray, batch_size: int, labels: np.ndarray) -> dict:
        k = len(rows)
        hidden = np.zeros((batch_size, *b.hidden.shape[1:]), b.hidden.dtype)
        hidden[:k] = b.hidden[rows]
        mask = np.zeros((batch_size, b.mask.shape[1]), b.mask.dtype)
        mask[:k] = b.mask[rows]
        mask[k:, 0] = 1  # padding rows see one token: no all-masked row (NaN * 0 = NaN)
        idx = b.index[rows]
        lab = np.zeros((batch_size, *labels.shape[1:]), labels.dtype)
        lab[:k] = labels[idx]
        w = np.zeros((batch_size,), np.float32)
        w[:k] = 1.0
        index = np.full((batch_size,), -1, np.int64)
        index[:k] = idx
        return {"hidden": hidden, "pool_mask": mask, "labels": lab, "weights": w, "index": index}

    def gather(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pooled caches only: ``(hidden [k, R, H], mask [k, R])`` of examples ``index``."""
        if self.level != "pooled":
            raise ValueError("gather() needs a pooled cache (one bucket of length 1)")
        b = self.buckets[0]
        pos = np.empty(int(b.index.max()) + 1, np.int64)
        pos[b.index] = np.arange(len(b.index))
        rows = pos[np.asarray(index)]
        return np.asarray(b.hidden[rows]), np.asarray(b.mask[rows])


def choose_level(pooler, level: str = "auto") -> str:
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if level == "auto":
        return "pooled" if reduction(pooler) is not None else "token"
    if level == "pooled" and reduction(pooler) is None:
        raise ValueError(f"{type(pooler).__name__} reads every token (learned weighting); it cannot train on "
                         "pooled features. Use level='token' (or 'auto').")
    return level


def make_encoder(model, level: str, reductions: Sequence[str] = ()) -> Callable:
    """``encode(backbone_params, batch) -> (features, mask)``, jitted, inference mode.

    Pooled: features ``[B, R, H]``, one position per reduction (a head reads one of them as
    a one-token sequence); token: the hidden states and the pooling mask."""
    def encode(bparams, batch):
        extra = {"token_type_ids": batch["token_type_ids"]} if "token_type_ids" in batch else {}
        hidden, pmask = model.features(bparams, batch["input_ids"], batch["attention_mask"], train=False, **extra)
        hidden = hidden.astype(jnp.float32)  # SequenceHead casts to float32 first: cache what it sees
        if level == "pooled":
            v = jnp.stack([POOL_FUNCTIONS[r](hidden, pmask) for r in reductions], axis=1)
            return v, jnp.ones(v.shape[:2], jnp.int32)
        return hidden, pmask.astype(jnp.int32)
    return jax.jit(encode)


def _split_parts(split):
    ids = list(split.input_ids)
    tt = None if getattr(split, "token_type_ids", None) is None else list(split.token_type_ids)
    labels = getattr(split, "labels", None)
    return ids, tt, labels


def cache_features(model, backbone_params, split, *, batch_size: int = 32,
                   buckets: Sequence[int] = (32, 64, 128, 256, 512), level: str = "auto", dtype=np.float32,
                   max_bytes: int = 2 << 30, directory: str | os.PathLike | None = None,
                   labels: np.ndarray | None = None, progress: Callable[[int, int], None] | None = None,
                   reductions: Sequence[str] | None = None, encoder: Callable | None = None) -> FeatureCache:
    """Encode ``split`` (``.input_ids``: list of 1-D token arrays, optional ``.token_type_ids``,
    ``.labels``; e.g. ``flaxheads.data.Split``) once with ``model``'s backbone.

    ``level``: ``"auto"`` (pooled when the pooler allows, else token), ``"pooled"`` or ``"token"``.
    ``dtype``: storage dtype (float32 exact; float16 halves memory). Texts longer than the
    largest bucket are truncated to it, as the training batches would be. ``reductions``
    (pooled only): cache several reductions side by side (``[N, R, H]``, for head sweeps
    over poolers, see :mod:`flaxheads.training.sweep`); default: the pooler's own. ``encoder``: a
    :func:`make_encoder` result to reuse (its compiled buckets carry over between calls, e.g.
    train / validation / test splits); it must match ``level`` and ``reductions``."""
    from .data import bucket_length

    lvl = choose_level(model.head.pooler, level)
    if reductions is not None:
        if lvl != "pooled":
            raise ValueError("reductions= needs pooled features (a pooler with a fixed reduction)")
        bad = [r for r in reductions if r not in POOL_FUNCTIONS]
        if bad or not reductions:
            raise ValueError(f"unknown reductions {bad}; valid: {sorted(POOL_FUNCTIONS)}")
    reds = tuple(reductions or (reduction(model.head.pooler),)) if lvl == "pooled" else ()
    ids, tt, lab = _split_parts(split)
    labels = lab if labels is None else labels
    buckets = tuple(sorted(buckets))
    n, h = len(ids), model.hidden_size
    lengths = np.asarray([bucket_length(max(len(x), 1), buckets) for x in ids])
    itemsize = np.dtype(dtype).itemsize
    groups = {t: np.flatnonzero(lengths == t) for t in buckets if np.any(lengths == t)}
    need = sum(len(ix) * (len(reds) if lvl == "pooled" else t) * (h * itemsize + 4) for t, ix in groups.items())
    to_disk = need > max_bytes
    if to_disk and directory is None:
        raise ValueError(f"the {lvl} feature cache needs {need / 2**20:.0f} MiB > max_bytes={max_bytes / 2**20:.0f} "
                         "MiB: pass directory= to keep it on disk (memory-mapped), raise max_bytes, store "
                         "dtype=np.float16, or shorten the texts (smaller buckets).")
    if to_disk:
        os.makedirs(directory, exist_ok=True)
    enc = encoder or make_encoder(model, lvl, reds)
    pad = model.pad_token_id if model.pad_token_id is not None else 0
    out, done, t0 = [], 0, time.perf_counter()
    for t, index in groups.items():
        tc = len(reds) if lvl == "pooled" else t
        shape = (len(index), tc, h)
        if to_disk:
            hid = np.lib.format.open_memmap(os.path.join(directory, f"hidden_{t}.npy"), "w+", dtype, shape)
            msk = np.lib.format.open_memmap(os.path.join(directory, f"mask_{t}.npy"), "w+", np.int32, shape[:2])
        else:
            hid, msk = np.empty(shape, dtype), np.empty(shape[:2], np.int32)
        pending = None  # the previous batch's result: copied out after the next one is dispatched
        for s in range(0, len(index) + batch_size, batch_size):
            launched = None
            if s < len(index):
                rows = index[s:s + batch_size]
                launched = (s, len(rows), *enc(backbone_params, _pad_batch(ids, tt, rows, batch_size, t, pad)))
            if pending is not None:
                ps, k, f, m = pending
                hid[ps:ps + k] = np.asarray(f[:k]).astype(dtype)
                msk[ps:ps + k] = np.asarray(m[:k])
                done += k
                if progress:
                    progress(done, n)
            pending = launched
        if to_disk:
            hid.flush()
            msk.flush()
        out.append(Bucket(1 if lvl == "pooled" else t, index, hid, msk))
    if lvl == "pooled" and len(out) > 1:  # one bucket: batches need not respect the encode lengths
        out = [Bucket(1, np.concatenate([b.index for b in out]), np.concatenate([b.hidden for b in out]),
                      np.concatenate([b.mask for b in out]))]
    return FeatureCache(lvl, reds, h, out, None if labels is None else np.asarray(labels),
                        encode_seconds=time.perf_counter() - t0, directory=os.fspath(directory) if to_disk else None)


def _pad_batch(ids, tt, rows, batch_size: int, t: int, pad: int) -> dict:
    x = np.full((batch_size, t), pad, np.int32)
    m = np.zeros((batch_size, t), np.int32)
    m[:, 0] = 1
    ty = np.zeros((batch_size, t), np.int32) if tt is not None else None
    for r, i in enumerate(rows):
        s = np.asarray(ids[i][:t])
        x[r, :len(s)], m[r, :len(s)] = s, 1
        if ty is not None:
            ty[r, :len(s)] = np.asarray(tt[i][:t])
    out = {"input_ids": x, "attention_mask": m}
    if ty is not None:
        out["token_type_ids"] = ty
    return out


def predict_cached(model, head_params, cache: FeatureCache, batch_size: int = 256) -> np.ndarray:
    """Logits ``[n, N]`` for every cached example, in example order (inference mode)."""
    if len(cache.reductions) > 1:
        raise ValueError("this cache holds several reductions; predict with flaxheads.training.sweep on one of them")
    f = jax.jit(lambda hp, hdn, m: model.head_apply(hp, hdn, m, train=False))
    n = int(max(int(b.index.max()) for b in cache.buckets) + 1)
    out = None
    for b in cache.batches(batch_size, shuffle=False, labels=np.zeros((n,), np.int32)):
        logits = np.asarray(f(head_params, b["hidden"], b["pool_mask"]))
        if out is None:
            out = np.zeros((n, logits.shape[-1]), np.float32)
        keep = b["index"] >= 0
        out[b["index"][keep]] = logits[keep]
    return out
