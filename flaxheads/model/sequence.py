"""A backbone composed with a pooler and a head, functionally: :class:`SequenceModel` and :func:`build_head`.

Backbones follow the contract of :mod:`flaxheads.backbones.base` and are called as
``backbone(input_ids, attention_mask, params=..., dropout_rng=..., train=...)[0]`` (the last
hidden state), extra inputs (position ids, token types) included.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, cast

import jax
import jax.numpy as jnp

from flaxheads import config as _config
from flaxheads.errors import ConfigError
from flaxheads.heads import linen
from flaxheads.heads.heads import Head, LinearHead, SequenceHead, make_head
from flaxheads.heads.poolers import Pool, Pooler, make_pooler
from flaxheads.heads.presets import Preset, preset_for
from flaxheads.losses import loss_fn
from flaxheads.model.base_dtype import cast_tree
from flaxheads.model.lora import LORA, LoraConfig, merge_lora, with_lora
from flaxheads.runtime.plan import ComputePlan


@dataclasses.dataclass
class LoadReport:
    """Which head modules came from the checkpoint and which were freshly initialised."""

    pretrained: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (our path, HF name)
    new: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class SequenceModel:
    """A backbone (HF Flax wrapper) + :class:`SequenceHead`, with the initial ``params``.

    ``params = {"backbone": ..., "head": {"pooler": ..., "head": ...}}``, plus ``"lora"`` (the
    adapters, see :mod:`flaxheads.model.lora`) when ``lora`` is set. All methods are pure functions of
    the params passed in; ``self.params`` is only the starting point."""

    backbone: Any
    head: SequenceHead
    num_labels: int
    problem_type: str
    params: dict
    id2label: dict[int, str] | None = None
    pool_mask: str = "attention_mask"
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    arch: str | None = None  # HF preset name when the head is exactly that preset's
    hf_names: tuple[tuple[str, str], ...] = ()
    name_or_path: str = ""
    report: LoadReport = dataclasses.field(default_factory=LoadReport)
    lora: LoraConfig | None = None  # LoRA adapters in params["lora"] (targets resolved)
    #: a one-token pooler gets its token's hidden state alone, the last layer computed there
    #: (:meth:`pooler_inputs`); False computes every position, as PyTorch does (for comparisons)
    pooled_token_only: bool = True

    @property
    def hidden_size(self) -> int:
        return int(self.backbone.config.hidden_size)

    @property
    def plan(self) -> ComputePlan:
        """How this model's programs compute (the backbone's :class:`~flaxheads.runtime.plan.ComputePlan`)."""
        return self.backbone.plan

    @property
    def model_type(self) -> str:
        return self.backbone.config.model_type

    # ---- pure pieces -------------------------------------------------------------------
    def pooling_mask(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """The mask the pooler sees (GPT-2: ids != pad; BART: ids == eos; else attention mask)."""
        if self.pool_mask not in ("non_pad_token", "eos_token"):
            return attention_mask
        key, token = (
            ("pad_token_id", self.pad_token_id)
            if self.pool_mask == "non_pad_token"
            else ("eos_token_id", self.eos_token_id)
        )
        if token is None:  # check_pool_mask refuses such a model where one is built from a preset
            raise ConfigError(f"pool_mask {self.pool_mask!r} needs the model's {key}, which is None")
        return (jnp.not_equal if self.pool_mask == "non_pad_token" else jnp.equal)(input_ids, token)

    def features(
        self,
        backbone_params,
        input_ids,
        attention_mask,
        *,
        train: bool = False,
        dropout_rng: jax.Array | None = None,
        **extra,
    ) -> tuple[jax.Array, jax.Array]:
        """Encoder last hidden state [B, T, H] and the pooling mask [B, T]."""
        if "token_type_ids" not in extra and _takes(self.backbone, "token_type_ids"):
            # HF's FlaxElectraModel defaults token types to ones (PyTorch: zeros); pass zeros explicitly.
            extra["token_type_ids"] = jnp.zeros_like(input_ids)
        out = self.backbone(
            input_ids,
            attention_mask=attention_mask,
            params=backbone_params,
            dropout_rng=dropout_rng,
            train=train,
            **extra,
        )
        return out[0], self.pooling_mask(input_ids, attention_mask)

    def pooler_inputs(
        self,
        backbone_params,
        input_ids,
        attention_mask,
        *,
        train: bool = False,
        dropout_rng: jax.Array | None = None,
        **extra,
    ) -> tuple[jax.Array, jax.Array]:
        """What the pooler reads: :meth:`features`, or, when the pooler reads one token per sequence
        (:meth:`~flaxheads.heads.poolers.Pooler.position`: first token, last non-pad, ...) and the
        backbone can stop there (``"only_at"`` in its features), that token's last hidden state
        ``[B, 1, H]`` with a mask of ones. The pooled vector is the same; the last layer runs at one
        position instead of ``T`` (on a 6-layer encoder ~1/7 of the forward and backward)."""
        pool_mask = self.pooling_mask(input_ids, attention_mask)
        pooler = getattr(self.head, "pooler", None)
        at = None
        if self.pooled_token_only and pooler is not None and "only_at" in getattr(self.backbone, "features", ()):
            at = pooler.position(pool_mask)
        if at is None:
            return self.features(
                backbone_params, input_ids, attention_mask, train=train, dropout_rng=dropout_rng, **extra
            )
        hidden, _ = self.features(
            backbone_params, input_ids, attention_mask, train=train, dropout_rng=dropout_rng, only_at=at, **extra
        )
        return hidden, jnp.ones(hidden.shape[:2], jnp.int32)

    def backbone_params(self, params) -> dict:
        """The backbone params the forward runs on: ``params["backbone"]``, with the LoRA adapters
        merged into their kernels when the model has them."""
        if self.lora is None:
            return params["backbone"]
        if LORA not in params:
            raise ConfigError(
                "this model has LoRA adapters but the params have no 'lora' subtree; pass the "
                "params of the model with adapters (model.params), or merge them (flaxheads.model.lora)"
            )
        return merge_lora(params["backbone"], params[LORA], self.lora, self.model_type)

    def with_base_dtype(self, dtype) -> SequenceModel:
        """This model with its base (``params["backbone"]``) stored in ``dtype`` (e.g. ``jnp.bfloat16``
        for a frozen base; see :mod:`flaxheads.model.base_dtype`); head and adapters keep their float32."""
        backbone_params = cast_tree(self.params["backbone"], dtype)
        backbone = copy.copy(self.backbone)
        if getattr(backbone, "params", None) is self.params["backbone"]:
            backbone.params = backbone_params  # the backbone's own reference would keep the old copy alive
        return dataclasses.replace(self, backbone=backbone, params={**self.params, "backbone": backbone_params})

    def with_quantized_base(self, qtype: str) -> SequenceModel:
        """This model with its base's layer kernels quantised to ``qtype`` (``int8 | int4 | nf4``;
        :mod:`flaxheads.model.quantize`): a frozen base for QLoRA or a frozen backbone."""
        from flaxheads.model.quantize import quantize_params

        backbone_params = quantize_params(self.params["backbone"], qtype, self.model_type)
        backbone = copy.copy(self.backbone)
        if getattr(backbone, "params", None) is self.params["backbone"]:
            backbone.params = backbone_params
        return dataclasses.replace(self, backbone=backbone, params={**self.params, "backbone": backbone_params})

    def with_lora(self, config: LoraConfig | None = None, *, seed: int = 0, **options) -> SequenceModel:
        """This model with fresh LoRA adapters (see :func:`flaxheads.model.lora.with_lora`)."""
        return with_lora(self, config, seed=seed, **options)

    def packed_features(
        self,
        backbone_params,
        input_ids,
        segment_ids,
        position_ids,
        segment_index,
        segment_mask,
        *,
        train: bool = False,
        dropout_rng: jax.Array | None = None,
        **extra,
    ) -> tuple[jax.Array, jax.Array]:
        """Rows packing several texts (see :mod:`flaxheads.data.packing`) through the backbone, then
        each text gathered into its own row: hidden ``[R*S, L, H]`` and pooling mask ``[R*S, L]``, as
        the unpacked texts would give them, so every pooler and head applies unchanged."""
        if "packing" not in getattr(self.backbone, "features", ()) or self.pool_mask != "attention_mask":
            raise ConfigError(
                f"packed batches need a backbone that restarts positions and keeps attention "
                f"within each text (BERT-like encoders) and a pooler on the attention mask; "
                f"this {self.model_type} model has neither: train without packing"
            )
        hidden, _ = self.features(
            backbone_params,
            input_ids,
            (segment_ids > 0).astype(jnp.int32),
            train=train,
            dropout_rng=dropout_rng,
            position_ids=position_ids,
            segment_ids=segment_ids,
            **extra,
        )
        rows, segs, length = segment_index.shape
        texts = hidden[jnp.arange(rows)[:, None, None], segment_index]  # [R, S, L, H]
        return texts.reshape(rows * segs, length, -1), segment_mask.reshape(rows * segs, length)

    def apply_packed(
        self,
        params,
        input_ids,
        segment_ids,
        position_ids,
        segment_index,
        segment_mask,
        *,
        train: bool = False,
        dropout_rng: jax.Array | None = None,
        **extra,
    ) -> jax.Array:
        """Logits ``[R*S, num_labels]`` of a packed batch, one row per text slot (empty slots included)."""
        rb, rh = _dropout_keys(train, dropout_rng)
        hidden, mask = self.packed_features(
            self.backbone_params(params),
            input_ids,
            segment_ids,
            position_ids,
            segment_index,
            segment_mask,
            train=train,
            dropout_rng=rb,
            **extra,
        )
        return self.head_apply(params["head"], hidden, mask, train=train, dropout_rng=rh)

    def head_apply(
        self, head_params, hidden, mask, *, train: bool = False, dropout_rng: jax.Array | None = None
    ) -> jax.Array:
        """Pooler + head on hidden states: logits (or embeddings) [B, N], float32."""
        rngs: dict[str, jax.Array] = {}
        if train:
            if dropout_rng is None:
                raise ConfigError("train=True needs a dropout_rng")
            rngs["dropout"] = dropout_rng
        # apply's union return covers mutable collections, which this call asks for none of
        return cast(
            jax.Array,
            linen.module(self.head).apply({"params": head_params}, hidden, mask, deterministic=not train, rngs=rngs),
        )

    def apply(
        self,
        params,
        input_ids,
        attention_mask=None,
        *,
        train: bool = False,
        dropout_rng: jax.Array | None = None,
        **extra,
    ) -> jax.Array:
        """Logits [B, num_labels] in float32 (embeddings for projection heads)."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        rb, rh = _dropout_keys(train, dropout_rng)
        hidden, mask = self.pooler_inputs(
            self.backbone_params(params), input_ids, attention_mask, train=train, dropout_rng=rb, **extra
        )
        return self.head_apply(params["head"], hidden, mask, train=train, dropout_rng=rh)

    def __call__(self, input_ids, attention_mask=None, params=None, **kw) -> jax.Array:
        return self.apply(self.params if params is None else params, input_ids, attention_mask, **kw)

    def loss_fn(self, **options):
        """``f(logits, labels, weights)`` for this model's problem type (see ``losses.loss_fn``)."""
        return loss_fn(self.problem_type, self.num_labels, **options)

    def to_nnx(self, params=None, *, freeze_backbone: bool | None = None, rngs=None):
        """This model as a Flax NNX module on ``params`` (default ``self.params``): see
        :func:`flaxheads.nnx.to_nnx`."""
        from flaxheads.nnx.model import to_nnx

        return to_nnx(self, params, freeze_backbone=freeze_backbone, rngs=rngs)

    def head_config(self) -> dict:
        return _config.to_dict(self.head)


def _dropout_keys(train: bool, dropout_rng: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """The backbone's and the head's dropout keys (None when not training)."""
    if not train:
        return None, None
    if dropout_rng is None:
        raise ConfigError("train=True needs a dropout_rng")
    rb, rh = jax.random.split(dropout_rng)
    return rb, rh


def _takes(fn, name: str) -> bool:
    import inspect

    return name in inspect.signature(fn.__call__).parameters


def build_head(
    hf_config,
    num_labels: int,
    *,
    pooler=None,
    head=None,
    pooler_options: dict | None = None,
    head_options: dict | None = None,
) -> tuple[SequenceHead, Preset | None]:
    """The HF preset for ``hf_config.model_type`` unless ``pooler``/``head`` choose otherwise."""
    preset = preset_for(hf_config, num_labels)
    pooler_options, head_options = dict(pooler_options or {}), dict(head_options or {})
    if pooler is None and not pooler_options:
        p: Pooler = preset.pooler if preset else Pool("mean")
    else:
        p = make_pooler(pooler if pooler is not None else "mean", **pooler_options)
    if head is None and not head_options:
        h: Head = (
            preset.head
            if preset
            else LinearHead(num_labels, dropout=float(getattr(hf_config, "hidden_dropout_prob", 0.1) or 0.0))
        )
    elif isinstance(head, Head):
        h = make_head(head, **head_options)
    else:
        name = head or "linear"
        if name in ("linear", "mlp"):
            head_options.setdefault("num_labels", num_labels)
        h = make_head(name, **head_options)
    return SequenceHead(p, h), preset


def _module_paths(tree, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        p = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(not isinstance(x, dict) for x in v.values()):
            out.append(p)
        elif isinstance(v, dict):
            out.extend(_module_paths(v, p + "/"))
    return out
