"""The PyTorch ``transformers`` folder (``config.json`` + ``model.safetensors`` + tokenizer files) of a
sequence classifier, both ways, with numpy only (no torch, no transformers classes).

Export writes a folder ``AutoModelForSequenceClassification.from_pretrained`` loads with no
missing or unexpected keys. A model whose pooler + head + pool mask is exactly an HF preset
(:func:`flaxheads.heads.presets.match_preset`) becomes that preset's ``XForSequenceClassification``;
any other pooler + head on a native backbone becomes a folder with flaxheads' own PyTorch code
(:mod:`.remote_code`, loaded with ``trust_remote_code=True``). Import reads both back with the
same logits (never running a folder's Python file); weights come from safetensors, or
``pytorch_model.bin`` through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from flaxheads.backbones.base import Backbone, BackboneError, HFConfig
from flaxheads.backbones.registry import family_for, folder_config
from flaxheads.backbones.weights import BIN, BIN_INDEX, SAFE, SAFE_INDEX, head_to_hf
from flaxheads.checkpoint.kinds import FolderKind, folder_kind
from flaxheads.disk.files import write_json
from flaxheads.heads.presets import PRESETS, Preset, PresetMatch, match_preset, preset_for
from flaxheads.interop import remote_code
from flaxheads.interop.files import (
    ExportError,
    ImportNotFoundError,
    ModelImportError,
    atomic_dir,
    backbone_config_dict,
    copy_tokenizer,
    flatten,
    flax_to_pytorch_names,
    np_tree,
    read_json,
    save_safetensors,
)
from flaxheads.model.pretrained import from_pretrained
from flaxheads.model.sequence import SequenceModel

WEIGHT_FILES = (SAFE, SAFE_INDEX, BIN, BIN_INDEX)
_OTHER_FORMATS = (
    "Export it with format='sentence-transformers' (pooling + dense layers + normalize) or "
    "format='head' (head.safetensors + head_config.json, any head)."
)


# ---- shared with sentence-transformers' Transformer module --------------------------------------------
def read_config(folder: str | os.PathLike) -> HFConfig:
    """``config.json`` of a model folder, completed with its native family's defaults (where there is one)."""
    cfg, fam = folder_config(folder)  # a hub folder for a model's own code: its family's config
    return fam.complete_config(cfg) if fam is not None else cfg


def check_weights_present(folder: str) -> None:
    """Raise :class:`ModelImportError` unless ``folder`` holds weights flaxheads reads."""
    if not any(os.path.isfile(os.path.join(folder, w)) for w in WEIGHT_FILES):
        present = sorted(os.listdir(folder))
        raise ModelImportError(
            f"{folder}: no model weights: expected one of {list(WEIGHT_FILES)}, found {present[:12]}. "
            "flaxheads reads safetensors, or pytorch_model.bin through torch.load(weights_only=True); other "
            "formats (TensorFlow .h5, arbitrary pickles, .pt training files) are not read. Re-save the model "
            "with `save_pretrained(folder, safe_serialization=True)`."
        )


def backbone_state_dict(model, params: Mapping | None = None, prefix: str = "") -> dict[str, np.ndarray]:
    """The backbone's weights under PyTorch names, checked to convert back to exactly the params.

    A native backbone names its own weights (:meth:`~flaxheads.backbones.base.Backbone.state_from_params`);
    HF's Flax models (the optional legacy adapter) go through transformers' renaming rule.
    LoRA adapters, when the model has them, are merged into their kernels first."""
    params = params or model.params
    bp = np_tree(model.backbone_params(params) if hasattr(model, "backbone_params") else params["backbone"])
    if isinstance(model.backbone, Backbone):
        state = model.backbone.state_from_params(bp)
        back = flatten(np_tree(type(model.backbone).params_from_state(model.backbone.config, state)))
        want = flatten(bp)
        if set(back) != set(want) or any(not np.array_equal(back[k], want[k]) for k in want):
            raise ExportError(
                f"{model.model_type}: the backbone's PyTorch names do not convert back to its params; "
                "this is a bug in flaxheads' name map. Export the head alone with format='head'."
            )
    else:
        state = flax_to_pytorch_names(bp)
        _check_hf_flax_roundtrip(model.backbone, bp, state)
    return {f"{prefix}.{k}" if prefix else k: v for k, v in state.items()}


def _check_hf_flax_roundtrip(backbone, backbone_params, state: Mapping[str, np.ndarray]) -> None:
    """HF Flax backbones: the exported names must convert back (HF's own PyTorch -> Flax rule) to the params."""
    from flax.traverse_util import flatten_dict
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    back = flatten_dict(convert_pytorch_state_dict_to_flax(dict(state), backbone))
    want = flatten_dict(backbone_params)
    bad = [
        k
        for k in want
        if k not in back or np.shape(back[k]) != np.shape(want[k]) or not np.array_equal(np.asarray(back[k]), want[k])
    ]
    if bad:
        raise ExportError(
            f"{backbone.config.model_type}: {len(bad)} backbone weights do not survive the "
            f"Flax -> PyTorch renaming (e.g. {['/'.join(map(str, k)) for k in bad[:3]]}); "
            "this backbone cannot be exported to PyTorch yet. Export the head alone with "
            "format='head'."
        )


# ---- export -------------------------------------------------------------------------------------------
def _match(model) -> PresetMatch:
    return match_preset(model.backbone.config, model.num_labels, model.head.pooler, model.head.head, model.pool_mask)


def exportable_family(arch: str | None) -> type[Backbone] | None:
    """The native family of the HF preset ``arch`` (a ``model_type``): it names the PyTorch
    ``base_model_prefix`` and the classifier dropout key of the preset's XForSequenceClassification.
    None for a preset without a native backbone (XLNet), which has no transformers export."""
    return family_for(arch)


def check_transformers_exportable(model) -> PresetMatch:
    """The model's exact HF preset match; :class:`ExportError` unless it is an HF class (what a PEFT
    adapter folder and the preset layout need; :func:`export_transformers` writes the others with
    flaxheads' own PyTorch code)."""
    if getattr(model, "backbone", None) is None:
        raise ExportError(
            f"a transformers export needs the backbone weights; this source has only a head. {_OTHER_FORMATS}"
        )
    match = _match(model)
    preset = match.preset
    if preset is None or not (match.same_pooler and match.same_head) or exportable_family(preset.arch) is None:
        kind = f"{type(model.head.pooler).__name__} + {type(model.head.head).__name__}"
        raise ExportError(
            f"the head ({kind}) on this {model.model_type} backbone is not the Hugging Face "
            f"{model.model_type} sequence-classification head, so no PyTorch XForSequenceClassification "
            f"class can load it (HF-exact presets with a JAX backbone: "
            f"{sorted(a for a in PRESETS if exportable_family(a))}). Export the whole model with "
            f"format='transformers' (flaxheads' own PyTorch code, trust_remote_code=True) instead."
        )
    if not match.exact:
        raise ExportError(
            f"{preset.hf_class} pools by {preset.pool_mask!r} but this model pools by "
            f"{model.pool_mask!r}: PyTorch would give other logits. Export the whole model with "
            "format='transformers' (flaxheads' own PyTorch code, trust_remote_code=True) instead."
        )
    return match


def preset_family(match: PresetMatch) -> tuple[Preset, type[Backbone]]:
    """The HF preset and its native backbone family of a match :func:`check_transformers_exportable`
    returned (an exact match of a preset with a native backbone: both are there)."""
    family = exportable_family(match.arch)
    if match.preset is None or family is None:  # ruled out by check_transformers_exportable
        raise ExportError(f"no PyTorch sequence-classification class for this model (preset {match.arch!r})")
    return match.preset, family


PRESET, CUSTOM = "preset", "custom"


def transformers_layout(model) -> str:
    """THE decision which transformers folder ``model`` becomes: :data:`PRESET` (the HF
    ``XForSequenceClassification`` it exactly is) or :data:`CUSTOM` (flaxheads' own PyTorch code,
    any pooler + head on a native backbone); :class:`ExportError` when it can be neither."""
    if getattr(model, "backbone", None) is None:
        raise ExportError(
            f"a transformers export needs the backbone weights; this source has only a head. {_OTHER_FORMATS}"
        )
    match = _match(model)
    if match.exact and exportable_family(match.arch) is not None:
        return PRESET
    remote_code.check_expressible(model)
    return CUSTOM


def transformers_config(model) -> dict:
    """``config.json`` of the PyTorch XForSequenceClassification equal to ``model``."""
    preset, family = preset_family(check_transformers_exportable(model))
    cfg = backbone_config_dict(model.backbone.config)
    labels = model.id2label or {i: f"LABEL_{i}" for i in range(model.num_labels)}
    cfg.update(
        architectures=[preset.hf_class],
        num_labels=model.num_labels,
        id2label={str(i): labels[i] for i in sorted(labels)},
        label2id={labels[i]: i for i in sorted(labels)},
        problem_type=model.problem_type,
    )
    key = family.classifier_dropout_key
    if key is not None:
        cfg[key] = float(model.head.head.dropout)
    return cfg


def transformers_state_dict(model, params: Mapping | None = None) -> dict[str, np.ndarray]:
    """The full PyTorch state dict (backbone under its base prefix + head modules)."""
    match = check_transformers_exportable(model)
    _, family = preset_family(match)
    params = params or model.params
    state = backbone_state_dict(model, params, prefix=family.base_model_prefix)
    state.update(head_to_hf(np_tree(params["head"]), match.hf_names))
    return state


def export_transformers(
    model,
    out: str | os.PathLike,
    *,
    params: Mapping | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    threshold: float | None = None,
    overwrite: bool = False,
) -> str:
    """Write ``model`` as a PyTorch transformers classifier folder; returns ``out``.

    An HF-exact preset (pooler, head and pool mask) is written as its ``XForSequenceClassification``;
    any other pooler + head on a native backbone as ``config.json`` + weights + ``modeling_flaxheads.py``
    (load with ``trust_remote_code=True``; ``threshold``: the multi-label decision threshold it records).
    Tokenizer files are copied from ``tokenizer_from`` (default: the folder the model was loaded from)."""
    layout = transformers_layout(model)
    if layout == PRESET:
        state, cfg = transformers_state_dict(model, params), transformers_config(model)
    with atomic_dir(out, overwrite) as tmp:
        if layout == PRESET:
            write_json(os.path.join(tmp, "config.json"), cfg)
            save_safetensors(state, os.path.join(tmp, "model.safetensors"))
        else:
            remote_code.write_folder(model, tmp, params=params, threshold=threshold)
        copy_tokenizer(os.fspath(tokenizer_from) if tokenizer_from else model.name_or_path, tmp)
        if layout == CUSTOM:
            _name_tokenizer_class(tmp)
    return os.fspath(out)


def _name_tokenizer_class(folder: str) -> None:
    """A fast ``tokenizer.json`` without ``tokenizer_config.json``: say its class, since ``AutoTokenizer``
    cannot guess it from ``model_type: flaxheads``."""
    if os.path.isfile(os.path.join(folder, "tokenizer.json")) and not os.path.isfile(
        os.path.join(folder, "tokenizer_config.json")
    ):
        write_json(os.path.join(folder, "tokenizer_config.json"), {"tokenizer_class": "PreTrainedTokenizerFast"})


# ---- import -------------------------------------------------------------------------------------------
def _classifier_config(folder: str) -> HFConfig:
    """The folder's config, checked to be a sequence classifier of a model type with a preset."""
    if not os.path.isdir(folder):
        raise ImportNotFoundError(f"model folder {folder!r} does not exist")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelImportError(
            f"{folder}: no config.json; a transformers model folder has config.json plus weights ({SAFE} or {BIN})"
        )
    raw = read_json(os.path.join(folder, "config.json"))
    if remote_code.is_flaxheads_config(raw):
        return HFConfig(raw)
    cfg = read_config(folder)
    model_type, archs = cfg.get("model_type"), cfg.get("architectures") or []
    if model_type not in PRESETS:
        raise ModelImportError(
            f"{folder}: unknown architecture: model_type {model_type!r} (architectures {archs}) has no "
            f"flaxheads preset; supported model types: {sorted(PRESETS)}. To put a new head on a backbone "
            "flaxheads can load, use flaxheads.from_pretrained(folder, pooler=..., head=...)."
        )
    return cfg


def load_transformers(folder: str | os.PathLike, *, allow_new_head: bool = False, **options) -> SequenceModel:
    """A trained PyTorch ``XForSequenceClassification`` folder as a flaxheads model with the same logits.

    A folder flaxheads exported with its own PyTorch code (``model_type: flaxheads``) is read from
    ``config.json`` and the weights (its Python file is never run); a PEFT adapter folder goes to
    :func:`~flaxheads.interop.peft.load_peft` (``backbone=``: its base folder). Otherwise the
    ``config.json`` must name the preset's PyTorch class in ``architectures`` and the weights must
    contain every head module (else the folder is a base model: pass ``allow_new_head=True`` or use
    :func:`flaxheads.from_pretrained`). ``options`` go to
    :func:`flaxheads.from_pretrained` (``dtype``, ``ignore_mismatched_sizes``, ...)."""
    folder = os.fspath(folder)
    kind = folder_kind(folder)
    if kind is FolderKind.PEFT_ADAPTER:
        from flaxheads.interop.peft import load_peft  # a PEFT adapter on its base folder

        return load_peft(folder, **options)
    if kind is FolderKind.ONNX:
        raise ModelImportError(
            f"{folder} is an ONNX export (model.onnx, no weights flaxheads reads): serve it with "
            "onnxruntime; to load the model in flaxheads use the run or the transformers export"
        )
    cfg = _classifier_config(folder)
    if remote_code.is_flaxheads_config(cfg):
        check_weights_present(folder)
        return remote_code.load_folder(folder, cfg, **options)
    preset = preset_for(cfg, len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2)))
    if preset is None:  # _classifier_config let only model types with a preset through
        raise ModelImportError(f"{folder}: model_type {cfg.model_type!r} has no flaxheads preset")
    archs = cfg.get("architectures") or []
    if archs and archs[0] != preset.hf_class:
        raise ModelImportError(
            f"{folder}: unknown architecture {archs[0]!r}: flaxheads imports {cfg.model_type} sequence classifiers "
            f"({preset.hf_class}) only. Load the base model with flaxheads.from_pretrained(folder) to attach "
            "a new head instead."
        )
    check_weights_present(folder)
    try:
        model = from_pretrained(folder, **options)
    except BackboneError as e:
        raise ModelImportError(str(e)) from None
    except ValueError as e:
        if "expected to be of shape" not in str(e):
            raise
        # HF's PyTorch->Flax converter (legacy adapter) names the tensor but not the folder or the likely cause
        raise ModelImportError(
            f"{folder}: mismatched shapes: {e} The weights do not fit the architecture in "
            "config.json (edited config, or weights from another model size)."
        ) from None
    if model.report.new and not allow_new_head:
        missing = [dict(preset.hf_names).get(p, p) for p in model.report.new]
        raise ModelImportError(
            f"{folder}: missing weights: the checkpoint has no weights for the head modules {missing} of "
            f"{preset.hf_class}, so it is not a trained sequence classifier. Pass allow_new_head=True (or use "
            "flaxheads.from_pretrained) to start a new head on this backbone."
        )
    return model
