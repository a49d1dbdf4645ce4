"""Poolers: functions of (hidden states [B, T, H], mask [B, T]) -> vector [B, H'].

The parameter-free poolers are plain functions (``mean``, ``max``, ...). Every pooler's
*config* is a plain frozen dataclass here (:class:`Pool`, :class:`DensePooler`, ...): the one
place of its fields, defaults and validation, its JSON form (``flaxheads.config``) and what it
computes in words and widths (``steps``, ``out_features``, ``position``). Modules are built
from a config: the Linen form in :mod:`flaxheads.heads.linen` (the functional path), the NNX
form in :mod:`flaxheads.nnx.layers`. Make a config from a name (or a list of names to
concatenate) with :func:`make_pooler`.

Masks may be bool, int or float; a row that is all padding never produces NaN
(mean/max/weighted give zeros, token pickers give position 0).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp

from flaxheads.config import register
from flaxheads.errors import ConfigError
from flaxheads.layers.activations import get_activation

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
else:  # typing_extensions: a dependency of flax
    from typing_extensions import dataclass_transform

_C = TypeVar("_C")

_EPS = 1e-9  # sentence-transformers clamps token counts to this


def _mask3(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    return mask.astype(hidden.dtype)[..., None]


def _gather(hidden: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(hidden, idx[:, None, None].astype(jnp.int32), axis=1)[:, 0]


def first_token(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Position 0 ([CLS] / <s>), whatever the mask says (BERT/RoBERTa/ELECTRA rule)."""
    del mask
    return hidden[:, 0]


def first_index(mask: jax.Array) -> jax.Array:
    """Position 0 of every row, as ``[B]`` indices (what :func:`first_token` reads)."""
    return jnp.zeros(mask.shape[:1], jnp.int32)


def first_non_pad_index(mask: jax.Array) -> jax.Array:
    """Index of the leftmost set position; 0 for an all-padding row."""
    return jnp.argmax(mask.astype(bool), axis=1)


def first_non_pad(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """First position whose mask is set (the [CLS] of a left-padded batch)."""
    return _gather(hidden, first_non_pad_index(mask))


def last_non_pad_index(mask: jax.Array) -> jax.Array:
    """Index of the rightmost set position; 0 for an all-padding row (as HF GPT-2 and ST)."""
    m = mask.astype(bool)
    t = m.shape[1]
    return jnp.argmax(jnp.where(m, jnp.arange(t)[None, :], -1), axis=1) * jnp.any(m, axis=1)


def last_non_pad(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Rightmost position whose mask is set: correct under left and right padding.

    With ``mask = input_ids != pad_token_id`` this is GPT-2's rule; with
    ``mask = input_ids == eos_token_id`` it is BART's (last <eos>)."""
    return _gather(hidden, last_non_pad_index(mask))


def masked_sum_count(hidden: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    m = _mask3(hidden, mask)
    return jnp.sum(hidden * m, axis=1), jnp.sum(m, axis=1)


def mean(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean over unmasked positions (sentence-transformers ``mean``)."""
    s, n = masked_sum_count(hidden, mask)
    return s / jnp.maximum(n, _EPS)


def max(hidden: jax.Array, mask: jax.Array) -> jax.Array:  # noqa: A001 - the pooler's name
    """Max over unmasked positions; an all-padding row gives zeros (ST would give -1e9)."""
    m = mask.astype(bool)[..., None]
    out = jnp.max(jnp.where(m, hidden, jnp.finfo(hidden.dtype).min), axis=1)
    return jnp.where(jnp.any(m, axis=1), out, 0.0).astype(hidden.dtype)


def mean_sqrt_len(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum over unmasked positions divided by sqrt(length) (ST ``mean_sqrt_len_tokens``)."""
    s, n = masked_sum_count(hidden, mask)
    return s / jnp.sqrt(jnp.maximum(n, _EPS))


def weighted_mean(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean weighted by position 1, 2, ... counted from the first kept token (ST ``weightedmean``;
    later tokens count more).

    As in sentence-transformers 6: left and right padding of the same text give the same
    result (sentence-transformers 5 counted absolute positions, so left padding differed)."""
    t = hidden.shape[1]
    first = jnp.argmax(mask > 0, axis=1).astype(hidden.dtype)
    w = mask.astype(hidden.dtype) * (jnp.arange(1, t + 1, dtype=hidden.dtype)[None, :] - first[:, None])
    s, n = masked_sum_count(hidden, w)
    return s / jnp.maximum(n, _EPS)


POOL_FUNCTIONS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "cls": first_token,
    "first_non_pad": first_non_pad,
    "last": last_non_pad,
    "mean": mean,
    "max": max,
    "mean_sqrt_len": mean_sqrt_len,
    "weighted_mean": weighted_mean,
}
#: The one-token modes of ``POOL_FUNCTIONS``: the index ``[B]`` of the token each reads. Such a
#: pooler, given that token's hidden state as a one-token sequence (mask of ones), returns the
#: same vector, so a backbone can compute its last layer at that token alone (``only_at``).
POOL_POSITIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "cls": first_index,
    "first_non_pad": first_non_pad_index,
    "last": last_non_pad_index,
}
_POOL_TEXT = {
    "cls": "first token ([CLS])",
    "first_non_pad": "first non-pad token",
    "last": "last non-pad token",
    "mean": "masked mean",
    "max": "masked max",
    "mean_sqrt_len": "masked sum / sqrt(len)",
    "weighted_mean": "position-weighted masked mean",
}


def attention_pool(hidden: jax.Array, mask: jax.Array, query: jax.Array) -> jax.Array:
    """Masked softmax of ``hidden . query / sqrt(H)`` over the tokens, then the weighted sum
    (:class:`AttentionPool`'s computation, shared by its Linen and NNX modules)."""
    h = hidden.shape[-1]
    scores = jnp.einsum("bth,h->bt", hidden, query.astype(hidden.dtype)) / jnp.sqrt(h).astype(hidden.dtype)
    m = mask.astype(bool)
    scores = jnp.where(m, scores, jnp.finfo(scores.dtype).min)
    w = jax.nn.softmax(scores, axis=-1) * m  # an all-padding row sums to 0, not NaN
    w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), _EPS)
    return jnp.einsum("bt,bth->bh", w, hidden)


def _check_choice(what: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"unknown {what} {value!r}; valid values: {sorted(valid)}")


@dataclass_transform(frozen_default=True)  # type checkers see the fields as __init__'s arguments
def config_class(cls: type[_C]) -> type[_C]:
    """A config class: a frozen, hashable dataclass (static data: a jit static argument, an NNX static field)."""
    return dataclasses.dataclass(frozen=True)(cls)


@config_class
class Pooler:
    """Base of the pooler configs; a module built from one maps ``(hidden [B, T, H], mask [B, T]) -> [B, H']``."""

    def out_features(self, hidden_size: int) -> int:
        return hidden_size

    def steps(self, hidden_size: int) -> list[str]:
        raise NotImplementedError

    def position(self, mask: jax.Array) -> jax.Array | None:
        """The one token ``[B]`` this pooler reads per sequence, or None when it reads more.

        Called on the pooling mask ``[B, T]``. A pooler that returns indices gives the same output
        on those tokens' hidden states alone, as a ``[B, 1, H]`` sequence with a mask of ones."""
        del mask
        return None


@register("pool")
@config_class
class Pool(Pooler):
    """A parameter-free pooler: one of ``POOL_FUNCTIONS``."""

    mode: str = "mean"

    def __post_init__(self):
        _check_choice("pooling mode", self.mode, POOL_FUNCTIONS)

    def position(self, mask):
        at = POOL_POSITIONS.get(self.mode)
        return None if at is None else at(mask)

    def steps(self, hidden_size):
        return [f"{_POOL_TEXT[self.mode]} [B,T,{hidden_size}] -> [B,{hidden_size}]"]


@register("attention")
@config_class
class AttentionPool(Pooler):
    """Learned attention pooling: a query vector (``query`` [H]) scores each token, masked softmax,
    weighted sum. The query starts at zero, so an untrained pooler is exactly the masked mean."""

    def steps(self, hidden_size):
        return [
            f"attention pooling: softmax(h . query / sqrt({hidden_size})) over unmasked tokens, "
            f"weighted sum [B,T,{hidden_size}] -> [B,{hidden_size}]"
        ]


@register("dense")
@config_class
class DensePooler(Pooler):
    """Pick a token (``source``), dropout, dense (``dense``), activation.

    BERT/ALBERT pooler: source=cls, activation=tanh, dropout=0.
    DeBERTa-v2 ContextPooler: source=cls, dropout=pooler_dropout, activation=pooler_hidden_act."""

    features: int | None = None  # None: same width as the hidden states
    activation: str | None = "tanh"
    dropout: float = 0.0
    source: str = "cls"
    init_std: float = 0.02

    def __post_init__(self):
        _check_choice("dense pooler source", self.source, POOL_FUNCTIONS)
        get_activation(self.activation)

    def out_features(self, hidden_size):
        return self.features or hidden_size

    def position(self, mask):
        at = POOL_POSITIONS.get(self.source)
        return None if at is None else at(mask)

    def steps(self, hidden_size):
        o = self.out_features(hidden_size)
        s = [f"{_POOL_TEXT[self.source]} [B,T,{hidden_size}] -> [B,{hidden_size}]"]
        if self.dropout:
            s.append(f"dropout({self.dropout})")
        s.append(f"dense {hidden_size}->{o}")
        if self.activation:
            s.append(self.activation)
        return s


@register("late_dense")
@config_class
class LateDensePooler(Pooler):
    """Dense (``dense``) and activation on every token, then pool (``pool``): EuroBERT's "late"
    pooling. With a linear head after it this is PyTorch's mean of the per-token logits."""

    features: int | None = None  # None: same width as the hidden states
    activation: str | None = "gelu"
    pool: str = "mean"
    init_std: float = 0.02

    def __post_init__(self):
        _check_choice("late dense pooler pool", self.pool, POOL_FUNCTIONS)
        get_activation(self.activation)

    def out_features(self, hidden_size):
        return self.features or hidden_size

    def position(self, mask):  # a per-token dense commutes with picking one token
        at = POOL_POSITIONS.get(self.pool)
        return None if at is None else at(mask)

    def steps(self, hidden_size):
        o = self.out_features(hidden_size)
        return (
            [f"dense {hidden_size}->{o} on every token"]
            + ([self.activation] if self.activation else [])
            + [f"{_POOL_TEXT[self.pool]} [B,T,{o}] -> [B,{o}]"]
        )


SUMMARY_TYPES = ("last", "first", "mean", "cls_index")


def summary_token(hidden: jax.Array, summary_type: str, cls_index: jax.Array | None = None) -> jax.Array:
    """The vector :class:`SequenceSummary` summarises, before its projection (HF's choice, mask ignored)."""
    if summary_type == "last":
        return hidden[:, -1]
    if summary_type == "first":
        return hidden[:, 0]
    if summary_type == "mean":
        return jnp.mean(hidden, axis=1)
    idx = jnp.full(hidden.shape[:1], hidden.shape[1] - 1) if cls_index is None else cls_index
    return _gather(hidden, idx)


@register("sequence_summary")
@config_class
class SequenceSummary(Pooler):
    """XLNet's sequence summary (projection ``summary``), exactly as Hugging Face computes it.

    HF quirks kept for parity: ``last``/``first``/``mean``/``cls_index`` ignore the mask
    (``mean`` averages padding too; ``last`` is position -1, right for XLNet's left
    padding only); ``cls_index`` without indices is the last position. ``attn`` is not
    implemented in HF either. For a masked summary use ``mean`` or ``last`` poolers."""

    summary_type: str = "last"
    use_proj: bool = True
    proj_to_labels: bool = False
    num_labels: int = 0
    activation: str | None = "tanh"
    first_dropout: float = 0.0
    last_dropout: float = 0.1
    init_std: float = 0.02

    def __post_init__(self):
        if self.summary_type == "attn":
            raise ConfigError(
                "summary_type='attn' is not implemented (nor in Hugging Face); "
                f"use one of {SUMMARY_TYPES} or the 'attention' pooler"
            )
        _check_choice("summary_type", self.summary_type, SUMMARY_TYPES)
        get_activation(self.activation)

    def position(self, mask):
        if self.summary_type == "first":
            return first_index(mask)
        if self.summary_type == "last":  # position -1 whatever the mask says, as HF
            return jnp.full(mask.shape[:1], mask.shape[1] - 1, jnp.int32)
        return None  # mean reads every token; cls_index comes with the call

    def out_features(self, hidden_size):
        if self.use_proj and self.proj_to_labels and self.num_labels > 0:
            return self.num_labels
        return hidden_size

    def steps(self, hidden_size):
        pick = {
            "last": "position -1 (unmasked)",
            "first": "position 0",
            "mean": "unmasked mean over all T",
            "cls_index": "token at cls_index (default: position -1)",
        }[self.summary_type]
        s = [f"sequence summary: {pick} [B,T,{hidden_size}] -> [B,{hidden_size}]"]
        if self.first_dropout > 0:
            s.append(f"dropout({self.first_dropout})")
        if self.use_proj:
            s.append(f"dense {hidden_size}->{self.out_features(hidden_size)}")
        if self.activation:
            s.append(self.activation)
        if self.last_dropout > 0:
            s.append(f"dropout({self.last_dropout})")
        return s


@register("concat")
@config_class
class Concat(Pooler):
    """Concatenation of several poolers' outputs, in the order given (modules ``parts_0``, ``parts_1``, ...)."""

    parts: tuple[Pooler, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "parts", tuple(self.parts))  # a list would make the config unhashable
        if not self.parts:
            raise ConfigError("Concat needs at least one pooler in `parts`")
        for p in self.parts:
            if not isinstance(p, Pooler):
                raise ConfigError(f"Concat parts must be pooler configs (fh.make_pooler(...)), got {p!r}")

    def out_features(self, hidden_size):
        return sum(p.out_features(hidden_size) for p in self.parts)

    def steps(self, hidden_size):
        inner = "; ".join(" -> ".join(p.steps(hidden_size)) for p in self.parts)
        return [f"concat[{inner}] -> [B,{self.out_features(hidden_size)}]"]


def _dense(**kw) -> DensePooler:
    return DensePooler(**kw)


# Names accepted by make_pooler. Parametric names take keyword options.
POOLER_NAMES: dict[str, Callable[..., Pooler]] = {
    **{name: (lambda name=name: Pool(name)) for name in POOL_FUNCTIONS},
    "attention": AttentionPool,
    "bert": lambda **kw: _dense(**{"activation": "tanh", **kw}),
    "albert": lambda **kw: _dense(**{"activation": "tanh", **kw}),
    "deberta": lambda **kw: _dense(**{"activation": "gelu", **kw}),
    "dense": DensePooler,
    "late": LateDensePooler,
    "xlnet": SequenceSummary,
    "sequence_summary": SequenceSummary,
}


def make_pooler(spec: str | Sequence[str] | Pooler, **options) -> Pooler:
    """A pooler config from a name, a list of names (concatenated) or a pooler config.

    ``options`` go to the parametric pooler (``bert``, ``deberta``, ``xlnet``, ``dense``)."""
    if isinstance(spec, Pooler):
        if options:
            raise ConfigError(f"pooler options {sorted(options)} given with an already-made pooler {spec!r}")
        return spec
    if isinstance(spec, str):
        if spec not in POOLER_NAMES:
            raise ConfigError(
                f"unknown pooler {spec!r}; valid poolers: {sorted(POOLER_NAMES)} (or a list of them to concatenate)"
            )
        try:
            return POOLER_NAMES[spec](**options)
        except TypeError as e:
            raise ConfigError(f"pooler {spec!r} does not take options {sorted(options)}: {e}") from None
    if isinstance(spec, Sequence) and len(spec) > 0:
        if len(spec) == 1:
            return make_pooler(spec[0], **options)
        return Concat(tuple(make_pooler(s) for s in spec))
    raise ConfigError(f"pooler must be a name, a non-empty list of names or a Pooler; got {spec!r}")
