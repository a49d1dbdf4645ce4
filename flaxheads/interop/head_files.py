"""A head on its own, both ways: ``head.safetensors`` (PyTorch names, [out, in] weights) +
``head_config.json`` (the flaxheads head config, its param shapes and the model's meta).

Any head fits, so this is the way out for heads neither a transformers nor a
sentence-transformers folder can express. Modules of an HF preset carry that preset's PyTorch
names, so the file loads into the PyTorch head modules with ``load_state_dict(..., strict=False)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from flaxheads import config as _config
from flaxheads._version import __version__
from flaxheads.backbones.weights import head_to_hf
from flaxheads.disk.files import write_json
from flaxheads.heads.heads import SequenceHead
from flaxheads.heads.presets import match_preset
from flaxheads.interop.files import (
    ExportError,
    ImportNotFoundError,
    ModelImportError,
    atomic_dir,
    flatten,
    flax_to_pytorch_names,
    np_tree,
    pytorch_to_flax_leaf,
    read_json,
    save_safetensors,
)

HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"
HEAD_FORMAT = "flaxheads-head"
# checkpoint meta keys a head_config.json does not repeat (it states them itself)
_NOT_COPIED = {"head_config", "head_shapes", "head_shapes_hash", "library", "library_version"}


def head_state_dict(head_params: Mapping, hf_names=()) -> dict[str, np.ndarray]:
    """HF names for the modules a preset maps (``hf_names``), generic names for the rest."""
    hp = np_tree(head_params)
    out = head_to_hf(hp, hf_names) if hf_names else {}
    mapped = {tuple(p.split("/")) for p, _ in hf_names}
    rest: dict[str, dict] = {}
    for k, v in flatten(hp).items():
        if k[:-1] not in mapped:
            rest.setdefault(".".join(map(str, k[:-1])), {})[k[-1]] = v
    out.update(flax_to_pytorch_names(rest))
    return out


def _is_model(source) -> bool:
    return hasattr(source, "backbone") and hasattr(source, "num_labels")


def _meta_of(source) -> dict:
    """What ``head_config.json`` says about the model: a SequenceModel's facts, or a checkpoint's meta."""
    if _is_model(source):
        return dict(
            num_labels=source.num_labels,
            problem_type=source.problem_type,
            id2label={str(k): v for k, v in (source.id2label or {}).items()} or None,
            hidden_size=source.hidden_size,
            backbone_model_type=source.backbone.config.model_type,
            backbone_name_or_path=source.name_or_path,
            pool_mask=source.pool_mask,
            pad_token_id=source.pad_token_id,
            eos_token_id=source.eos_token_id,
            arch=source.arch,
        )
    return dict(getattr(source, "meta", None) or {})


def _hf_names_of(source, info: Mapping) -> tuple[tuple[str, str], ...]:
    """The preset names the source records; for a model, else whether its head is its backbone's preset."""
    names = getattr(source, "hf_names", ()) or [tuple(x) for x in info.get("hf_names") or ()]
    if not names and _is_model(source):
        names = match_preset(
            source.backbone.config, source.num_labels, source.head.pooler, source.head.head, source.pool_mask
        ).hf_names
    return tuple(tuple(x) for x in names)


def export_head(
    source,
    out: str | os.PathLike,
    *,
    params: Mapping | None = None,
    meta: Mapping | None = None,
    hf_names=None,
    overwrite: bool = False,
) -> str:
    """Write ``head.safetensors`` + ``head_config.json`` for any head; returns ``out``.

    ``source``: a :class:`SequenceModel`, a checkpoint's ``HeadCheckpoint`` (``.head``,
    ``.params``, ``.meta``), or a bare :class:`SequenceHead` with ``params`` (its head
    params ``{"pooler": ..., "head": ...}``). Modules of an HF preset get the PyTorch
    names of that preset (``hf_names``; by default the ones the source records, or its
    backbone's preset when the head is exactly that)."""
    if isinstance(source, SequenceHead):
        head = source
        if params is None:
            raise ExportError(
                "export_head(SequenceHead, ...) needs params= (the head params {'pooler': ..., 'head': ...})"
            )
        hp = params
    else:
        head = source.head
        p = params if params is not None else source.params
        hp = p["head"] if "backbone" in p else p  # full params, or already the head subtree
    info = {**_meta_of(source), **dict(meta or {})}
    hf_names = _hf_names_of(source, info) if hf_names is None else tuple(tuple(x) for x in hf_names)
    own = {
        "format": HEAD_FORMAT,
        "flaxheads_version": __version__,
        "sequence_head": _config.to_dict(head),
        "hf_names": [list(x) for x in hf_names],
        "params": {"/".join(map(str, k)): list(np.shape(v)) for k, v in flatten(np_tree(hp)).items()},
    }
    # a checkpoint's meta rides along, minus what this file states itself
    cfg = {**own, **{k: v for k, v in info.items() if k not in set(own) | _NOT_COPIED}}
    state = head_state_dict(hp, hf_names)
    with atomic_dir(out, overwrite) as tmp:
        save_safetensors(state, os.path.join(tmp, HEAD_WEIGHTS))
        write_json(os.path.join(tmp, HEAD_CONFIG), cfg)
    return os.fspath(out)


def load_head_export(folder: str | os.PathLike) -> tuple[SequenceHead, dict, dict]:
    """Read a head-only export back: ``(SequenceHead, head params, config)``."""
    from flaxheads.backbones.weights import read_safetensors

    folder = os.fspath(folder)
    cfg_path = os.path.join(folder, HEAD_CONFIG)
    if not os.path.isfile(cfg_path):
        raise ImportNotFoundError(f"{folder!r} has no {HEAD_CONFIG}; is it a flaxheads head export?")
    cfg = read_json(cfg_path)
    if cfg.get("format") != HEAD_FORMAT:
        raise ModelImportError(
            f"{cfg_path}: format is {cfg.get('format')!r}, expected {HEAD_FORMAT!r}; "
            "this folder was not written by flaxheads' export_head"
        )
    head = _config.from_dict(cfg["sequence_head"])
    state = read_safetensors(os.path.join(folder, HEAD_WEIGHTS))
    names = {p: n for p, n in cfg.get("hf_names", [])}
    params: dict = {}
    for path, shape in cfg["params"].items():
        *mod, leaf = path.split("/")
        v = pytorch_to_flax_leaf(state, names.get("/".join(mod), ".".join(mod)), leaf)
        if list(v.shape) != list(shape):
            raise ModelImportError(
                f"{folder}: {path} has shape {list(v.shape)} in {HEAD_WEIGHTS}, "
                f"{HEAD_CONFIG} says {shape}; the two files do not belong together"
            )
        node = params
        for m in mod:
            node = node.setdefault(m, {})
        node[leaf] = v
    return head, params, cfg
