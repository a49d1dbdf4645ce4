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
import functools
import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.data.batching import bucket_length, extra_inputs, pad_mask, pad_rows, predict_batches, token_batch
from flaxheads.data.splits import labelled_rows
from flaxheads.errors import TrainingError
from flaxheads.heads.poolers import POOL_FUNCTIONS, POOL_POSITIONS, DensePooler, Pool
from flaxheads.runtime.plan import ComputePlan
from flaxheads.training.programs import constants_program, jit_count

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


def predict_cached(model, head_params, cache: FeatureCache, batch_size: int = 256) -> np.ndarray:
    """Logits ``[n, N]`` for every cached example, in example order (inference mode)."""
    if len(cache.reductions) > 1:
        raise TrainingError(
            "this cache holds several reductions; predict with flaxheads.training.sweep on one of "
            "them (sweep.predict_all), or build a cache with the pooler's own reduction only"
        )
    f = jax.jit(lambda hp, hdn, m: model.head_apply(hp, hdn, m, train=False))
    return predict_cache(lambda b: f(head_params, b["hidden"], b["pool_mask"]), cache, batch_size)
