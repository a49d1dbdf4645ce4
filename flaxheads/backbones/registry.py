"""Which backbone serves a model folder: the native family for its ``model_type``, or HF's Flax wrapper.

One decision, made here: ``implementation="auto"`` picks the native family when one serves
the ``model_type`` and falls back to the optional HF Flax adapter (transformers < 5) only
for architectures that have no native backbone."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.base import (
    Backbone,
    BackboneError,
    BackboneNotFoundError,
    HFConfig,
    MissingConfigKey,
    missing_key_error,
)
from flaxheads.backbones.families.albert import AlbertBackbone
from flaxheads.backbones.families.bart import BartBackbone
from flaxheads.backbones.families.bert import BertBackbone
from flaxheads.backbones.families.deberta import DebertaV2Backbone
from flaxheads.backbones.families.decoder import DecoderBackbone
from flaxheads.backbones.families.distilbert import DistilBertBackbone
from flaxheads.backbones.families.electra import ElectraBackbone
from flaxheads.backbones.families.eurobert import EuroBertBackbone
from flaxheads.backbones.families.gpt2 import GPT2Backbone
from flaxheads.backbones.families.gte import GteBackbone
from flaxheads.backbones.families.jina_v3 import JinaV3Backbone
from flaxheads.backbones.families.modernbert import ModernBertBackbone
from flaxheads.backbones.families.modernbert_decoder import ModernBertDecoderBackbone
from flaxheads.backbones.families.nomic_bert import NomicBertBackbone
from flaxheads.backbones.families.roberta import RobertaBackbone
from flaxheads.backbones.weights import read_state_dict
from flaxheads.runtime.plan import ComputePlan

#: Every native family, in the order their ``model_types`` are looked up.
FAMILIES: tuple[type[Backbone], ...] = (
    BertBackbone,
    RobertaBackbone,
    ElectraBackbone,
    DistilBertBackbone,
    AlbertBackbone,
    GPT2Backbone,
    BartBackbone,
    ModernBertBackbone,
    DebertaV2Backbone,
    DecoderBackbone,
    EuroBertBackbone,
    ModernBertDecoderBackbone,
    NomicBertBackbone,
    GteBackbone,
    JinaV3Backbone,
)
IMPLEMENTATIONS = ("auto", "native", "hf_flax")
#: The ``model_type`` values transformers 4.x had a Flax model for (``FlaxAutoModel``, 4.57's
#: ``FLAX_MODEL_MAPPING_NAMES``): the only ones the ``flaxheads[hf-flax]`` extra can load.
HF_FLAX_MODEL_TYPES = frozenset(
    {
        "albert",
        "bart",
        "beit",
        "bert",
        "big_bird",
        "blenderbot",
        "blenderbot-small",
        "bloom",
        "clip",
        "dinov2",
        "distilbert",
        "electra",
        "gemma",
        "gpt-sw3",
        "gpt2",
        "gpt_neo",
        "gptj",
        "llama",
        "longt5",
        "marian",
        "mbart",
        "mistral",
        "mt5",
        "opt",
        "pegasus",
        "regnet",
        "resnet",
        "roberta",
        "roberta-prelayernorm",
        "roformer",
        "t5",
        "vision-text-dual-encoder",
        "vit",
        "wav2vec2",
        "whisper",
        "xglm",
        "xlm-roberta",
    }
)


def family_for(model_type: str | None) -> type[Backbone] | None:
    """The native family serving ``model_type``, or None."""
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    return None


def native_model_types() -> tuple[str, ...]:
    return tuple(t for fam in FAMILIES for t in fam.model_types)


def native_config(config: HFConfig) -> tuple[HFConfig, type[Backbone] | None]:
    """``(config, family)`` of a folder's ``config.json``: a config written for a model's own hub code
    (``auto_map``) whose architecture transformers now has a class for (nomic-bert, GTE's ``new``, Jina v3's
    ``xlm-roberta``) becomes that class's config, as the family reads it
    (:meth:`~flaxheads.backbones.families.rotary_bert.RotaryBertBackbone.from_custom_config`); any other
    config is returned as it is, with the family of its ``model_type`` (None when there is none)."""
    for fam in FAMILIES:
        convert = getattr(fam, "from_custom_config", None)
        native = convert(config) if convert is not None else None
        if native is not None:
            return native, fam
    return config, family_for(config.get("model_type"))


def folder_config(path: str | os.PathLike) -> tuple[HFConfig, type[Backbone] | None]:
    """``(config, family)`` of the folder's ``config.json`` as :func:`native_config` reads it: the one way every
    path that reads a folder (from_pretrained, the shapes-only model, the read onto a mesh, the transformers
    import) sees a hub folder written for a model's own code."""
    return native_config(HFConfig.from_folder(path))


def no_backbone_error(path: str, config: HFConfig) -> BackboneError:
    """The refusal of a ``model_type`` no native family serves, with the advice that holds for it: HF's Flax
    model (the ``flaxheads[hf-flax]`` extra) only where transformers 4.x had one."""
    from flaxheads.backbones import hf_flax

    mt = config.get("model_type")
    custom = (config.get("auto_map") or {}).get("AutoConfig") if isinstance(config.get("auto_map"), Mapping) else None
    if mt in HF_FLAX_MODEL_TYPES:
        advice = (
            "implementation='hf_flax' runs transformers' own Flax model of it"
            if hf_flax.available()
            else "transformers 4.x has a Flax model of it: install 'flaxheads[hf-flax]' (transformers < 5) and load "
            "it with implementation='hf_flax'"
        )
    else:
        advice = f"transformers never had a Flax model of {mt!r}, so the flaxheads[hf-flax] extra cannot load it either"
        if custom:
            advice += f"; its config.json names the model's own code ({custom}), which flaxheads never runs"
    return BackboneError(
        f"{path}: model_type {mt!r} has no native flaxheads backbone (native: "
        f"{', '.join(native_model_types())}): {advice}. Use a model of a native family."
    )


def _in_file(e: BackboneError, config: HFConfig, fam: type[Backbone]) -> BackboneError:
    """``e`` naming the ``config.json`` it is about, and the keys in its message that the file
    lacks (transformers' defaults stood in for them: a cut or edited file)."""
    source = object.__getattribute__(config, "_source") or "config.json"
    filled = [k for k in fam.complete_config(config) if k not in config and f"{k} " in f"{e} "]
    note = (
        (
            f" ({', '.join(filled)} not in the file: the default was used; download config.json again or add "
            "the model's value)"
        )
        if filled
        else ""
    )
    return type(e)(f"{source}: {e}{note}")


def load_backbone(
    path: str | os.PathLike,
    dtype: Any = jnp.float32,
    *,
    state: Mapping[str, np.ndarray] | None = None,
    remat: bool | str = False,
    implementation: str = "auto",
    plan: ComputePlan | None = None,
):
    """The backbone of a local Hugging Face folder (``config.json`` + weights; never the hub).

    ``implementation``: ``"native"`` (flaxheads' own JAX code; an error when the family has
    none), ``"hf_flax"`` (transformers 4.x ``FlaxAutoModel``, the ``flaxheads[hf-flax]`` extra),
    ``"auto"`` (native when there is one, else HF's Flax wrapper if installed). ``plan``: how its
    programs compute (default :meth:`~flaxheads.runtime.plan.ComputePlan.for_host`)."""
    if implementation not in IMPLEMENTATIONS:
        raise BackboneError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise BackboneNotFoundError(
            f"model folder {path!r} does not exist: pass a local Hugging Face folder "
            "(config.json + model.safetensors); flaxheads never downloads"
        )
    config, fam = folder_config(path)
    if "model_type" not in config and os.path.isfile(os.path.join(path, ".flaxheads")):  # a run's own config.json
        raise BackboneError(
            f"{path} is a flaxheads run folder, not a base model (its config.json holds the run's settings): "
            f"load the model it trained with fh.load({path!r}) or fh.Classifier.from_pretrained({path!r})"
        )
    if "model_type" not in config:
        raise BackboneError(
            f"{os.path.join(path, 'config.json')} has no 'model_type', so the architecture is "
            f'unknown: download config.json again, or add "model_type" (supported: '
            f"{', '.join(native_model_types())})"
        )
    from flaxheads.backbones import hf_flax

    if implementation != "hf_flax" and fam is not None:
        state = read_state_dict(path) if state is None else state
        _rename_custom_prefixes(state, fam)
        try:
            return fam.from_state(config, state, dtype=dtype, remat=remat, source=path, plan=plan)
        except MissingConfigKey as e:
            raise missing_key_error(e, config.get("model_type")) from None
        except BackboneError as e:
            if path in str(e):
                raise
            raise _in_file(e, config, fam) from None
    if implementation != "hf_flax" and (
        implementation == "native" or not hf_flax.available() or config.get("model_type") not in HF_FLAX_MODEL_TYPES
    ):
        raise no_backbone_error(path, config)
    return hf_flax.load(path, config, dtype=dtype, state=state, remat=remat, plan=plan)


def _rename_custom_prefixes(state: Mapping[str, np.ndarray], fam: type[Backbone]) -> None:
    """The state dict of a hub classifier whose own code put the base model under another prefix (GTE's
    ``new.``) renamed, in place, to the family's ``base_model_prefix``: the caller's head lookup
    (:func:`flaxheads.from_pretrained` reads the pooler and classifier from the same dict) sees them too."""
    for prefix in getattr(fam, "custom_prefixes", ()):
        old = [k for k in state if k.startswith(prefix + ".")]
        if old and isinstance(state, dict) and not any(k.startswith(fam.base_model_prefix + ".") for k in state):
            for k in old:
                state[fam.base_model_prefix + k[len(prefix) :]] = state.pop(k)
