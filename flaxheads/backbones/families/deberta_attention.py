"""DeBERTa-v2's disentangled relative attention and the settings it reads (:class:`Settings`); the
layers, embeddings, forward and :class:`~flaxheads.backbones.families.deberta.DebertaV2Backbone` are in
:mod:`flaxheads.backbones.families.deberta`.

How: a relative distance depends only on ``i - j``, so for a sequence length ``T`` the table
rows each diagonal of the ``[T, T]`` scores reads are numpy constants, built once per shape at
trace time and shared by every layer (:func:`diagonal_rows`). A layer projects those ``2T - 1``
rows, multiplies them with q (c2p) and k (p2c), and
:func:`~flaxheads.layers.positions.diagonals_to_keys` turns the ``[.., T, 2T-1]`` per-diagonal
scores into ``[.., T, T]`` with a reshape and a slice: no gather, and no scatter in the backward pass.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flaxheads.layers.dense import matmul
from flaxheads.layers.dropout import dropout
from flaxheads.layers.positions import diagonals_to_keys, log_bucket
from flaxheads.runtime.plan import ComputePlan


def pos_att_types(value) -> tuple[str, ...]:
    """``pos_att_type`` as DebertaV2Config reads it: None -> (), ``"p2c|c2p"`` -> ``("p2c", "c2p")``."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(x.strip() for x in value.lower().split("|"))
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`~flaxheads.backbones.families.deberta.encode` needs from the config besides the params
    (HF's getattr defaults included)."""

    num_layers: int
    num_heads: int
    eps: float
    act: str  # HF's name (``hidden_act``); looked up with the compute plan's barrier where applied
    hidden_dropout: float
    attn_dropout: float
    pos_dropout: float  # on the relative table in each layer (HF: hidden_dropout_prob)
    conv_dropout: float  # on the convolution's output (HF: hidden_dropout_prob)
    scale: float  # 1 / sqrt(head_dim * scale_factor)
    relative: bool
    c2p: bool
    p2c: bool
    share_att_key: bool
    buckets: int  # position_buckets; <= 0: plain clipped distances
    max_relative: int
    norm_rel: bool
    conv_kernel: int  # 0: no convolution
    conv_groups: int
    conv_act: str | None  # HF's name (``conv_act``), None without a convolution; looked up as ``act``
    position_biased_input: bool
    type_vocab_size: int
    pad_token_id: int | None
    max_positions: int

    @property
    def span(self) -> int:
        """Half the relative embedding table: distances index it at ``distance + span``."""
        return self.buckets if self.buckets > 0 else self.max_relative

    @classmethod
    def from_config(cls, c) -> Settings:
        types = pos_att_types(c.get("pos_att_type"))
        heads = int(c.num_attention_heads)
        factor = 1 + ("c2p" in types) + ("p2c" in types)
        max_rel = int(c.get("max_relative_positions", -1))
        norm = [x.strip() for x in str(c.get("norm_rel_ebd", "none")).lower().split("|")]
        conv = int(c.get("conv_kernel_size", 0) or 0)
        return cls(
            num_layers=int(c.num_hidden_layers),
            num_heads=heads,
            eps=float(c.layer_norm_eps),
            act=c.hidden_act,
            hidden_dropout=float(c.hidden_dropout_prob or 0.0),
            attn_dropout=float(c.attention_probs_dropout_prob or 0.0),
            pos_dropout=float(c.hidden_dropout_prob or 0.0),
            conv_dropout=float(c.hidden_dropout_prob or 0.0),
            scale=1.0 / math.sqrt(int(c.hidden_size) // heads * factor),
            relative=bool(c.get("relative_attention", False)),
            c2p="c2p" in types,
            p2c="p2c" in types,
            share_att_key=bool(c.get("share_att_key", False)),
            buckets=int(c.get("position_buckets", -1)),
            max_relative=max_rel if max_rel >= 1 else int(c.max_position_embeddings),
            norm_rel="layer_norm" in norm,
            conv_kernel=max(conv, 0),
            conv_groups=int(c.get("conv_groups", 1)),
            conv_act=c.get("conv_act", "tanh") if conv > 0 else None,
            position_biased_input=bool(c.get("position_biased_input", True)),
            type_vocab_size=int(c.type_vocab_size or 0),
            pad_token_id=c.get("pad_token_id"),
            max_positions=int(c.max_position_embeddings),
        )


# ---- relative positions ---------------------------------------------------------------------------------
def diagonal_rows(t: int, s: Settings) -> tuple[np.ndarray, np.ndarray]:
    """The relative-embedding rows c2p and p2c read on each diagonal ``n = j - i + t - 1`` of the
    ``[t, t]`` scores (query ``i``, key ``j``): ``(c2p_rows, p2c_rows)``, ``2t - 1`` indices each.

    c2p scores query ``i`` against the row of distance ``i - j``; p2c scores key ``j`` against the
    row of the negated distance, both clipped to the table (HF's ``c2p_pos`` / ``p2c_pos``)."""
    m = (t - 1) - np.arange(2 * t - 1)  # i - j on diagonal n
    rel = log_bucket(m, s.buckets, s.max_relative) if s.buckets > 0 else m
    top = 2 * s.span - 1
    return np.clip(rel + s.span, 0, top), np.clip(s.span - rel, 0, top)


# ---- layers ---------------------------------------------------------------------------------------------
def _project_rows(
    rel: jax.Array, rows: np.ndarray, p: dict, num_heads: int, scale: float = 1.0, keep_bias_gradient: bool = True
) -> jax.Array:
    """The projection ``p`` (times ``scale``) of the relative-embedding ``rows``: ``[len(rows), nh, d]``."""
    bias = p["bias"] if keep_bias_gradient else lax.stop_gradient(p["bias"])
    out = jnp.take(rel, rows, axis=0) @ (p["kernel"] * scale).astype(rel.dtype) + (bias * scale).astype(rel.dtype)
    return out.reshape(len(rows), num_heads, -1)


def disentangled_attention(
    p: dict,
    x: jax.Array,
    keep: jax.Array,
    rel: jax.Array | None,
    rows,
    s: Settings,
    *,
    batch: int,
    rng: jax.Array | None,
    plan: ComputePlan,
    at: jax.Array | None = None,
) -> jax.Array:
    """Attention context ``[B*T, H]`` of ``x [B*T, H]`` before the output projection; ``keep [B, 1, T, T]``
    the pairs that may attend, ``rel [2*span, H]`` the (normalised) relative table, ``rows`` :func:`diagonal_rows`.
    ``at [B]``: the context of that one query position per sequence alone, ``[B, H]`` (keys and
    values from every position; each relative score read at its query's own diagonal offset).

    The score scale is folded into q (and into the p2c position queries). The key bias adds
    ``q_i . b_k`` to a whole row of content and c2p scores, which softmax cancels: its gradient there is
    exactly 0 (autodiff gives rounding noise, which Adam turns into steps), so it only flows through
    p2c, where ``k_j . pos_q`` varies with the key. The c2p projection bias cancels the same way."""
    sa = p["attention"]["self"]
    q_p, k_p, v_p = sa["query_proj"], sa["key_proj"], sa["value_proj"]
    bt, h = x.shape
    t, nh = bt // batch, s.num_heads
    d = h // nh
    w = jnp.concatenate([q_p["kernel"] * s.scale, k_p["kernel"], v_p["kernel"]], axis=1)
    b = jnp.concatenate([q_p["bias"] * s.scale, lax.stop_gradient(k_p["bias"]), v_p["bias"]])
    if at is None:
        qkv = (matmul(x, w, plan) + b.astype(x.dtype)).reshape(batch, t, 3, nh, d)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        kv = (matmul(x, w[:, h:], plan) + b[h:].astype(x.dtype)).reshape(batch, t, 2, nh, d)
        k, v = kv[:, :, 0], kv[:, :, 1]
        q = (matmul(rows_at(x, at, t), w[:, :h], plan) + b[:h].astype(x.dtype)).reshape(batch, 1, nh, d)
        keep = jnp.take_along_axis(keep, at.reshape(batch, 1, 1, 1), axis=2)
        # relative-table index of (query at, key j) on c2p's and p2c's diagonals, as in diagonals_to_keys
        c2p_at = jnp.arange(t)[None, :] - at[:, None] + (t - 1)
        p2c_at = at[:, None] - jnp.arange(t)[None, :] + (t - 1)
    r_pos, r_attn = jax.random.split(rng) if rng is not None else (None, None)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    if rel is not None:
        rel = dropout(rel, s.pos_dropout, r_pos)
        c2p_rows, p2c_rows = rows
        if s.c2p:
            pk = _project_rows(
                rel, c2p_rows, k_p if s.share_att_key else sa["pos_key_proj"], nh, keep_bias_gradient=False
            )
            c2p = jnp.einsum("bqhd,nhd->bhqn", q, pk)
            c2p = diagonals_to_keys(c2p) if at is None else jnp.take_along_axis(c2p, c2p_at[:, None, None, :], -1)
            scores = scores + c2p
        if s.p2c:
            pq = _project_rows(rel, p2c_rows, q_p if s.share_att_key else sa["pos_query_proj"], nh, s.scale)
            bk = k_p["bias"]
            k = k + (bk - lax.stop_gradient(bk)).astype(k.dtype).reshape(nh, d)  # adds 0; the bias gradient
            if at is None:
                p2c = jnp.swapaxes(diagonals_to_keys(jnp.einsum("bkhd,nhd->bhkn", k, pq)), -1, -2)
            else:
                p2c = jnp.einsum("bkhd,bkhd->bhk", k, jnp.take(pq, p2c_at, axis=0))[:, :, None, :]
            scores = scores + p2c
    scores = jnp.where(keep, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)  # float32 softmax, any dtype
    probs = dropout(jax.nn.softmax(scores, axis=-1), s.attn_dropout, r_attn).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(-1, h)


def rows_at(x: jax.Array, at: jax.Array, t: int) -> jax.Array:
    """Row ``at[b]`` of each sequence of the flattened ``x [B*T, H]``: ``[B, H]``."""
    return x[at + jnp.arange(at.shape[0], dtype=at.dtype) * t]
