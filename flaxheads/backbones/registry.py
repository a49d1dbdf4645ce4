"""Which backbone serves a model folder: the native family for its ``model_type``, or HF's Flax wrapper.

One decision, made here: ``implementation="auto"`` picks the native family when one serves
the ``model_type`` and falls back to the optional HF Flax adapter (transformers < 5) only
for architectures that have no native backbone."""
from __future__ import annotations

import os
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from flaxheads.runtime.plan import ComputePlan
from flaxheads.backbones.base import Backbone, BackboneError, BackboneNotFoundError, HFConfig, MissingConfigKey, missing_key_error
from flaxheads.backbones.families.albert import AlbertBackbone
from flaxheads.backbones.families.bart import BartBackbone
from flaxheads.backbones.families.bert import BertBackbone
from flaxheads.backbones.families.decoder import DecoderBackbone
from flaxheads.backbones.families.deberta import DebertaV2Backbone
from flaxheads.backbones.families.distilbert import DistilBertBackbone
from flaxheads.backbones.families.electra import ElectraBackbone
from flaxheads.backbones.families.eurobert import EuroBertBackbone
from flaxheads.backbones.families.gpt2 import GPT2Backbone
from flaxheads.backbones.families.modernbert import ModernBertBackbone
from flaxheads.backbones.families.modernbert_decoder import ModernBertDecoderBackbone
from flaxheads.backbones.families.roberta import RobertaBackbone
from flaxheads.backbones.weights import read_state_dict

#: Every native family, in the order their ``model_types`` are looked up.
FAMILIES: tuple[type[Backbone], ...] = (BertBackbone, RobertaBackbone, ElectraBackbone, DistilBertBackbone,
                                        AlbertBackbone, GPT2Backbone, BartBackbone, ModernBertBackbone,
                                        DebertaV2Backbone, DecoderBackbone, EuroBertBackbone,
                                        ModernBertDecoderBackbone)
IMPLEMENTATIONS = ("auto", "native", "hf_flax")


def family_for(model_type: str | None) -> type[Backbone] | None:
    """The native family serving ``model_type``, or None."""
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    return None


def native_model_types() -> tuple[str, ...]:
    return tuple(t for fam in FAMILIES for t in fam.model_types)


def _in_file(e: BackboneError, config: HFConfig, fam: type[Backbone]) -> BackboneError:
    """``e`` naming the ``config.json`` it is about, and the keys in its message that the file
    lacks (transformers' defaults stood in for them: a cut or edited file)."""
    source = object.__getattribute__(config, "_source") or "config.json"
    filled = [k for k in fam.complete_config(config) if k not in config and f"{k} " in f"{e} "]
    note = (f" ({', '.join(filled)} not in the file: the default was used; download config.json again or add "
            "the model's value)") if filled else ""
    return type(e)(f"{source}: {e}{note}")


def load_backbone(path: str | os.PathLike, dtype: Any = jnp.float32, *, state: Mapping[str, np.ndarray] | None = None,
                  remat: bool | str = False, implementation: str = "auto", plan: ComputePlan | None = None):
    """The backbone of a local Hugging Face folder (``config.json`` + weights; never the hub).

    ``implementation``: ``"native"`` (flaxheads' own JAX code; an error when the family has
    none), ``"hf_flax"`` (transformers 4.x ``FlaxAutoModel``, the ``flaxheads[hf-flax]`` extra),
    ``"auto"`` (native when there is one, else HF's Flax wrapper if installed). ``plan``: how its
    programs compute (default :meth:`~flaxheads.runtime.plan.ComputePlan.for_host`)."""
    if implementation not in IMPLEMENTATIONS:
        raise BackboneError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise BackboneNotFoundError(f"model folder {path!r} does not exist: pass a local Hugging Face folder "
                                    "(config.json + model.safetensors); flaxheads never downloads")
    config = HFConfig.from_folder(path)
    if "model_type" not in config:
        raise BackboneError(f"{os.path.join(path, 'config.json')} has no 'model_type', so the architecture is "
                            f"unknown: download config.json again, or add \"model_type\" (supported: "
                            f"{', '.join(native_model_types())})")
    fam = family_for(config.get("model_type"))
    if implementation == "native" or (implementation == "auto" and fam is not None):
        if fam is None:
            raise BackboneError(
                f"{path}: model_type {config.get('model_type')!r} has no native flaxheads backbone (native: "
                f"{', '.join(native_model_types())}). Use implementation='hf_flax' with transformers < 5 installed "
                "(pip install 'flaxheads[hf-flax]'), or a model of a supported family.")
        state = read_state_dict(path) if state is None else state
        try:
            return fam.from_state(config, state, dtype=dtype, remat=remat, source=path, plan=plan)
        except MissingConfigKey as e:
            raise missing_key_error(e, config.get("model_type")) from None
        except BackboneError as e:
            if path in str(e):
                raise
            raise _in_file(e, config, fam) from None
    from flaxheads.backbones import hf_flax

    return hf_flax.load(path, config, dtype=dtype, state=state, remat=remat, plan=plan)
