"""The optional adapter to transformers' own Flax models (``FlaxAutoModel``, transformers < 5).

transformers 5 deleted every Flax model class, so this path exists only with the
``flaxheads[hf-flax]`` extra, for architectures flaxheads has no native backbone for. The
loaded HF wrapper already has the backbone calling convention
(``model(input_ids, attention_mask, params=..., dropout_rng=..., train=...)[0]``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.base import BackboneError, HFConfig
from flaxheads.backbones.weights import read_state_dict
from flaxheads.layers.remat import remat_policy
from flaxheads.runtime.plan import ComputePlan

# HF Flax models that build a pooler we never use (the head owns pooling): skip it.
_HAS_UNUSED_POOLER = {"bert", "roberta", "xlm-roberta", "albert", "big_bird", "roberta-prelayernorm"}


def available() -> bool:
    """Whether the installed transformers still has Flax models (4.x)."""
    try:
        # transformers < 5 only: the checked stack's 5.x has no Flax models, hence no such name
        from transformers import FlaxAutoModel  # type: ignore[attr-defined]  # noqa: F401
    except ImportError:
        return False
    return True


def _import(model_type: str | None = None):
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")
            from transformers import AutoConfig, FlaxAutoModel  # type: ignore[attr-defined]  # transformers < 5
            from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax
    except ImportError:
        from flaxheads.backbones.registry import HF_FLAX_MODEL_TYPES, native_model_types

        if model_type is not None and model_type not in HF_FLAX_MODEL_TYPES:
            raise BackboneError(
                f"model_type {model_type!r}: transformers never had a Flax model of it, so the "
                "flaxheads[hf-flax] extra cannot load it; use a model of a family flaxheads runs "
                f"natively ({', '.join(native_model_types())})"
            ) from None
        what = f"model_type {model_type!r} has no native flaxheads backbone and" if model_type else "this backbone"
        raise BackboneError(
            f"{what} needs HF's Flax models, which transformers 5 removed: install "
            "'flaxheads[hf-flax]' (transformers < 5), or use a model of a family flaxheads runs "
            f"natively ({', '.join(native_model_types())})"
        ) from None
    return AutoConfig, FlaxAutoModel, convert_pytorch_state_dict_to_flax


def load(
    path: str | os.PathLike,
    config: HFConfig | None = None,
    dtype: Any = jnp.float32,
    *,
    state: Mapping[str, np.ndarray] | None = None,
    remat: bool | str = False,
    plan: ComputePlan | None = None,
):
    """A ``FlaxAutoModel`` for a local HF folder (no hub access), weights from its safetensors.

    Every backbone weight must come from the checkpoint: a folder whose weights do not fit
    raises instead of leaving random weights behind a warning (HF's Flax loader does the
    latter, e.g. for XLM-R, whose Flax and PyTorch classes disagree on the weight prefix).
    The architecture's built-in pooler is skipped where the head owns pooling. The model carries
    ``plan`` (default :meth:`~flaxheads.runtime.plan.ComputePlan.for_host`) for the programs built around it."""
    from flax.traverse_util import flatten_dict, unflatten_dict

    AutoConfig, FlaxAutoModel, convert = _import((config or HFConfig.from_folder(path)).get("model_type"))
    path = os.fspath(path)
    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    kwargs = {"add_pooling_layer": False} if cfg.model_type in _HAS_UNUSED_POOLER else {}
    if os.path.isfile(os.path.join(path, "flax_model.msgpack")):
        model = FlaxAutoModel.from_pretrained(path, dtype=dtype, local_files_only=True, **kwargs)
        return _with_remat(model, remat, plan)
    try:
        model = FlaxAutoModel.from_config(cfg, dtype=dtype, **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise BackboneError(
                f"model_type {cfg.model_type!r} has no Flax backbone in transformers "
                f"(FlaxAutoModel cannot build it). Its head presets still work on hidden states: "
                f"see flaxheads.heads.presets.PRESETS."
            ) from None
        raise
    state = read_state_dict(path) if state is None else state
    top = set(model.params)
    # Strip whatever PyTorch prefix wraps the base model ("bert.", "roberta.", "transformer.", ...).
    base_state = {}
    for k, v in state.items():
        head, _, rest = k.partition(".")
        if head not in top and rest.partition(".")[0] in top:
            k = rest
        base_state[k] = v
    converted = flatten_dict(convert(base_state, model))
    want = flatten_dict(model.params)
    missing = sorted("/".join(k) for k in want if k not in converted)
    if missing:
        raise BackboneError(
            f"{path}: the checkpoint does not provide {len(missing)} of the {len(want)} backbone weights of "
            f"{type(model).__name__} (e.g. {missing[:5]}). Is this folder a {cfg.model_type} checkpoint?"
        )
    model.params = unflatten_dict({k: jnp.asarray(converted[k], dtype=want[k].dtype) for k in want})
    return _with_remat(model, remat, plan)


def _with_remat(model, remat: bool | str, plan: ComputePlan | None):
    model.plan = plan if plan is not None else ComputePlan.for_host()
    policy = remat_policy(remat)
    if policy == "none":
        return model
    if policy != "full":
        raise BackboneError(
            f"remat={remat!r}: transformers' Flax models recompute whole layers only; use "
            "remat='full', or a native flaxheads backbone for other policies"
        )
    if not hasattr(model, "enable_gradient_checkpointing"):
        raise BackboneError(
            f"remat=True: {type(model).__name__} has no gradient checkpointing in transformers' "
            "Flax implementation; load without remat"
        )
    model.enable_gradient_checkpointing()
    return model


def to_native(model):
    """A native flaxheads backbone computing what the loaded HF Flax ``model`` computes, on the same params."""
    from flaxheads.backbones.registry import family_for

    fam = family_for(model.config.model_type)
    if fam is None:
        raise BackboneError(f"model_type {model.config.model_type!r} has no native flaxheads backbone")
    params = {k: v for k, v in model.params.items() if k != "pooler"}
    return fam(
        HFConfig(model.config.to_dict()),
        params,
        dtype=getattr(model, "dtype", jnp.float32),
        plan=getattr(model, "plan", None),
    )
