"""A whole flaxheads model as an ``nnx.Module``: :class:`NNXSequenceModel`.

It holds the functional model's params as NNX variables under the same paths as the params
tree (``backbone``, ``head/pooler``, ``head/head``, ``lora``) and runs the backbone's own
``encode`` on them, then the NNX :class:`~flaxheads.nnx.layers.SequenceHead`. So
``nnx.state(model, nnx.Param)`` is the trainable part of the params tree, :meth:`params`
is the whole tree, and a model goes back to the functional path with :meth:`to_functional`
(checkpoints, exports, prediction).

Variable types say what trains: the head is ``nnx.Param``; LoRA adapters are :class:`LoraParam`
(an ``nnx.Param``); the backbone is :class:`FrozenBase` (not a Param: ``nnx.grad`` and
``nnx.Optimizer(model, tx, wrt=nnx.Param)`` leave it alone) when frozen, else ``nnx.Param``.
Every variable carries its logical axis names (``out_sharding``, from the backbone family's
rule) for :func:`shardings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from flaxheads.errors import ConfigError
from flaxheads.layers.lora import LORA
from flaxheads.nnx.layers import SequenceHead, head_params, load_head_params
from flaxheads.runtime.sharding import DEFAULT_RULES, Layout, model_param_axes


class FrozenBase(nnx.Variable):
    """A backbone weight that does not train (not an ``nnx.Param``)."""


class LoraParam(nnx.Param):
    """A LoRA adapter matrix (``lora_A`` / ``lora_B``); trains with the head."""


class _Static:
    """The functional model (without its arrays) as a static attribute: hashed by identity."""

    def __init__(self, model):
        self.model = model


def _variables(tree: Mapping, kind: type, axes: Mapping[tuple[str, ...], Any], prefix: tuple[str, ...]) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out[k] = _variables(v, kind, axes, prefix + (k,))
        else:
            names = axes.get(prefix + (k,))
            meta = {"out_sharding": tuple(names), "eager_sharding": False} if names is not None else {}
            out[k] = kind(jnp.asarray(v), **meta)
    return out


def _values(tree) -> dict:
    return jax.tree.map(lambda v: v[...], tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


class NNXSequenceModel(nnx.Module):
    """A :class:`~flaxheads.SequenceModel` as an ``nnx.Module`` (build it with ``model.to_nnx()``).

    ``model(input_ids, attention_mask, train=False, **extra)`` gives the functional model's
    logits for the same params. With ``train=True`` dropout draws from ``rngs`` (stream
    ``dropout``); a frozen backbone without adapters runs in inference mode, as
    ``make_train_step(freeze_backbone=True)`` runs it."""

    def __init__(
        self, model, params: Mapping | None = None, *, freeze_backbone: bool | None = None, rngs: nnx.Rngs | None = None
    ):
        params = model.params if params is None else params
        has_lora = getattr(model, "lora", None) is not None
        if has_lora and LORA not in params:
            raise ConfigError("this model has LoRA adapters but the params have no 'lora' subtree")
        self.frozen = bool(has_lora if freeze_backbone is None else freeze_backbone)
        if has_lora and not self.frozen:
            raise ConfigError(
                "a model with LoRA adapters trains the adapters on a frozen base: leave "
                "freeze_backbone unset (or True), or merge the adapters first (fh.lora.merge_model)"
            )
        self.rngs = nnx.Rngs(0) if rngs is None else rngs
        axes = model_param_axes(dataclasses.replace(model, params=dict(params)))
        self.backbone = nnx.data(
            _variables(params["backbone"], FrozenBase if self.frozen else nnx.Param, axes, ("backbone",))
        )
        self.lora = nnx.data(_variables(params[LORA], LoraParam, axes, (LORA,)) if has_lora else None)
        self.head = SequenceHead(model.head, model.hidden_size, rngs=self.rngs)
        load_head_params(self.head, params["head"])
        for path, var in jax.tree_util.tree_leaves_with_path(
            nnx.state(self.head, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)
        ):
            names = axes.get(("head",) + tuple(str(getattr(k, "key", k)) for k in path))
            if names is not None:  # logical names: placed by shardings(), never eagerly (no mesh needed)
                var.set_metadata("out_sharding", tuple(names))
                var.set_metadata("eager_sharding", False)
        self.spec = _Static(dataclasses.replace(model, params={}))

    @property
    def functional(self):
        """The functional :class:`~flaxheads.SequenceModel` this was built from (its ``params`` left out)."""
        return self.spec.model

    def params(self) -> dict:
        """The functional params tree: ``{"backbone", "head"[, "lora"]}`` with the current values."""
        out = {"backbone": _values(self.backbone), "head": head_params(self.head)}
        if self.lora is not None:
            out[LORA] = _values(self.lora)
        return out

    def load_params(self, params: Mapping) -> None:
        """Set every variable from a functional params tree of the same structure."""
        for name in ("backbone", LORA):
            mine = getattr(self, name)
            if mine is None:
                continue
            # mypy cannot resolve jaxlib's PyTreeDef (an alias of a compiled class), so not its comparison
            if jax.tree.structure(_values(mine)) != jax.tree.structure(dict(params[name])):  # type: ignore[operator]
                raise ConfigError(f"params[{name!r}] does not have this model's structure")
            jax.tree.map(
                lambda v, x: v.set_value(jnp.asarray(x)),
                mine,
                dict(params[name]),
                is_leaf=lambda v: isinstance(v, nnx.Variable),
            )
        load_head_params(self.head, params["head"])

    def to_functional(self):
        """The functional :class:`~flaxheads.SequenceModel` with this model's current params
        (for ``save_head``, ``RunCheckpointer``, ``export_*``, ``Classifier``)."""
        return dataclasses.replace(self.functional, params=self.params())

    def __call__(self, input_ids, attention_mask=None, *, train: bool = False, **extra) -> jax.Array:
        fm = self.functional
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        tree = {"backbone": _values(self.backbone)}
        if self.lora is not None:
            tree[LORA] = _values(self.lora)
        backbone_train = train and not (self.frozen and self.lora is None)
        key = self.rngs.dropout() if backbone_train else None
        hidden, mask = fm.pooler_inputs(
            fm.backbone_params(tree), input_ids, attention_mask, train=backbone_train, dropout_rng=key, **extra
        )
        if self.frozen and self.lora is None:
            hidden = jax.lax.stop_gradient(hidden)  # nothing in the backbone trains: no backward through it
        return self.head(hidden, mask, deterministic=not train)


def to_nnx(
    model, params: Mapping | None = None, *, freeze_backbone: bool | None = None, rngs: nnx.Rngs | None = None
) -> NNXSequenceModel:
    """``model`` (a :class:`~flaxheads.SequenceModel`) as an :class:`NNXSequenceModel` on ``params``
    (default ``model.params``). ``freeze_backbone``: the backbone as :class:`FrozenBase` (default:
    frozen when the model has LoRA adapters, else trainable)."""
    return NNXSequenceModel(model, params, freeze_backbone=freeze_backbone, rngs=rngs)


def shardings(model: NNXSequenceModel, mesh: Mesh, rules: Mapping[str, Any] | None = None):
    """NamedShardings of ``nnx.state(model)`` on ``mesh``: each variable's logical axes through
    ``rules`` (default :data:`flaxheads.runtime.sharding.DEFAULT_RULES`), as :class:`flaxheads.runtime.sharding.Layout`
    places the functional params; everything else (rng state) replicated."""
    layout = Layout.for_model(mesh, model.to_functional(), dict(DEFAULT_RULES if rules is None else rules))
    state = nnx.state(model)

    def place(path, x):  # the state's paths are the params tree's (rng state: no match, replicated)
        names = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        return jax.sharding.NamedSharding(mesh, layout.spec_of(names, tuple(jnp.shape(x))))

    return jax.tree_util.tree_map_with_path(place, state)
