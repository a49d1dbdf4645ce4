"""A model of shapes alone: :func:`abstract_model` builds a :class:`~flaxheads.model.sequence.SequenceModel`
from a folder's ``config.json`` whose params are ``jax.ShapeDtypeStruct`` leaves, for memory plans and for
laying out a mesh before any weight is read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flaxheads.backbones.base import BackboneError
from flaxheads.backbones.registry import folder_config, native_model_types
from flaxheads.heads.linen import init_head
from flaxheads.losses import check_problem_type, infer_problem_type
from flaxheads.model.lora import LORA, LoraConfig, default_targets, init_lora
from flaxheads.model.quantize import quantize_params
from flaxheads.model.sequence import SequenceModel, build_head
from flaxheads.runtime.plan import ComputePlan


def abstract_model(
    path: str | os.PathLike,
    *,
    num_labels: int | None = None,
    dtype: Any = jnp.float32,
    remat: bool | str = False,
    lora: LoraConfig | None = None,
    base_dtype: Any = None,
    quantize: str | None = None,
    pooler=None,
    head=None,
    plan=None,
    config_changes: Mapping[str, Any] | None = None,
):
    """A :class:`~flaxheads.model.sequence.SequenceModel` of the folder's ``config.json`` whose params are
    ``jax.ShapeDtypeStruct`` leaves: nothing read but the config, nothing allocated. ``lora``:
    adapters (shapes) on the family's targets; ``base_dtype``: the base's storage dtype;
    ``quantize``: a quantised base (:mod:`flaxheads.model.quantize`); ``config_changes``: keys of
    ``config.json`` replaced (a shallower copy of the model, ``num_hidden_layers=2``)."""
    config, fam = folder_config(path)  # a hub folder for a model's own code reads as its family's config
    config = config.replace(**config_changes) if config_changes else config
    if fam is None:
        raise BackboneError(
            f"{os.fspath(path)}: model_type {config.get('model_type')!r} has no native flaxheads "
            f"backbone to plan (native: {', '.join(native_model_types())})"
        )
    config = fam.complete_config(config)
    fam.check_config(config)
    shapes = fam.param_shapes(config)
    if base_dtype is not None:
        shapes = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, jnp.dtype(base_dtype)) if jnp.issubdtype(x.dtype, jnp.floating) else x
            ),
            shapes,
        )
    if quantize is not None:
        shapes = jax.eval_shape(lambda p: quantize_params(p, quantize, config.get("model_type")), shapes)
    backbone = fam(config, shapes, dtype=dtype, remat=remat, plan=plan if plan is not None else ComputePlan.for_host())
    # transformers 5 writes id2label and no num_labels: the labels count, as in from_pretrained
    n = int(num_labels or len(config.get("id2label") or {}) or config.get("num_labels") or 2)
    seq_head, _ = build_head(config, n, pooler=pooler, head=head)
    head_shapes = jax.eval_shape(lambda: init_head(seq_head, config.hidden_size))
    ptype = infer_problem_type(n)
    check_problem_type(ptype, n)
    params = {"backbone": shapes, "head": head_shapes}
    model = SequenceModel(
        backbone=backbone,
        head=seq_head,
        num_labels=n,
        problem_type=ptype,
        params=params,
        pad_token_id=getattr(config, "pad_token_id", None),
        eos_token_id=getattr(config, "eos_token_id", None),
        name_or_path=os.fspath(path),
    )
    if lora is not None:
        if lora.targets is None:
            lora = dataclasses.replace(lora, targets=default_targets(model.model_type, shapes))
        adapters = jax.eval_shape(lambda: init_lora(lora, shapes, model.model_type, jax.random.PRNGKey(0)))
        model = dataclasses.replace(model, lora=lora, params={**params, LORA: adapters})
    return model
