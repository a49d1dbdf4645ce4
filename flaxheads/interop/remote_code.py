"""Transformers folders for the pooler + head combinations no ``XForSequenceClassification`` has,
both ways, with numpy only.

Export writes ``config.json`` (``model_type: flaxheads``, ``auto_map`` to the PyTorch code,
the backbone's own config nested as ``backbone_hf_config``, the flaxheads pooler + head
config as ``sequence_head``), ``model.safetensors`` (``backbone.<the backbone's PyTorch
names>``, ``pooler.*``, ``head.*``), the PyTorch code ``modeling_flaxheads.py`` (shipped with
flaxheads) and the tokenizer files. PyTorch loads it with ``trust_remote_code=True``.

Import reads ``config.json`` and the weights only: the Python file in the folder is never run.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads import config as _config
from flaxheads._version import __version__
from flaxheads.backbones.base import Backbone, BackboneError, HFConfig
from flaxheads.backbones.registry import family_for, native_model_types
from flaxheads.backbones.weights import read_state_dict
from flaxheads.disk.files import write_json
from flaxheads.errors import ConfigError
from flaxheads.heads import linen
from flaxheads.interop.files import (
    ExportError,
    ModelImportError,
    backbone_config_dict,
    flatten,
    flax_to_pytorch_names,
    np_tree,
    pytorch_to_flax_leaf,
    save_safetensors,
)
from flaxheads.losses import infer_problem_type
from flaxheads.model.sequence import LoadReport, SequenceModel, _module_paths

MODEL_TYPE = "flaxheads"
CODE_FILE = "modeling_flaxheads.py"
MODEL_CLASS = "FlaxheadsForSequenceClassification"
AUTO_MAP = {
    "AutoConfig": "modeling_flaxheads.FlaxheadsConfig",
    "AutoModel": f"modeling_flaxheads.{MODEL_CLASS}",
    "AutoModelForSequenceClassification": f"modeling_flaxheads.{MODEL_CLASS}",
}
#: state-dict prefix of the backbone (the PyTorch module's attribute name)
BACKBONE = "backbone"


def code_path() -> str:
    """The PyTorch code written next to the weights (a module of this package, never imported by it)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), CODE_FILE)


def check_expressible(model) -> None:
    """:class:`ExportError` unless the model's backbone is one transformers' ``AutoModel`` builds the
    same way flaxheads computes it (a native family: each is checked against PyTorch)."""
    if not isinstance(model.backbone, Backbone) or family_for(model.model_type) is None:
        raise ExportError(
            f"{model.model_type}: this backbone runs on Hugging Face's Flax code (no native flaxheads family), whose "
            "agreement with PyTorch's AutoModel flaxheads does not check, so its pooler + head cannot be written as "
            f"a transformers folder (native families: {', '.join(native_model_types())}). Export the head alone with "
            "format='head'."
        )


def pool_token_id(model) -> int | None:
    """The token id the pooling mask compares against (pad for ``non_pad_token``, eos for ``eos_token``)."""
    return {"non_pad_token": model.pad_token_id, "eos_token": model.eos_token_id}.get(model.pool_mask)


def config_dict(model, *, threshold: float = 0.5) -> dict:
    """``config.json`` of the folder: the PyTorch ``FlaxheadsConfig`` of ``model``."""
    labels = model.id2label or {i: f"LABEL_{i}" for i in range(model.num_labels)}
    backbone = backbone_config_dict(model.backbone.config)
    return {
        "model_type": MODEL_TYPE,
        "architectures": [MODEL_CLASS],
        "auto_map": AUTO_MAP,
        "backbone_hf_config": backbone,
        "sequence_head": _config.to_dict(model.head),
        "pool_mask": model.pool_mask,
        "pool_token_id": pool_token_id(model),
        "threshold": float(threshold),
        "pad_token_id": getattr(model.backbone.config, "pad_token_id", None),
        "num_labels": model.num_labels,
        "id2label": {str(i): labels[i] for i in sorted(labels)},
        "label2id": {labels[i]: i for i in sorted(labels)},
        "problem_type": model.problem_type,
        "torch_dtype": "float32",
        "flaxheads_version": __version__,
        **{k: backbone[k] for k in ("transformers_version",) if k in backbone},
    }


def state_dict(model, params: Mapping | None = None) -> dict[str, np.ndarray]:
    """``backbone.*`` (the family's PyTorch names, LoRA merged) + the head's ``pooler.*`` / ``head.*``."""
    from flaxheads.interop.transformers import backbone_state_dict

    params = params or model.params
    state = backbone_state_dict(model, params, prefix=BACKBONE)
    state.update(flax_to_pytorch_names(np_tree(params["head"])))
    return state


def write_folder(model, folder: str, *, params: Mapping | None = None, threshold: float | None = None) -> None:
    """Config, weights and PyTorch code of ``model`` into the (new, empty) ``folder``."""
    check_expressible(model)
    if threshold is not None and not 0.0 < float(threshold) < 1.0:
        raise ExportError(f"threshold must be between 0 and 1 (exclusive), got {threshold}")
    cfg = config_dict(model, threshold=0.5 if threshold is None else threshold)
    write_json(os.path.join(folder, "config.json"), cfg)
    save_safetensors(state_dict(model, params), os.path.join(folder, "model.safetensors"))
    shutil.copyfile(code_path(), os.path.join(folder, CODE_FILE))


# ---- import -----------------------------------------------------------------------------------------
def is_flaxheads_config(raw: Mapping) -> bool:
    return raw.get("model_type") == MODEL_TYPE


def _head_params(seq_head, hidden_size: int, state: Mapping[str, np.ndarray], folder: str) -> dict:
    """The head params tree read from the ``pooler.*`` / ``head.*`` tensors, shapes checked."""
    shapes = jax.eval_shape(lambda: linen.init_head(seq_head, hidden_size))
    params: dict = {}
    for path, want in flatten(shapes).items():
        *mod, leaf = map(str, path)
        try:
            v = pytorch_to_flax_leaf(state, ".".join(mod), leaf)
        except KeyError as e:
            raise ModelImportError(
                f"{folder}: missing weights: no {e.args[0]!r} for the head's {'/'.join(path)}; "
                "the weights do not belong to the sequence_head in config.json"
            ) from None
        if tuple(v.shape) != tuple(want.shape):
            raise ModelImportError(
                f"{folder}: mismatched shapes: {'/'.join(path)} is {list(v.shape)} in the weights, "
                f"the sequence_head in config.json needs {list(want.shape)}"
            )
        node = params
        for m in mod:
            node = node.setdefault(m, {})
        node[leaf] = jnp.asarray(v, jnp.float32)
    return params


def load_folder(
    folder: str,
    raw: Mapping,
    *,
    dtype=jnp.float32,
    remat: bool = False,
    plan=None,
    allow_new_head: bool = False,
    **ignored,
) -> SequenceModel:
    """A flaxheads transformers folder as a :class:`SequenceModel`, from ``config.json`` and the weights."""
    del allow_new_head, ignored  # the folder always holds its head
    bcfg = raw.get("backbone_hf_config")
    if not isinstance(bcfg, Mapping) or not isinstance(raw.get("sequence_head"), Mapping):
        raise ModelImportError(
            f"{folder}: config.json has model_type {MODEL_TYPE!r} but no backbone_hf_config / "
            "sequence_head objects; it was not written by flaxheads' export"
        )
    fam = family_for(bcfg.get("model_type"))
    if fam is None:
        raise ModelImportError(
            f"{folder}: the backbone's model_type {bcfg.get('model_type')!r} has no native "
            f"flaxheads backbone (native: {', '.join(native_model_types())})"
        )
    try:
        seq_head = _config.from_dict(dict(raw["sequence_head"]))
    except (ValueError, TypeError, ConfigError) as e:
        raise ModelImportError(f"{folder}: config.json's sequence_head is not a flaxheads pooler + head: {e}") from None
    state = read_state_dict(folder)
    prefix = BACKBONE + "."
    backbone_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    head_state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    try:
        backbone = fam.from_state(HFConfig(bcfg), backbone_state, dtype=dtype, remat=remat, source=folder, plan=plan)
    except BackboneError as e:
        raise ModelImportError(str(e)) from None
    head_params = _head_params(seq_head, backbone.hidden_size, head_state, folder)
    n = int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 2)
    labels = {int(k): str(v) for k, v in (raw.get("id2label") or {}).items()} or None
    pool_mask = raw.get("pool_mask", "attention_mask")
    pad, eos = getattr(backbone.config, "pad_token_id", None), getattr(backbone.config, "eos_token_id", None)
    if pool_mask == "non_pad_token":
        pad = raw.get("pool_token_id", pad)
    elif pool_mask == "eos_token":
        eos = raw.get("pool_token_id", eos)
    params = {"backbone": backbone.params, "head": head_params}
    return SequenceModel(
        backbone=backbone,
        head=seq_head,
        num_labels=n,
        problem_type=raw.get("problem_type") or infer_problem_type(n),
        params=params,
        id2label=labels,
        pool_mask=pool_mask,
        pad_token_id=pad,
        eos_token_id=eos,
        name_or_path=folder,
        report=LoadReport(pretrained=[(p, p.replace("/", ".")) for p in _module_paths(head_params)]),
    )


def threshold_of(folder: str) -> float | None:
    """The multi-label threshold a flaxheads transformers folder records (None for other folders)."""
    import json

    p = os.path.join(folder, "config.json")
    try:
        with open(p) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return float(raw["threshold"]) if is_flaxheads_config(raw) and raw.get("threshold") is not None else None
