"""The Linen modules of the pooler and head configs: the functional path's form.

Each class is built from its config (``Pool(config)``, ...; :func:`module` picks the class) and
reads every setting from it; input widths are inferred when the module is first applied.
Parameter names: ``dense``, ``summary``, ``query``, ``parts_i``, ``classifier``, ``dense_i``,
``norm_i``, ``out_proj``; a :class:`SequenceHead`'s params are ``{"pooler": ..., "head": ...}``
(``pooler`` absent when it has none). :mod:`flaxheads.nnx.layers` holds the NNX forms of the
same configs, with the same names: one params tree serves both.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxheads.errors import ConfigError
from flaxheads.heads import heads as H
from flaxheads.heads import poolers as P
from flaxheads.layers.activations import head_activation


def _dense(features: int, std: float, name: str, use_bias: bool = True) -> nn.Dense:
    return nn.Dense(features, use_bias=use_bias, kernel_init=nn.initializers.normal(std), name=name)


def l2_normalise(x: jax.Array) -> jax.Array:
    """As ``torch.nn.functional.normalize``: ``x / max(||x||, 1e-12)`` over the last axis."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class Pool(nn.Module):
    config: P.Pool

    def __call__(self, hidden, mask, deterministic: bool = True):
        return P.POOL_FUNCTIONS[self.config.mode](hidden, mask)


class AttentionPool(nn.Module):
    config: P.AttentionPool

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        q = self.param("query", nn.initializers.zeros_init(), (hidden.shape[-1],), jnp.float32)
        return P.attention_pool(hidden, mask, q)


class DensePooler(nn.Module):
    config: P.DensePooler

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        c = self.config
        x = P.POOL_FUNCTIONS[c.source](hidden, mask)
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        x = _dense(c.out_features(hidden.shape[-1]), c.init_std, "dense")(x)
        return head_activation(c.activation)(x)


class LateDensePooler(nn.Module):
    config: P.LateDensePooler

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        c = self.config
        x = head_activation(c.activation)(_dense(c.out_features(hidden.shape[-1]), c.init_std, "dense")(hidden))
        return P.POOL_FUNCTIONS[c.pool](x, mask)


class SequenceSummary(nn.Module):
    config: P.SequenceSummary

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True, cls_index: jax.Array | None = None):
        c = self.config
        x = P.summary_token(hidden, c.summary_type, cls_index)
        if c.first_dropout > 0:
            x = nn.Dropout(c.first_dropout)(x, deterministic=deterministic)
        if c.use_proj:
            x = _dense(c.out_features(hidden.shape[-1]), c.init_std, "summary")(x)
        x = head_activation(c.activation)(x)
        if c.last_dropout > 0:
            x = nn.Dropout(c.last_dropout)(x, deterministic=deterministic)
        return x


class Concat(nn.Module):
    config: P.Concat

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        parts = [module(p, name=f"parts_{i}") for i, p in enumerate(self.config.parts)]
        return jnp.concatenate([p(hidden, mask, deterministic) for p in parts], axis=-1)


class LinearHead(nn.Module):
    config: H.LinearHead

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        c = self.config
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        return _dense(c.num_labels, c.init_std, "classifier", c.use_bias)(x)


class MLPHead(nn.Module):
    config: H.MLPHead

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        c = self.config
        act = head_activation(c.activation)
        x = nn.Dropout(c.input_dropout)(x, deterministic=deterministic)
        for i, d in enumerate(c.hidden_dims):
            x = act(_dense(d or x.shape[-1], c.init_std, f"dense_{i}", c.dense_bias)(x))
            if c.layer_norm:
                x = nn.LayerNorm(epsilon=c.norm_eps, use_bias=c.norm_bias, name=f"norm_{i}")(x)
            x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        return _dense(c.num_labels, c.init_std, "out_proj", c.out_bias)(x)


class ProjectionHead(nn.Module):
    config: H.ProjectionHead

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        c = self.config
        act = head_activation(c.activation)
        x = nn.Dropout(c.dropout)(x, deterministic=deterministic)
        for i, d in enumerate(c.widths):
            x = act(_dense(d, c.init_std, f"dense_{i}", c.use_bias)(x))
        return l2_normalise(x) if c.normalize else x


class IdentityHead(nn.Module):
    config: H.IdentityHead

    def __call__(self, x, deterministic: bool = True):
        return l2_normalise(x) if self.config.normalize else x


class SequenceHead(nn.Module):
    """``pooler`` then ``head`` on hidden states ``[B, T, H]``, cast to float32 first."""

    config: H.SequenceHead

    @nn.compact
    def __call__(self, hidden, mask, deterministic: bool = True):
        hidden = hidden.astype(jnp.float32)
        x = module(self.config.pooler, name="pooler")(hidden, mask, deterministic)
        return module(self.config.head, name="head")(x, deterministic)


FORMS: dict[type, type[nn.Module]] = {
    P.Pool: Pool,
    P.AttentionPool: AttentionPool,
    P.DensePooler: DensePooler,
    P.LateDensePooler: LateDensePooler,
    P.SequenceSummary: SequenceSummary,
    P.Concat: Concat,
    H.LinearHead: LinearHead,
    H.MLPHead: MLPHead,
    H.ProjectionHead: ProjectionHead,
    H.IdentityHead: IdentityHead,
    H.SequenceHead: SequenceHead,
    H.TokenLogits: LinearHead,
}  # a TokenLogits head is a linear ``classifier`` whose kernel from_pretrained fills


def module(config: P.Pooler | H.Head | H.SequenceHead, name: str | None = None) -> nn.Module:
    """The Linen module of a pooler, head or :class:`~flaxheads.SequenceHead` config."""
    cls = FORMS.get(type(config))
    if cls is None:
        raise ConfigError(
            f"no Linen module for {config!r}: expected a pooler or head config "
            f"({', '.join(sorted(c.__name__ for c in FORMS))})"
        )
    return cls(config, name=name)


def init_head(config: H.SequenceHead, hidden_size: int, rng: jax.Array | None = None) -> dict:
    """Fresh params of a :class:`~flaxheads.SequenceHead` on hidden states of width ``hidden_size``
    (``{}`` when it has none); ``jax.eval_shape(lambda: init_head(...))`` gives just the shapes."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    variables = module(config).init(rng, jnp.zeros((1, 1, hidden_size), jnp.float32), jnp.ones((1, 1), jnp.int32))
    return dict(variables.get("params", {}))
