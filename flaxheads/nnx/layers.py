"""Every pooler and head as an ``nnx.Module``, built from its config (the plain dataclass of
:mod:`flaxheads.heads.poolers` / :mod:`flaxheads.heads.heads` that ``to_json`` writes), as the Linen
modules of :mod:`flaxheads.heads.linen` are.

Parameter names and shapes are the Linen ones (``dense``, ``summary``, ``query``, ``parts_0``,
``classifier``, ``dense_0``, ``norm_0``, ``out_proj``), so :func:`head_params` of an NNX head is
a ``params["head"]`` subtree the functional path applies as is, and :func:`load_head_params`
puts such a subtree into an NNX head. The computations are the Linen ones (shared functions
of :mod:`flaxheads.heads.poolers`, ``nnx.Linear``/``nnx.LayerNorm``, which compute as
``nn.Dense``/``nn.LayerNorm``): the same params give the same outputs, bit for bit in float32.

Dropout draws its masks from the module's ``nnx.Rngs`` (``dropout`` stream), not from the
functional path's explicit key: with dropout active the two paths draw different masks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from flaxheads.errors import ConfigError
from flaxheads.heads import heads as H
from flaxheads.heads import poolers as P
from flaxheads.heads.linen import l2_normalise as _l2_normalise
from flaxheads.layers.activations import head_activation


def _linear(n_in: int, n_out: int, std: float, rngs: nnx.Rngs, use_bias: bool = True) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, use_bias=use_bias, kernel_init=jax.nn.initializers.normal(std), rngs=rngs)


class _Configured(nnx.Module):
    """Holds its config (a frozen, hashable dataclass: static in ``nnx.split``)."""

    config: Any  # the pooler's or head's config class, which each subclass sets

    def out_features(self, *args) -> int:
        return self.config.out_features(*args)

    def steps(self, *args) -> list[str]:
        return self.config.steps(*args)


class Pool(_Configured):
    """A parameter-free pooler (``mean``, ``cls``, ``last``, ...)."""

    def __init__(self, config: P.Pool, hidden_size: int, *, rngs: nnx.Rngs):
        del hidden_size, rngs
        self.config = config

    def position(self, mask: jax.Array) -> jax.Array | None:
        return self.config.position(mask)

    def __call__(self, hidden, mask, deterministic: bool = True):
        return P.POOL_FUNCTIONS[self.config.mode](hidden, mask)


class AttentionPool(_Configured):
    """Learned attention pooling; ``query`` starts at zero (the masked mean)."""

    def __init__(self, config: P.AttentionPool, hidden_size: int, *, rngs: nnx.Rngs):
        del rngs
        self.config = config
        self.query = nnx.Param(jnp.zeros((hidden_size,), jnp.float32))

    def position(self, mask):
        return None

    def __call__(self, hidden, mask, deterministic: bool = True):
        return P.attention_pool(hidden, mask, self.query[...])


class DensePooler(_Configured):
    """Token pick -> dropout -> ``dense`` -> activation (BERT / ALBERT / DeBERTa poolers)."""

    def __init__(self, config: P.DensePooler, hidden_size: int, *, rngs: nnx.Rngs):
        self.config = config
        self.drop = nnx.Dropout(config.dropout, rngs=rngs)
        self.dense = _linear(hidden_size, config.out_features(hidden_size), config.init_std, rngs)

    def position(self, mask):
        return self.config.position(mask)

    def __call__(self, hidden, mask, deterministic: bool = True):
        x = P.POOL_FUNCTIONS[self.config.source](hidden, mask)
        x = self.dense(self.drop(x, deterministic=deterministic))
        return head_activation(self.config.activation)(x)


class LateDensePooler(_Configured):
    """``dense`` -> activation on every token, then pool (EuroBERT's late pooling)."""

    def __init__(self, config: P.LateDensePooler, hidden_size: int, *, rngs: nnx.Rngs):
        self.config = config
        self.dense = _linear(hidden_size, config.out_features(hidden_size), config.init_std, rngs)

    def position(self, mask):
        return self.config.position(mask)

    def __call__(self, hidden, mask, deterministic: bool = True):
        x = head_activation(self.config.activation)(self.dense(hidden))
        return P.POOL_FUNCTIONS[self.config.pool](x, mask)


class SequenceSummary(_Configured):
    """XLNet's sequence summary (``summary`` projection), HF's quirks included."""

    def __init__(self, config: P.SequenceSummary, hidden_size: int, *, rngs: nnx.Rngs):
        self.config = config
        self.first_drop = nnx.Dropout(config.first_dropout, rngs=rngs)
        self.last_drop = nnx.Dropout(config.last_dropout, rngs=rngs)
        if config.use_proj:
            self.summary = _linear(hidden_size, config.out_features(hidden_size), config.init_std, rngs)

    def position(self, mask):
        return self.config.position(mask)

    def __call__(self, hidden, mask, deterministic: bool = True, cls_index: jax.Array | None = None):
        x = self.first_drop(P.summary_token(hidden, self.config.summary_type, cls_index), deterministic=deterministic)
        if self.config.use_proj:
            x = self.summary(x)
        x = head_activation(self.config.activation)(x)
        return self.last_drop(x, deterministic=deterministic)


class Concat(_Configured):
    """Several poolers' outputs concatenated; the parts are ``parts_0``, ``parts_1``, ... as in Linen."""

    def __init__(self, config: P.Concat, hidden_size: int, *, rngs: nnx.Rngs):
        self.config = config
        for i, part in enumerate(config.parts):
            setattr(self, f"parts_{i}", pooler(part, hidden_size, rngs=rngs))

    def position(self, mask):
        return None

    def __call__(self, hidden, mask, deterministic: bool = True):
        parts = [getattr(self, f"parts_{i}") for i in range(len(self.config.parts))]
        return jnp.concatenate([p(hidden, mask, deterministic) for p in parts], axis=-1)


class LinearHead(_Configured):
    """dropout -> ``classifier``."""

    def __init__(self, config: H.LinearHead, in_features: int, *, rngs: nnx.Rngs):
        self.config = config
        self.drop = nnx.Dropout(config.dropout, rngs=rngs)
        self.classifier = _linear(in_features, config.num_labels, config.init_std, rngs, config.use_bias)

    def __call__(self, x, deterministic: bool = True):
        return self.classifier(self.drop(x, deterministic=deterministic))


class MLPHead(_Configured):
    """input dropout -> [``dense_i`` -> act -> (``norm_i``) -> dropout] x depth -> ``out_proj``."""

    def __init__(self, config: H.MLPHead, in_features: int, *, rngs: nnx.Rngs):
        self.config = config
        self.input_drop = nnx.Dropout(config.input_dropout, rngs=rngs)
        self.drop = nnx.Dropout(config.dropout, rngs=rngs)
        w = in_features
        for i, d in enumerate(config.hidden_dims):
            setattr(self, f"dense_{i}", _linear(w, d or w, config.init_std, rngs, config.dense_bias))
            w = d or w
            if config.layer_norm:
                setattr(
                    self, f"norm_{i}", nnx.LayerNorm(w, epsilon=config.norm_eps, use_bias=config.norm_bias, rngs=rngs)
                )
        self.out_proj = _linear(w, config.num_labels, config.init_std, rngs, config.out_bias)

    def __call__(self, x, deterministic: bool = True):
        act = head_activation(self.config.activation)
        x = self.input_drop(x, deterministic=deterministic)
        for i in range(len(self.config.hidden_dims)):
            x = act(getattr(self, f"dense_{i}")(x))
            if self.config.layer_norm:
                x = getattr(self, f"norm_{i}")(x)
            x = self.drop(x, deterministic=deterministic)
        return self.out_proj(x)


class ProjectionHead(_Configured):
    """dropout -> [``dense_i`` -> act] per width -> optional L2 normalisation."""

    def __init__(self, config: H.ProjectionHead, in_features: int, *, rngs: nnx.Rngs):
        self.config = config
        self.drop = nnx.Dropout(config.dropout, rngs=rngs)
        w = in_features
        for i, d in enumerate(config.widths):
            setattr(self, f"dense_{i}", _linear(w, d, config.init_std, rngs, config.use_bias))
            w = d

    def __call__(self, x, deterministic: bool = True):
        act = head_activation(self.config.activation)
        x = self.drop(x, deterministic=deterministic)
        for i in range(len(self.config.widths)):
            x = act(getattr(self, f"dense_{i}")(x))
        return _l2_normalise(x) if self.config.normalize else x


class IdentityHead(_Configured):
    """The pooled vector itself, optionally L2-normalised."""

    def __init__(self, config: H.IdentityHead, in_features: int, *, rngs: nnx.Rngs):
        del in_features, rngs
        self.config = config

    def __call__(self, x, deterministic: bool = True):
        return _l2_normalise(x) if self.config.normalize else x


class SequenceHead(nnx.Module):
    """``pooler`` then ``head`` on hidden states ``[B, T, hidden_size]`` (cast to float32 first).

    ``config`` is a :class:`flaxheads.SequenceHead` (e.g. ``model.head``, ``flaxheads.config.from_json(...)``);
    ``params`` (a functional ``params["head"]`` subtree) replaces the fresh initialisation."""

    def __init__(
        self, config: H.SequenceHead, hidden_size: int, *, rngs: nnx.Rngs | None = None, params: dict | None = None
    ):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.config = config
        self.pooler = pooler(config.pooler, hidden_size, rngs=rngs)
        self.head = head(config.head, config.pooler.out_features(hidden_size), rngs=rngs)
        if params is not None:
            load_head_params(self, params)

    def __call__(self, hidden, mask, deterministic: bool = True):
        hidden = hidden.astype(jnp.float32)
        return self.head(self.pooler(hidden, mask, deterministic), deterministic)


_POOLERS = {
    P.Pool: Pool,
    P.AttentionPool: AttentionPool,
    P.DensePooler: DensePooler,
    P.LateDensePooler: LateDensePooler,
    P.SequenceSummary: SequenceSummary,
    P.Concat: Concat,
}
_HEADS = {
    H.LinearHead: LinearHead,
    H.MLPHead: MLPHead,
    H.ProjectionHead: ProjectionHead,
    H.IdentityHead: IdentityHead,
    H.TokenLogits: LinearHead,
}


def _nnx_form(forms: dict, what: str, config, width: int, rngs: nnx.Rngs) -> nnx.Module:
    cls = forms.get(type(config))
    if cls is None:
        raise ConfigError(
            f"no NNX form of {what} {type(config).__name__}; NNX {what}s: {sorted(c.__name__ for c in forms)}"
        )
    return cls(config, width, rngs=rngs)


def pooler(config: P.Pooler, hidden_size: int, *, rngs: nnx.Rngs) -> nnx.Module:
    """The NNX form of a pooler config (``fh.make_pooler(...)``) on hidden states of width ``hidden_size``."""
    return _nnx_form(_POOLERS, "pooler", config, hidden_size, rngs)


def head(config: H.Head, in_features: int, *, rngs: nnx.Rngs) -> nnx.Module:
    """The NNX form of a head config (``fh.make_head(...)``, a preset's head) on vectors of ``in_features``."""
    return _nnx_form(_HEADS, "head", config, in_features, rngs)


def _drop_empty(tree: dict) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            v = _drop_empty(v)
            if not v:
                continue  # Linen leaves a module without params out of the tree
        out[k] = v
    return out


def head_params(module: nnx.Module) -> dict:
    """The functional params tree of an NNX pooler, head or :class:`SequenceHead` (arrays, Linen's names)."""
    return _drop_empty(nnx.state(module, nnx.Param).to_pure_dict())


def load_head_params(module: nnx.Module, params: dict) -> None:
    """Set an NNX pooler / head / :class:`SequenceHead`'s params from a functional tree of the same
    names and shapes (e.g. ``params["head"]``, a :class:`~flaxheads.HeadCheckpoint`'s ``params``)."""
    state = nnx.state(module, nnx.Param)
    want = jax.tree.map(jnp.shape, _drop_empty(state.to_pure_dict()))
    got = jax.tree.map(jnp.shape, _drop_empty(dict(params)))
    if want != got:
        raise ConfigError(f"head params do not fit this NNX head: it has {want}, the params have {got}")
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, dict(params)))
    nnx.update(module, state)
