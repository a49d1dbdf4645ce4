"""Import PyTorch folders as flaxheads models: a trained ``XForSequenceClassification``
(transformers layout) or a sentence-transformers model (Transformer -> Pooling -> Dense* ->
Normalize).

Weights come from safetensors, or from ``pytorch_model.bin`` through
``torch.load(weights_only=True)`` only (see :func:`flaxheads.hf_weights.read_state_dict`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from .export import ST_ACTIVATIONS, ST_LEGACY_KEYS
from ..nn.heads import IdentityHead, ProjectionHead
from ..backbones.weights import BIN, BIN_INDEX, SAFE, SAFE_INDEX, read_torch_bin
from ..model import SequenceModel, from_pretrained
from ..nn.poolers import Concat, Pool
from ..backbones.base import BackboneError
from ..errors import FlaxheadsError
from ..presets import PRESETS, preset_for

WEIGHT_FILES = (SAFE, SAFE_INDEX, BIN, BIN_INDEX)


class ModelImportError(FlaxheadsError):
    """A folder flaxheads cannot import (the message says what was wrong and what is expected)."""


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError) as e:
        raise ModelImportError(f"{path}: not readable JSON ({e})") from None


def _check_weights_present(folder: str) -> None:
    if not any(os.path.isfile(os.path.join(folder, w)) for w in WEIGHT_FILES):
        present = sorted(os.listdir(folder))
        raise ModelImportError(
            f"{folder}: no model weights: expected one of {list(WEIGHT_FILES)}, found {present[:12]}. "
            "flaxheads reads safetensors, or pytorch_model.bin through torch.load(weights_only=True); other "
            "formats (TensorFlow .h5, arbitrary pickles, .pt training files) are not read. Re-save the model "
            "with `save_pretrained(folder, safe_serialization=True)`.")


# ---- transformers XForSequenceClassification -------------------------------------------------------
def load_transformers(folder: str | os.PathLike, *, allow_new_head: bool = False, **options) -> SequenceModel:
    """A trained PyTorch ``XForSequenceClassification`` folder as a flaxheads model with the same logits.

    The ``config.json`` must name the preset's PyTorch class in ``architectures`` and the
    weights must contain every head module (else the folder is a base model: pass
    ``allow_new_head=True`` or use :func:`flaxheads.from_pretrained`). ``options`` go to
    :func:`flaxheads.from_pretrained` (``dtype``, ``ignore_mismatched_sizes``, ...)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"model folder {folder!r} does not exist")
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelImportError(f"{folder}: no config.json; a transformers model folder has config.json plus "
                               f"weights ({SAFE} or {BIN})")
    raw = _read_json(cfg_path)
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in PRESETS:
        raise ModelImportError(
            f"{folder}: unknown architecture: model_type {model_type!r} (architectures {archs}) has no "
            f"flaxheads preset; supported model types: {sorted(PRESETS)}. To put a new head on a backbone "
            "FlaxAutoModel can load, use flaxheads.from_pretrained(folder, pooler=..., head=...).")
    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    preset = preset_for(hf_cfg, int(getattr(hf_cfg, "num_labels", 2)))
    if archs and archs[0] != preset.hf_class:
        raise ModelImportError(
            f"{folder}: unknown architecture {archs[0]!r}: flaxheads imports {model_type} sequence classifiers "
            f"({preset.hf_class}) only. Load the base model with flaxheads.from_pretrained(folder) to attach "
            "a new head instead.")
    _check_weights_present(folder)
    try:
        model = from_pretrained(folder, **options)
    except BackboneError as e:
        raise ModelImportError(str(e)) from None
    except ValueError as e:
        if "expected to be of shape" not in str(e):
            raise
        # HF's PyTorch->Flax converter names the tensor but not the folder or the likely cause
        raise ModelImportError(f"{folder}: mismatched shapes: {e} The weights do not fit the architecture in "
                               "config.json (edited config, or weights from another model size).") from None
    if model.report.new and not allow_new_head:
        missing = [dict(preset.hf_names).get(p, p) for p in model.report.new]
        raise ModelImportError(
            f"{folder}: missing weights: the checkpoint has no weights for the head modules {missing} of "
            f"{preset.hf_class}, so it is not a trained sequence classifier. Pass allow_new_head=True (or use "
            "flaxheads.from_pretrained) to start a new head on this backbone.")
    return model


# ---- sentence-transformers ---------------------------------------------------------------------------
_ST_TO_POOL = {"cls": "first_non_pad", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean_sqrt_len",
               "weightedmean": "weighted_mean", "lasttoken": "last"}
_TORCH_TO_ACT = {}
for _name, _cls in ST_ACTIVATIONS.items():
    _TORCH_TO_ACT.setdefault(_cls, _name if _name not in ("linear", "identity") else None)
_TORCH_TO_ACT["torch.nn.modules.linear.Identity"] = None


def st_pooling_modes(cfg: dict) -> list[str]:
    """The pooling modes of a ``1_Pooling/config.json``, in the order sentence-transformers
    concatenates them: the ``pooling_mode`` key (str or list, kept in order) or the legacy
    ``pooling_mode_*`` booleans (ST's fixed order; none set means mean, as ST does)."""
    if "pooling_mode" in cfg and cfg["pooling_mode"] is not None:
        m = cfg["pooling_mode"]
        modes = [m] if isinstance(m, str) else list(m)
    else:
        modes = [m for m, key in ST_LEGACY_KEYS.items() if cfg.get(key, False)] or ["mean"]
    bad = [m for m in modes if m not in _ST_TO_POOL]
    if bad:
        raise ModelImportError(f"unknown sentence-transformers pooling mode(s) {bad}; known: {sorted(_ST_TO_POOL)}")
    return modes


def _st_dense(path: str) -> tuple[dict, np.ndarray, np.ndarray | None]:
    cfg = _read_json(os.path.join(path, "config.json"))
    if os.path.isfile(os.path.join(path, SAFE)):
        from safetensors.numpy import load_file

        state = load_file(os.path.join(path, SAFE))
    elif os.path.isfile(os.path.join(path, BIN)):
        state = read_torch_bin(os.path.join(path, BIN))
    else:
        raise ModelImportError(f"{path}: Dense module without weights ({SAFE} or {BIN})")
    if "linear.weight" not in state:
        raise ModelImportError(f"{path}: Dense weights have no 'linear.weight' (found {sorted(state)})")
    w = state["linear.weight"]
    b = state.get("linear.bias")
    want = (int(cfg["out_features"]), int(cfg["in_features"]))
    if tuple(w.shape) != want:
        raise ModelImportError(f"{path}: linear.weight has shape {tuple(w.shape)}, config.json says "
                               f"[out_features, in_features] = {list(want)}")
    if bool(cfg.get("bias", True)) != (b is not None):
        raise ModelImportError(f"{path}: config.json bias={cfg.get('bias', True)} but linear.bias is "
                               f"{'absent' if b is None else 'present'}")
    return cfg, w, b


def load_sentence_transformers(folder: str | os.PathLike, *, dtype=jnp.float32) -> SequenceModel:
    """A sentence-transformers folder as backbone + pooler + projection head with the same embeddings.

    Supported modules: Transformer, Pooling (``pooling_mode`` or legacy ``pooling_mode_*``
    keys), Dense (one activation and bias setting shared by all Dense layers), Dropout
    (a no-op at inference), Normalize (last). ST's ``cls`` is the first token the attention
    mask keeps, imported as the ``first_non_pad`` pooler."""
    folder = os.fspath(folder)
    mpath = os.path.join(folder, "modules.json")
    if not os.path.isfile(mpath):
        raise ModelImportError(f"{folder}: no modules.json, so not a sentence-transformers folder")
    modules = sorted(_read_json(mpath), key=lambda m: int(m.get("idx", 0)))
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    known = {"Transformer", "Pooling", "Dense", "Normalize", "Dropout"}
    if not kinds or kinds[0] != "Transformer" or len(kinds) < 2 or kinds[1] != "Pooling" or \
            any(k not in known for k in kinds) or "Normalize" in kinds[:-1] or kinds.count("Pooling") != 1 or \
            kinds.count("Transformer") != 1:
        raise ModelImportError(
            f"{folder}: modules {kinds} are not Transformer -> Pooling -> [Dense | Dropout]* -> [Normalize]; "
            "flaxheads imports that chain only.")
    where = {i: os.path.join(folder, m.get("path", "")) for i, m in enumerate(modules)}
    backbone_dir = where[0]
    _check_weights_present(backbone_dir)
    pool_cfg = _read_json(os.path.join(where[1], "config.json"))
    modes = st_pooling_modes(pool_cfg)
    pools = [Pool(_ST_TO_POOL[m]) for m in modes]
    pooler = pools[0] if len(pools) == 1 else Concat(tuple(pools))
    dense = [_st_dense(where[i]) for i, k in enumerate(kinds) if k == "Dense"]
    normalize = kinds[-1] == "Normalize"
    acts = []
    for cfg, _, _ in dense:
        name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")  # ST's default is Tanh
        if name not in _TORCH_TO_ACT:
            raise ModelImportError(f"{folder}: Dense activation {name!r} has no flaxheads equivalent; supported: "
                                   f"{sorted(_TORCH_TO_ACT)}")
        acts.append(_TORCH_TO_ACT[name])
    biases = [b is not None for _, _, b in dense]
    if len(set(acts)) > 1 or len(set(biases)) > 1:
        raise ModelImportError(f"{folder}: Dense layers with different activations {acts} or bias settings "
                               f"{biases}: flaxheads' ProjectionHead applies one activation and bias setting to "
                               "every layer.")
    from transformers import AutoConfig

    h = int(AutoConfig.from_pretrained(backbone_dir, local_files_only=True).hidden_size)
    dim = pool_cfg.get("embedding_dimension", pool_cfg.get("word_embedding_dimension"))
    if dim is not None and int(dim) != h:
        raise ModelImportError(f"{folder}: Pooling embedding dimension {dim} != the backbone's hidden_size {h}")
    width = pooler.out_features(h)
    if dense:
        head = ProjectionHead(features=tuple(int(w.shape[0]) for _, w, _ in dense), activation=acts[0],
                              use_bias=biases[0], normalize=normalize)
    else:
        head = IdentityHead(width=width, normalize=normalize)
    model = from_pretrained(backbone_dir, pooler=pooler, head=head, dtype=dtype, pool_mask="attention_mask")
    head_params = dict(model.params["head"])
    if dense:
        layers = {}
        for i, (cfg, w, b) in enumerate(dense):
            if w.shape[1] != width:
                raise ModelImportError(f"{folder}: Dense layer {i} takes {w.shape[1]} inputs but receives {width}")
            layers[f"dense_{i}"] = {"kernel": jnp.asarray(w.T), **({"bias": jnp.asarray(b)} if b is not None else {})}
            width = int(w.shape[0])
        head_params["head"] = layers
    return dataclasses.replace(model, params={"backbone": model.params["backbone"], "head": head_params},
                               num_labels=width, arch=None, hf_names=())


def import_model(folder: str | os.PathLike, **options) -> SequenceModel:
    """Import a sentence-transformers folder (it has ``modules.json``) or a transformers classifier."""
    folder = os.fspath(folder)
    if os.path.isfile(os.path.join(folder, "modules.json")):
        return load_sentence_transformers(folder, **options)
    return load_transformers(folder, **options)
