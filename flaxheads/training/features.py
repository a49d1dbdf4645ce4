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

import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.data.batching import extra_inputs, token_batch
from flaxheads.errors import TrainingError
from flaxheads.heads.poolers import POOL_FUNCTIONS, POOL_POSITIONS
from flaxheads.runtime.plan import ComputePlan
from flaxheads.training.feature_cache import (
    Bucket,
    FeatureCache,
    _bucket_groups,
    _storage,
    choose_level,
    encode_groups,
    predict_cache,
    reduction,
)
from flaxheads.training.programs import constants_program, jit_count


class Encoder:
    """:func:`make_encoder`'s result: ``encoder(backbone_params, batch) -> (features, mask)``, jitted,
    with what its calls through :func:`cache_features` measured: the seconds of a batch at each
    ``(rows, length)`` it ran, and of its latest compile (the first call at a new shape).

    ``constants``: compile the parameters into the program as constants (one program per
    parameter tree and shape); None decides by the compute plan's ``constant_weights`` (float32
    with oneDNN's dots, whose products then take weights reordered once at compile time)."""

    def __init__(self, fn: Callable, plan: ComputePlan, constants: bool | None = None, dtype=jnp.float32):
        self._encode = fn
        self.plan = plan
        self.dtype = dtype  # the backbone's compute dtype, which constant_weights weighs
        self.fn = jax.jit(fn)
        self.constants = constants
        self._bound: tuple[object, Callable] | None = None  # (params, program with them as constants)
        self.batch_seconds: dict[tuple[int, int], float] = {}
        self.compile_seconds = 0.0

    def __call__(self, backbone_params, batch: dict):
        return self.jitted(backbone_params)(batch)

    def jitted(self, backbone_params) -> Callable[[dict], tuple[jax.Array, jax.Array]]:
        """The program ``batch -> (features, mask)`` for these parameters (with them as constants,
        or as its first argument)."""
        if self._bound is not None and self._bound[0] is backbone_params:
            return self._bound[1]
        fn = constants_program(self._encode, backbone_params, self.plan, self.dtype, force=self.constants)
        if fn is not None:
            self.batch_seconds.clear()  # new programs: none of the lengths run so far is compiled
        self._bound = (backbone_params, fn or functools.partial(self.fn, backbone_params))
        return self._bound[1]

    def programs(self) -> int:
        """How many programs this encoder has compiled (for its current constants, if any)."""
        return jit_count(self.fn) + (max(jit_count(self._bound[1]), 0) if self._bound else 0)

    def length_for(self, rows: int, length: int, batches: int) -> int:
        """The padded length to run ``batches`` batches of ``rows`` x ``length`` tokens at: the
        shortest longer length already run, where :func:`pad_to_longer` says padding costs less
        than another compile; else ``length`` itself."""
        if (rows, length) in self.batch_seconds:
            return length
        longer = sorted(t for r, t in self.batch_seconds if r == rows and t > length)
        if longer and pad_to_longer(
            batches, length, longer[0], self.batch_seconds[rows, longer[0]], self.compile_seconds
        ):
            return longer[0]
        return length

    def record(self, rows: int, length: int, batches: int, first: float, total: float) -> None:
        """Note ``batches`` batches run in ``total`` seconds, the first call taking ``first``."""
        if (rows, length) not in self.batch_seconds:
            self.compile_seconds = first
        self.batch_seconds[rows, length] = max(total - first, 0.0) / max(batches, 1)


def make_encoder(model, level: str, reductions: Sequence[str] = (), *, constants: bool | None = None) -> Encoder:
    """``encode(backbone_params, batch) -> (features, mask)``, jitted, inference mode.

    Pooled: features ``[B, R, H]``, one position per reduction (a head reads one of them as
    a one-token sequence); token: the hidden states and the pooling mask. ``constants``: see
    :class:`Encoder`."""
    one_token = (
        level == "pooled"
        and len(reductions) == 1
        and reductions[0] in POOL_POSITIONS
        and getattr(model, "pooled_token_only", False)
        and "only_at" in getattr(model.backbone, "features", ())
    )

    def encode(bparams, batch):
        if one_token:  # the last layer at the cached token alone (see SequenceModel.pooler_inputs)
            pmask = model.pooling_mask(batch["input_ids"], batch["attention_mask"])
            hidden, _ = model.features(
                bparams,
                batch["input_ids"],
                batch["attention_mask"],
                train=False,
                only_at=POOL_POSITIONS[reductions[0]](pmask),
                **extra_inputs(batch),
            )
            return hidden.astype(jnp.float32), jnp.ones(hidden.shape[:2], jnp.int32)
        hidden, pmask = model.features(
            bparams, batch["input_ids"], batch["attention_mask"], train=False, **extra_inputs(batch)
        )
        hidden = hidden.astype(jnp.float32)  # SequenceHead casts to float32 first: cache what it sees
        if level == "pooled":
            v = jnp.stack([POOL_FUNCTIONS[r](hidden, pmask) for r in reductions], axis=1)
            return v, jnp.ones(v.shape[:2], jnp.int32)
        return hidden, pmask.astype(jnp.int32)

    return Encoder(encode, model.plan, constants, getattr(model.backbone, "dtype", jnp.float32))


def _split_parts(split):
    ids = list(split.input_ids)
    tt = None if getattr(split, "token_type_ids", None) is None else list(split.token_type_ids)
    labels = getattr(split, "labels", None)
    return ids, tt, labels


def _reductions(model, lvl: str, reductions: Sequence[str] | None) -> tuple[str, ...]:
    """The reductions a cache at level ``lvl`` stores (none at token level)."""
    if reductions is not None:
        if lvl != "pooled":
            raise TrainingError("reductions= needs pooled features (a pooler with a fixed reduction)")
        bad = [r for r in reductions if r not in POOL_FUNCTIONS]
        if bad or not reductions:
            raise TrainingError(f"unknown reductions {bad}; valid: {sorted(POOL_FUNCTIONS)}")
    if lvl != "pooled":
        return ()
    if reductions:
        return tuple(reductions)
    fixed = reduction(model.head.pooler)
    assert fixed is not None, "choose_level gives pooled features only to a pooler with a fixed reduction"
    return (fixed,)


def pad_to_longer(batches: int, length: int, longer: int, batch_seconds: float, compile_seconds: float) -> bool:
    """Whether ``batches`` batches of ``length`` tokens should run in the program already compiled
    for ``longer`` tokens: when the padding would cost less than compiling another program.

    ``batch_seconds`` is a batch's time at ``longer`` and ``compile_seconds`` the encoder's latest
    compile, both measured (a program JAX's persistent cache held measures ~0, and then every
    length gets its own). Padding is costed in proportion to length (attention's quadratic part
    makes it a little dearer)."""
    return batches * batch_seconds * (1 - length / longer) < compile_seconds


def _encode_rows(
    enc,
    backbone_params,
    batches: Iterator[tuple[int, int, dict]],
    hid: np.ndarray,
    msk: np.ndarray,
    on_rows: Callable[[int], None],
) -> tuple[float, float]:
    """Encode ``(first row, row count, batch)`` items into ``hid``/``msk``; each result is copied
    out after the next batch is dispatched, so the host copy overlaps the device's work.
    Returns the seconds of the first dispatch (it traces and compiles a new shape) and of all."""
    pending, t0, first = None, time.perf_counter(), None
    for item in itertools.chain(batches, [None]):
        launched = None if item is None else (item[0], item[1], *enc(backbone_params, item[2]))
        if first is None:
            first = time.perf_counter() - t0
        if pending is not None:
            s, k, f, m = pending
            hid[s : s + k] = np.asarray(f[:k]).astype(hid.dtype)
            msk[s : s + k] = np.asarray(m[:k])
            on_rows(k)
        pending = launched
    assert first is not None, "the loop runs at least once (for the closing None)"
    return first, time.perf_counter() - t0


def cache_features(
    model,
    backbone_params,
    split,
    *,
    batch_size: int = 32,
    buckets: Sequence[int] = (32, 64, 128, 256, 512),
    level: str = "auto",
    dtype=np.float32,
    max_bytes: int = 2 << 30,
    directory: str | os.PathLike | None = None,
    labels: np.ndarray | None = None,
    progress: Callable[[int, int], None] | None = None,
    reductions: Sequence[str] | None = None,
    encoder: Callable | None = None,
) -> FeatureCache:
    """Encode ``split`` (``.input_ids``: list of 1-D token arrays, optional ``.token_type_ids``,
    ``.labels``; e.g. ``flaxheads.data.splits.Split``) once with ``model``'s backbone.

    ``level``: ``"auto"`` (pooled when the pooler allows, else token), ``"pooled"`` or ``"token"``.
    ``dtype``: storage dtype (float32 exact; float16 halves memory). Texts longer than the
    largest bucket are truncated to it, as the training batches would be. ``reductions``
    (pooled only): cache several reductions side by side (``[N, R, H]``, for head sweeps
    over poolers, see :mod:`flaxheads.training.sweep`); default: the pooler's own. ``encoder``: a
    :func:`make_encoder` result to reuse (its compiled buckets carry over between calls, e.g.
    train / validation / test splits); it must match ``level`` and ``reductions``."""
    lvl = choose_level(model.head.pooler, level)
    reds = _reductions(model, lvl, reductions)
    ids, tt, lab = _split_parts(split)
    labels = lab if labels is None else labels
    buckets = tuple(sorted(buckets))
    # pooled features keep no length, so leftover texts can share a longer bucket's batch; token-level
    # ones are stored, and trained on every head epoch, at their group's length
    groups = (encode_groups if lvl == "pooled" else _bucket_groups)([len(x) for x in ids], batch_size, buckets)
    alloc, to_disk = _storage(groups, lvl, len(reds), model.hidden_size, dtype, max_bytes, directory)
    enc = encoder or make_encoder(model, lvl, reds)
    pad = model.pad_token_id if model.pad_token_id is not None else 0
    out, done, t0 = [], 0, time.perf_counter()

    def on_rows(k: int) -> None:
        nonlocal done
        done += k
        if progress:
            progress(done, len(ids))

    measured = enc if isinstance(enc, Encoder) else None  # a plain jitted function may be passed too
    for t in sorted(groups, reverse=True):  # longest first: shorter groups may run in its program
        index = groups[t]
        hid, msk = alloc(t, len(index))
        n_batches = -(-len(index) // batch_size)
        # pooled features keep no length, so a short group's few batches may run padded further
        run_at = measured.length_for(batch_size, t, n_batches) if lvl == "pooled" and measured is not None else t
        rows = (index[s : s + batch_size] for s in range(0, len(index), batch_size))
        batches = (
            (s * batch_size, len(r), token_batch(ids, tt, r, batch_size, run_at, pad)) for s, r in enumerate(rows)
        )
        first, total = _encode_rows(enc, backbone_params, batches, hid, msk, on_rows)
        if measured is not None:
            measured.record(batch_size, run_at, n_batches, first, total)
        if to_disk:
            hid.flush()
            msk.flush()
        out.append(Bucket(1 if lvl == "pooled" else t, index, hid, msk))
    out.reverse()  # shortest first, as the groups are numbered
    if lvl == "pooled" and len(out) > 1:  # one bucket: batches need not respect the encode lengths
        out = [
            Bucket(
                1,
                np.concatenate([b.index for b in out]),
                np.concatenate([b.hidden for b in out]),
                np.concatenate([b.mask for b in out]),
            )
        ]
    return FeatureCache(
        lvl,
        reds,
        model.hidden_size,
        out,
        None if labels is None else np.asarray(labels),
        encode_seconds=time.perf_counter() - t0,
        directory=os.fspath(directory) if to_disk and directory is not None else None,
    )


def predict_cached(model, head_params, cache: FeatureCache, batch_size: int = 256) -> np.ndarray:
    """Logits ``[n, N]`` for every cached example, in example order (inference mode)."""
    if len(cache.reductions) > 1:
        raise TrainingError(
            "this cache holds several reductions; predict with flaxheads.training.sweep on one of "
            "them (sweep.predict_all), or build a cache with the pooler's own reduction only"
        )
    f = jax.jit(lambda hp, hdn, m: model.head_apply(hp, hdn, m, train=False))
    return predict_cache(lambda b: f(head_params, b["hidden"], b["pool_mask"]), cache, batch_size)
