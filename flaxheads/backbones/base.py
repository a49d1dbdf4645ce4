"""The backbone contract: what every encoder family provides to the rest of flaxheads.

A backbone family is one module with one :class:`Backbone` subclass. The subclass

* names the Hugging Face ``model_type`` values it serves (:attr:`Backbone.model_types`) and
  the PyTorch prefix of its base model inside ``XForSequenceClassification`` state dicts
  (:attr:`Backbone.base_model_prefix`);
* reads ``config.json`` into a read-only :class:`HFConfig`, filling the keys the file may
  omit with the defaults of transformers' config class (:attr:`Backbone.defaults`) and
  refusing settings it does not compute (:meth:`Backbone.check_config`);
* turns a PyTorch state dict (base-model names, prefix stripped) into its params tree
  (:meth:`Backbone.params_from_state`) and back (:meth:`Backbone.state_from_params`);
  these two are the only place its PyTorch names live: import and export both use them;
* encodes: :meth:`Backbone.encode` ``(params, input_ids, attention_mask, *, train, rng, **extra)``
  returns the last hidden state ``[B, T, H]``; a pure function of ``params``;
* says what it supports (:attr:`Backbone.features`: ``"token_type_ids"``, ``"remat"``,
  ``"bf16"``, ``"causal"``, ...);
* carries every other per-family fact the rest of flaxheads asks for, so that no other module
  keeps a table keyed by ``model_type``: the classifier dropout key of its PyTorch
  ``XForSequenceClassification`` config (:attr:`Backbone.classifier_dropout_key`), the default
  LoRA targets (:attr:`Backbone.lora_targets`), ``[out, in]`` kernels
  (:attr:`Backbone.kernels_out_in`), whether HF's tokenizer gives token types
  (:attr:`Backbone.tokenizer_token_types`). Other modules find the family of a ``model_type``
  with :func:`flaxheads.backbones.registry.family_for`.

The object also keeps the HF Flax calling convention (``backbone(input_ids, attention_mask,
params=..., dropout_rng=..., train=...)[0]``) so code written against HF's wrappers works.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.weights import pick, torch_from_tree, tree_from_torch
from flaxheads.errors import ConfigError, FlaxheadsError
from flaxheads.layers.activations import get_activation
from flaxheads.layers.remat import remat_policy
from flaxheads.runtime.axes import Axes, generic_param_axes
from flaxheads.runtime.plan import ComputePlan


class BackboneError(FlaxheadsError):
    """A model folder or config that no backbone can load as asked."""


class BackboneNotFoundError(BackboneError, FileNotFoundError):
    """A model folder that does not exist (a :class:`BackboneError`, and still a ``FileNotFoundError``)."""


class MissingConfigKey(AttributeError):
    """A key an ``HFConfig`` does not have (an ``AttributeError``, so ``getattr(cfg, k, default)``
    works); loading turns one a backbone needs into :class:`BackboneError` (:func:`missing_key_error`)."""

    def __init__(self, key: str, source: str | None):
        self.key, self.source = key, source
        super().__init__(f"config has no {key!r}")


def missing_key_error(e: MissingConfigKey, model_type: Any) -> BackboneError:
    """The error for a ``config.json`` without a key its ``model_type`` needs."""
    where = e.source or "config.json"
    return BackboneError(
        f"{where} has no {e.key!r}, which a {model_type} model needs: the file was cut or edited; "
        f"download config.json again, or add the key {e.key!r} with the model's value"
    )


class HFConfig(Mapping[str, Any]):
    """A Hugging Face ``config.json``, read-only, with attribute access.

    ``cfg.hidden_size`` reads the key; a key that is absent raises ``AttributeError``
    (:class:`MissingConfigKey`), so ``getattr(cfg, "x", default)`` works as on transformers'
    config objects. ``source``: the file it was read from (named in errors)."""

    __slots__ = ("_d", "_source")

    def __init__(self, values: Mapping[str, Any], source: str | None = None):
        object.__setattr__(self, "_d", dict(values))
        object.__setattr__(self, "_source", source)

    @classmethod
    def from_folder(cls, path: str | os.PathLike) -> HFConfig:
        f = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(f):
            raise BackboneError(
                f"{os.fspath(path)!r} has no config.json: expected a Hugging Face model folder "
                "(config.json + model.safetensors or pytorch_model.bin)"
            )
        try:
            with open(f, encoding="utf-8") as fh:
                values = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BackboneError(
                f"{f}: not valid JSON ({e}); the file was cut or damaged: download config.json again"
            ) from None
        if not isinstance(values, dict):
            raise BackboneError(
                f"{f}: expected a JSON object of model settings, got a {type(values).__name__}; "
                "download config.json again"
            )
        return cls(values, source=f)

    def __getattr__(self, name: str) -> Any:
        d = object.__getattribute__(self, "_d")
        if name in d:
            return d[name]
        if name.startswith("__"):
            raise AttributeError(name)
        raise MissingConfigKey(name, object.__getattribute__(self, "_source"))

    def __setattr__(self, name, value):
        raise AttributeError("HFConfig is read-only: build a new one with cfg.replace(key=value)")

    def __getitem__(self, k: str) -> Any:
        return self._d[k]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self) == dict(other)

    def __hash__(self):
        return hash(json.dumps(self._d, sort_keys=True, default=str))

    def replace(self, **changes) -> HFConfig:
        return HFConfig({**self._d, **changes}, source=self._source)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(self._d))

    def __repr__(self) -> str:
        return f"HFConfig(model_type={self._d.get('model_type')!r}, hidden_size={self._d.get('hidden_size')!r})"


class SettingsClass(Protocol):
    """What a family's :attr:`Backbone.settings_class` is: a class built from the config."""

    @classmethod
    def from_config(cls, config: HFConfig, /) -> Any: ...


class Backbone:
    """Base class of every backbone family (see the module docstring for the contract).

    Instances hold ``config`` (:class:`HFConfig`), ``params`` (the initial params tree),
    ``dtype`` (the compute dtype of activations; params stay float32), ``remat`` (whether layers are
    recomputed in the backward pass) and ``remat_policy`` (how: ``none | full | save-dots | save-named``), ``settings``
    (``settings_class.from_config(config)``, None for a family without a :attr:`settings_class`)."""

    model_types: ClassVar[tuple[str, ...]] = ()
    #: the family's name in error messages (``"BERT"``, ``"GPT-2"``, ...)
    family: ClassVar[str] = ""
    #: the PyTorch ``base_model_prefix`` of the family's ``XForSequenceClassification`` (stripped on
    #: import, written on export)
    base_model_prefix: ClassVar[str] = ""
    defaults: ClassVar[Mapping[str, Any]] = {}
    features: ClassVar[frozenset[str]] = frozenset()
    #: keyword inputs :meth:`encode` accepts besides input_ids and attention_mask
    extra_inputs: ClassVar[tuple[str, ...]] = ()
    #: the params tree's top-level modules, which are also the first part of the PyTorch names
    #: (with them the default :meth:`params_from_state` / :meth:`state_from_params` apply)
    top_level: ClassVar[tuple[str, ...]] = ()
    #: what :meth:`encode` reads from the config besides the params: a dataclass with
    #: ``from_config(config)``, built once into ``self.settings`` (None: the family builds its own)
    settings_class: ClassVar[type[SettingsClass] | None] = None
    #: ``settings_class.from_config(config)`` (None without a settings class); a family declares its own type
    settings: Any
    #: the config key the PyTorch ``XForSequenceClassification`` reads its classifier dropout from
    #: (None: its head has none, e.g. GPT-2's ``score``); a transformers export writes it
    classifier_dropout_key: ClassVar[str | None] = None
    #: default LoRA targets: the module names of the attention query and value projections (PEFT's
    #: defaults where it has them); empty: no defaults, the user names the targets
    lora_targets: ClassVar[tuple[str, ...]] = ()
    #: the params tree stores its 2-D kernels ``[out, in]`` (GPT-2's ``Conv1D``) instead of Flax's
    #: ``[in, out]``: LoRA's fan in/out, PEFT's ``fan_in_fan_out`` and :meth:`param_axes` follow from it
    kernels_out_in: ClassVar[bool] = False
    #: whether HF's tokenizer of this family returns ``token_type_ids`` (read for a tokenizer folder
    #: that names neither its ``model_input_names`` nor its ``tokenizer_class``)
    tokenizer_token_types: ClassVar[bool] = True

    def __init__(
        self,
        config: Mapping[str, Any],
        params: dict,
        dtype: Any = jnp.float32,
        remat: bool | str = False,
        plan: ComputePlan | None = None,
    ):
        cfg = config if isinstance(config, HFConfig) else HFConfig(config)
        self.config = self.complete_config(cfg)
        self.check_config(self.config)
        self.params = params
        self.dtype = dtype
        try:
            #: what the backward pass keeps of each layer (:mod:`flaxheads.layers.remat`)
            self.remat_policy = remat_policy(remat)
        except ConfigError as e:
            raise BackboneError(str(e)) from None
        if self.remat_policy != "none" and "remat" not in self.features:
            raise BackboneError(f"{type(self).__name__} has no gradient checkpointing (remat); load without it")
        self.remat = self.remat_policy != "none"
        #: how this backbone's programs compute on the host (the layers read it while tracing)
        self.plan = plan if plan is not None else ComputePlan.for_host()
        self.settings = None if self.settings_class is None else self.settings_class.from_config(self.config)

    # ---- config -------------------------------------------------------------------------------
    @classmethod
    def complete_config(cls, config: HFConfig) -> HFConfig:
        """``config`` with transformers' class defaults for the keys it omits."""
        missing = {k: v for k, v in cls.defaults.items() if k not in config}
        return config.replace(**missing) if missing else config

    @classmethod
    def check_config(cls, config: HFConfig) -> None:
        """Raise :class:`BackboneError` for settings this family does not compute. The base refuses a
        ``model_type`` outside :attr:`model_types`; a family adds its own refusals after
        ``super().check_config(config)``."""
        mt = config.get("model_type")
        if mt not in cls.model_types:
            raise BackboneError(
                f"flaxheads' {cls.family or cls.__name__} backbone serves model_type {cls.model_types}, not {mt!r}"
            )

    # ---- weights ------------------------------------------------------------------------------
    @classmethod
    def params_from_state(cls, config: HFConfig, state: Mapping[str, np.ndarray]) -> dict:
        """The params tree from a base-model PyTorch state dict (no ``base_model_prefix``).

        Default: every weight under a :attr:`top_level` module that is not a buffer
        (:meth:`is_buffer`), through the generic PyTorch -> Flax name map."""
        if not cls.top_level:
            raise NotImplementedError(f"{cls.__name__} names no top_level modules")
        return tree_from_torch(pick(state, lambda k: k.partition(".")[0] in cls.top_level and not cls.is_buffer(k)))

    @classmethod
    def is_buffer(cls, name: str) -> bool:
        """Whether the PyTorch state-dict entry ``name`` is a buffer (not a weight) the params leave out."""
        return False

    @classmethod
    def init_params(cls, config: HFConfig, rng: jax.Array) -> dict:
        """Freshly initialised params (HF's initialiser: normal(initializer_range) weights,
        zero biases, unit norm scales); under ``jax.eval_shape`` it gives every param's shape."""
        raise NotImplementedError

    def state_from_params(self, params: Mapping) -> dict[str, np.ndarray]:
        """PyTorch base-model names (no prefix) and arrays for ``params``; inverse of :meth:`params_from_state`."""
        if not self.top_level:
            raise NotImplementedError(f"{type(self).__name__} names no top_level modules")
        return torch_from_tree({k: params[k] for k in self.top_level if k in params})

    @classmethod
    def from_state(
        cls,
        config: Mapping[str, Any],
        state: Mapping[str, np.ndarray],
        *,
        dtype: Any = jnp.float32,
        remat: bool | str = False,
        source: str = "checkpoint",
        plan: ComputePlan | None = None,
    ) -> Backbone:
        """Build from a full PyTorch state dict: the base-model prefix is stripped, every
        weight the family needs must be present (a folder of another architecture fails here)."""
        cfg = cls.complete_config(config if isinstance(config, HFConfig) else HFConfig(config))
        cls.check_config(cfg)
        base = strip_prefix(state, cls.base_model_prefix)
        try:
            params = cls.params_from_state(cfg, base)
        except KeyError as e:
            raise BackboneError(
                f"{source}: the checkpoint has no weight {e.args[0]!r} that a "
                f"{cfg.get('model_type')} backbone needs. Is this folder a "
                f"{cfg.get('model_type')} checkpoint?"
            ) from None
        check_params(cls.param_shapes(cfg), params, source=source, model_type=cfg.get("model_type"))
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
        return cls(cfg, params, dtype=dtype, remat=remat, plan=plan)

    @classmethod
    def param_shapes(cls, config: HFConfig) -> dict:
        """The params tree's shapes (``jax.ShapeDtypeStruct`` leaves), computed without allocating it."""
        return jax.eval_shape(lambda: cls.init_params(config, jax.random.PRNGKey(0)))

    @classmethod
    def param_axes(cls, path: tuple[str, ...], shape: tuple[int, ...]) -> Axes:
        """Logical axis names (``embed``, ``heads``, ``kv``, ``mlp``, ``vocab`` or None) of each
        dimension of the param at ``path`` in this family's tree; used to shard it over a device
        mesh. The default is the generic rule of :mod:`flaxheads.runtime.axes`, reversed on the
        ``[out, in]`` kernels of a family with :attr:`kernels_out_in`; a family whose tree departs
        further from the Flax conventions overrides this, and only this."""
        axes = generic_param_axes(path, shape)
        return axes[::-1] if cls.kernels_out_in and path and path[-1] == "kernel" else axes

    # ---- compute ------------------------------------------------------------------------------
    def encode(
        self,
        params: Mapping,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        *,
        train: bool = False,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        """Last hidden state ``[B, T, H]`` in ``self.dtype``; a pure function of ``params``. A family
        takes its :attr:`extra_inputs` as more keyword arguments, each defaulting to None."""
        raise NotImplementedError

    def __call__(
        self,
        input_ids,
        attention_mask=None,
        *inputs,
        params: Mapping | None = None,
        dropout_rng: jax.Array | None = None,
        train: bool = False,
        **extra,
    ) -> tuple[jax.Array]:
        """HF Flax calling convention: ``(last_hidden_state,)``; positional inputs after the
        mask are :attr:`extra_inputs` in order (BERT: token types, then position ids)."""
        if len(inputs) > len(self.extra_inputs):
            raise TypeError(f"{type(self).__name__} takes at most {2 + len(self.extra_inputs)} positional inputs")
        extra.update(zip(self.extra_inputs, inputs))
        extra = {k: v for k, v in extra.items() if v is not None and k != "return_dict"}
        bad = sorted(set(extra) - set(self.extra_inputs))
        if bad:
            raise TypeError(f"{type(self).__name__} takes {list(self.extra_inputs) or 'no'} extra inputs, not {bad}")
        if attention_mask is None:
            attention_mask = jnp.ones_like(jnp.asarray(input_ids))
        if train and dropout_rng is None:
            raise ValueError("train=True needs a dropout_rng (dropout is active in training)")
        return (
            self.encode(
                self.params if params is None else params,
                jnp.asarray(input_ids),
                jnp.asarray(attention_mask),
                train=train,
                rng=dropout_rng,
                **extra,
            ),
        )

    # ---- facts --------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def model_type(self) -> str:
        return str(self.config.model_type)

    def __repr__(self) -> str:
        c = self.config
        return (
            f"{type(self).__name__}(model_type={c.get('model_type')!r}, hidden={c.get('hidden_size')}, "
            f"dtype={jnp.dtype(self.dtype).name})"
        )


def activation_problem(name: Any) -> str:
    """Why flaxheads cannot compute the config's activation ``name`` ("" when it can)."""
    try:
        get_activation(name)
    except ValueError as e:
        return str(e)
    return ""


def _torch_style(path: tuple) -> str:
    *module, leaf = (str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    return ".".join(module + ["weight" if leaf in ("kernel", "embedding", "scale") else leaf])


def check_params(want: Mapping, got: Mapping, *, source: str, model_type: str | None) -> None:
    """Every param of ``want`` (shapes) present in ``got`` with that shape; else a :class:`BackboneError`
    that names the weights (PyTorch-style names) and the likely cause."""
    want_flat = {_torch_style(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(want)}
    got_flat = {_torch_style(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_leaves_with_path(got)}
    missing = sorted(k for k in want_flat if k not in got_flat)
    if missing:
        raise BackboneError(
            f"{source}: the checkpoint does not provide {len(missing)} of the {len(want_flat)} "
            f"backbone weights of a {model_type} model (e.g. {missing[:5]}). Is this folder a "
            f"{model_type} checkpoint?"
        )
    bad = [(k, got_flat[k], s) for k, s in want_flat.items() if got_flat[k] != s]
    if bad:
        k, have, need = bad[0]
        raise BackboneError(
            f"{source}: mismatched shapes: {k} has shape {have} but config.json makes it {need} "
            f"({len(bad)} such weights). The weights do not fit the architecture in config.json "
            "(edited config, or weights from another model size)."
        )


def strip_prefix(state: Mapping[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """``state`` with ``prefix.`` removed where present (a task model's base model becomes the base model)."""
    if not prefix:
        return dict(state)
    p = prefix + "."
    if not any(k.startswith(p) for k in state):
        return dict(state)
    return {k[len(p) :]: v for k, v in state.items() if k.startswith(p)}
