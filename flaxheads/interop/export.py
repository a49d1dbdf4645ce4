"""Export flaxheads models to PyTorch layouts, with numpy only (no torch needed).

Three formats:

* ``transformers``: ``config.json`` + ``model.safetensors`` (+ tokenizer files) that
  ``AutoModelForSequenceClassification.from_pretrained`` loads with no missing or
  unexpected keys, for models whose pooler + head is exactly an HF preset.
* ``sentence-transformers``: ``modules.json``, the Transformer files at the root,
  ``1_Pooling/config.json``, ``k_Dense/`` per dense layer, ``k_Normalize``, for a
  sentence-transformers pooling mode (or a concatenation of them), optionally preceded
  by a token-pick dense pooler, followed by dense layers and optional L2 normalisation.
* ``head``: ``head.safetensors`` (PyTorch names, [out, in] weights) + ``head_config.json``
  for any head; the way out for heads neither format above can express.

Every export writes into a temporary folder beside ``out`` and renames it into place, so
an error never leaves a half-written ``out`` behind.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any, Iterator, Mapping

import numpy as np

from .. import config as _config
from ..errors import FlaxheadsError
from ..nn.heads import IdentityHead, LinearHead, MLPHead, ProjectionHead, SequenceHead
from ..backbones.weights import head_to_hf
from ..nn.poolers import Concat, DensePooler, Pool
from ..presets import PRESETS

FORMATS = ("transformers", "sentence-transformers", "head")
HEAD_WEIGHTS = "head.safetensors"
HEAD_CONFIG = "head_config.json"
HEAD_FORMAT = "flaxheads-head"

# PyTorch ``base_model_prefix`` of each preset's XForSequenceClassification (no torch import needed).
PT_BASE_PREFIX = {"bert": "bert", "albert": "albert", "roberta": "roberta", "xlm-roberta": "roberta",
                  "electra": "electra", "distilbert": "distilbert", "gpt2": "transformer", "bart": "model"}
# The config key each PyTorch class reads its classifier dropout from.
_DROPOUT_KEY = {"bert": "classifier_dropout", "albert": "classifier_dropout_prob",
                "roberta": "classifier_dropout", "xlm-roberta": "classifier_dropout",
                "electra": "classifier_dropout", "distilbert": "seq_classif_dropout", "bart": "classifier_dropout"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model")

# flaxheads pool mode -> sentence-transformers pooling mode. ST's "cls" is the first token the
# attention mask keeps: equal to flaxheads "cls" (position 0) under right padding.
ST_POOL_MODES = {"cls": "cls", "first_non_pad": "cls", "max": "max", "mean": "mean",
                 "mean_sqrt_len": "mean_sqrt_len_tokens", "weighted_mean": "weightedmean", "last": "lasttoken"}
# The legacy ``pooling_mode_*`` keys, in the fixed order sentence-transformers concatenates them.
ST_LEGACY_KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                  "mean": "pooling_mode_mean_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
                  "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
ST_LEGACY_ORDER = tuple(ST_LEGACY_KEYS)
# activation name -> the torch class sentence-transformers' Dense instantiates (with no arguments).
ST_ACTIVATIONS = {None: "torch.nn.modules.linear.Identity", "linear": "torch.nn.modules.linear.Identity",
                  "identity": "torch.nn.modules.linear.Identity", "tanh": "torch.nn.modules.activation.Tanh",
                  "relu": "torch.nn.modules.activation.ReLU", "gelu": "torch.nn.modules.activation.GELU",
                  "sigmoid": "torch.nn.modules.activation.Sigmoid", "silu": "torch.nn.modules.activation.SiLU",
                  "swish": "torch.nn.modules.activation.SiLU"}


class ExportError(FlaxheadsError):
    """The model cannot be written in the requested format (the message says which format can)."""


# ---- atomic output folder -----------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary folder beside ``out``; rename it to ``out`` only if the block succeeds."""
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)) and not overwrite:
        raise FileExistsError(f"output folder {out!r} already exists and is not empty; pass overwrite=True "
                              "(--overwrite) to replace it, or choose a new folder")
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def _save_safetensors(tensors: Mapping[str, np.ndarray], path: str) -> None:
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in tensors.items()}, path,
              metadata={"format": "pt"})


def _np_tree(tree):
    import jax

    return jax.tree.map(lambda x: np.asarray(jax.device_get(x), dtype=np.float32), tree)


def _flatten(tree: Mapping, prefix: tuple = ()) -> dict[tuple, Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


# ---- Flax -> PyTorch names ------------------------------------------------------------------
def flax_to_pytorch_names(params: Mapping, prefix: str = "") -> dict[str, np.ndarray]:
    """Flax params -> PyTorch state dict by Hugging Face's naming rule (the inverse of its
    ``convert_pytorch_state_dict_to_flax``): ``kernel`` -> ``weight`` transposed to [out, in],
    ``scale``/``embedding`` -> ``weight``, path parts joined with dots."""
    out = {}
    for key, v in _flatten(params).items():
        v = np.asarray(v)
        *path, leaf = key
        if leaf == "kernel":
            v = np.transpose(v, (3, 2, 0, 1)) if v.ndim == 4 else v.T
            leaf = "weight"
        elif leaf in ("scale", "embedding"):
            leaf = "weight"
        name = ".".join([prefix] * bool(prefix) + [str(p) for p in path] + [leaf])
        out[name] = np.ascontiguousarray(v)
    return out


def _check_backbone_roundtrip(backbone, backbone_params, state: Mapping[str, np.ndarray]) -> None:
    """The exported backbone names must convert back (HF's own PyTorch->Flax rule) to exactly the params."""
    from flax.traverse_util import flatten_dict
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

    back = flatten_dict(convert_pytorch_state_dict_to_flax(dict(state), backbone))
    want = flatten_dict(_np_tree(backbone_params))
    bad = [k for k in want if k not in back or np.shape(back[k]) != np.shape(want[k])
           or not np.array_equal(np.asarray(back[k]), want[k])]
    if bad:
        raise ExportError(f"{backbone.config.model_type}: {len(bad)} backbone weights do not survive the "
                          f"Flax -> PyTorch renaming (e.g. {['/'.join(map(str, k)) for k in bad[:3]]}); "
                          "this backbone cannot be exported to PyTorch yet. Export the head alone with "
                          "format='head'.")


def backbone_state_dict(model, params: Mapping | None = None, prefix: str = "") -> dict[str, np.ndarray]:
    """The backbone's weights under PyTorch names (checked to convert back exactly).

    A native backbone names its own weights (:meth:`~flaxheads.backbones.base.Backbone.state_from_params`);
    HF's Flax wrappers go through transformers' renaming rule."""
    from ..backbones.base import Backbone

    bp = (params or model.params)["backbone"]
    if isinstance(model.backbone, Backbone):
        state = model.backbone.state_from_params(_np_tree(bp))
        back = _flatten(_np_tree(type(model.backbone).params_from_state(model.backbone.config, state)))
        want = _flatten(_np_tree(bp))
        if set(back) != set(want) or any(not np.array_equal(back[k], want[k]) for k in want):
            raise ExportError(f"{model.model_type}: the backbone's PyTorch names do not convert back to its params; "
                              "this is a bug in flaxheads' name map. Export the head alone with format='head'.")
    else:
        state = flax_to_pytorch_names(_np_tree(bp))
        _check_backbone_roundtrip(model.backbone, bp, state)
    return {f"{prefix}.{k}" if prefix else k: v for k, v in state.items()}


def _transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


# ---- transformers -------------------------------------------------------------------------------
def _preset(model):
    make = PRESETS.get(model.model_type)
    return None if make is None else make(model.backbone.config, model.num_labels)


def transformers_config(model) -> dict:
    """``config.json`` of the PyTorch XForSequenceClassification equal to ``model``."""
    preset = _preset(model)
    cfg = model.backbone.config.to_dict()
    for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(k, None)
    labels = model.id2label or {i: f"LABEL_{i}" for i in range(model.num_labels)}
    cfg.update(architectures=[preset.hf_class], num_labels=model.num_labels,
               id2label={str(i): labels[i] for i in sorted(labels)},
               label2id={labels[i]: i for i in sorted(labels)}, problem_type=model.problem_type)
    key = _DROPOUT_KEY.get(model.arch)
    if key is not None:
        cfg[key] = float(model.head.head.dropout)
    if _transformers_version():
        cfg["transformers_version"] = _transformers_version()
    cfg["torch_dtype"] = "float32"
    return cfg


def check_transformers_exportable(model) -> None:
    """Raise :class:`ExportError` unless ``model`` is exactly an HF preset with a PyTorch class."""
    where = ("Export it with format='sentence-transformers' (pooling + dense layers + normalize) or "
             "format='head' (head.safetensors + head_config.json, any head).")
    if getattr(model, "backbone", None) is None:
        raise ExportError(f"a transformers export needs the backbone weights; this source has only a head. {where}")
    if model.arch is None or model.arch not in PT_BASE_PREFIX:
        kind = f"{type(model.head.pooler).__name__} + {type(model.head.head).__name__}"
        raise ExportError(
            f"the head ({kind}) on this {model.model_type} backbone is not the Hugging Face "
            f"{model.model_type} sequence-classification head, so no PyTorch XForSequenceClassification "
            f"class can load it (HF-exact presets with a Flax backbone: {sorted(PT_BASE_PREFIX)}). {where}")
    preset = _preset(model)
    if model.pool_mask != preset.pool_mask:
        raise ExportError(f"{preset.hf_class} pools by {preset.pool_mask!r} but this model pools by "
                          f"{model.pool_mask!r}: PyTorch would give other logits. {where}")


def transformers_state_dict(model, params: Mapping | None = None) -> dict[str, np.ndarray]:
    """The full PyTorch state dict (backbone under its base prefix + head modules)."""
    check_transformers_exportable(model)
    params = params or model.params
    state = backbone_state_dict(model, params, prefix=PT_BASE_PREFIX[model.arch])
    state.update(head_to_hf(_np_tree(params["head"]), _preset(model).hf_names))
    return state


def _copy_tokenizer(src: str | None, dst: str) -> list[str]:
    if not src or not os.path.isdir(src):
        return []
    copied = []
    for name in TOKENIZER_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, name))
            copied.append(name)
    return copied


def export_transformers(model, out: str | os.PathLike, *, params: Mapping | None = None,
                        tokenizer_from: str | os.PathLike | None = None, overwrite: bool = False) -> str:
    """Write ``model`` as a PyTorch ``XForSequenceClassification`` folder; returns ``out``.

    Needs an HF-exact preset head (``model.arch``); tokenizer files are copied from
    ``tokenizer_from`` (default: the folder the model was loaded from) when present."""
    state = transformers_state_dict(model, params)
    cfg = transformers_config(model)
    with atomic_dir(out, overwrite) as tmp:
        _write_json(os.path.join(tmp, "config.json"), cfg)
        _save_safetensors(state, os.path.join(tmp, "model.safetensors"))
        _copy_tokenizer(os.fspath(tokenizer_from) if tokenizer_from else model.name_or_path, tmp)
    return os.fspath(out)


# ---- sentence-transformers ------------------------------------------------------------------------
def _st_pool_modes(pooler) -> tuple[list[str], list[dict]]:
    """(ST pooling modes in flaxheads order, dense layers the pooler itself applies)."""
    why = ("sentence-transformers Pooling supports cls, max, mean, mean_sqrt_len, weighted_mean, last and their "
           "concatenation (optionally a token pick -> dense -> activation, as BERT's pooler)")
    if isinstance(pooler, Pool):
        if pooler.mode not in ST_POOL_MODES:
            raise ExportError(f"pool mode {pooler.mode!r} has no sentence-transformers equivalent ({why}). "
                              "Export with format='head' instead.")
        return [ST_POOL_MODES[pooler.mode]], []
    if isinstance(pooler, Concat):
        modes = []
        for p in pooler.parts:
            if not isinstance(p, Pool):
                raise ExportError(f"a concatenation containing {type(p).__name__} has no sentence-transformers "
                                  f"equivalent ({why}). Export with format='head' instead.")
            modes += _st_pool_modes(p)[0]
        if len(set(modes)) != len(modes):
            raise ExportError(f"pooling modes {modes} repeat a mode; sentence-transformers concatenates each "
                              "mode once. Export with format='head' instead.")
        return modes, []
    if isinstance(pooler, DensePooler) and pooler.source in ST_POOL_MODES:
        return [ST_POOL_MODES[pooler.source]], [dict(path=("pooler", "dense"), activation=pooler.activation,
                                                      bias=True)]
    raise ExportError(f"pooler {type(pooler).__name__} has no sentence-transformers equivalent ({why}). "
                      "Export with format='head' (head.safetensors + head_config.json) instead.")


def _st_head_layers(head) -> tuple[list[dict], bool]:
    """(dense layers of the head, normalize?)."""
    if isinstance(head, IdentityHead):
        return [], bool(getattr(head, "normalize", False))
    if isinstance(head, ProjectionHead):
        return [dict(path=("head", f"dense_{i}"), activation=head.activation, bias=head.use_bias)
                for i in range(len(head.widths))], head.normalize
    if isinstance(head, LinearHead):
        return [dict(path=("head", "classifier"), activation=None, bias=head.use_bias)], False
    if isinstance(head, MLPHead) and not head.layer_norm:
        return ([dict(path=("head", f"dense_{i}"), activation=head.activation, bias=head.dense_bias)
                 for i in range(len(head.hidden_dims))]
                + [dict(path=("head", "out_proj"), activation=None, bias=True)]), False
    raise ExportError(f"head {type(head).__name__}"
                      f"{' with layer_norm' if isinstance(head, MLPHead) else ''} has no sentence-transformers "
                      "equivalent (Dense layers with one activation each, then optional Normalize). Export with "
                      "format='head' (head.safetensors + head_config.json) instead.")


def _st_activation(name: str | None) -> str:
    if name not in ST_ACTIVATIONS:
        raise ExportError(f"activation {name!r} has no torch class sentence-transformers' Dense can build "
                          f"(supported: {sorted(k for k in ST_ACTIVATIONS if k)} or None). Export with "
                          "format='head' instead.")
    return ST_ACTIVATIONS[name]


def sentence_transformers_modules(model, params: Mapping | None = None, pooling_format: str = "legacy"):
    """(pooling config, [(dense config, {"linear.weight", "linear.bias"})], normalize) for ``model``.

    ``pooling_format="legacy"`` writes ``word_embedding_dimension`` + ``pooling_mode_*`` booleans,
    which every sentence-transformers version reads but concatenates in its fixed order
    (cls, max, mean, mean_sqrt_len, weightedmean, lasttoken): a different flaxheads order is
    reordered by permuting the first dense layer's inputs, or rejected when there is none.
    ``"v6"`` writes ``embedding_dimension`` + ``pooling_mode`` (a list, kept in order)."""
    if pooling_format not in ("legacy", "v6"):
        raise ValueError(f"pooling_format must be 'legacy' or 'v6', got {pooling_format!r}")
    if model.pool_mask != "attention_mask":
        raise ExportError(f"this model pools by {model.pool_mask!r}, but sentence-transformers pools by the "
                          "attention mask. Export with format='transformers' (if an HF preset) or 'head'.")
    hp = _np_tree((params or model.params)["head"])
    modes, layers = _st_pool_modes(model.head.pooler)
    head_layers, normalize = _st_head_layers(model.head.head)
    layers = layers + head_layers
    h = model.hidden_size
    dense = []
    for layer in layers:
        node = hp
        for p in layer["path"]:
            node = node[p]
        w = np.asarray(node["kernel"]).T
        weights = {"linear.weight": w}
        if layer["bias"]:
            weights["linear.bias"] = np.asarray(node["bias"])
        dense.append([dict(in_features=int(w.shape[1]), out_features=int(w.shape[0]), bias=bool(layer["bias"]),
                           activation_function=_st_activation(layer["activation"])), weights])
    if pooling_format == "v6":
        pool_cfg = {"embedding_dimension": h, "pooling_mode": modes[0] if len(modes) == 1 else list(modes),
                    "include_prompt": True}
    else:
        order = [m for m in ST_LEGACY_ORDER if m in modes]
        if order != modes:
            if not dense:
                raise ExportError(
                    f"pooling modes {modes} are concatenated in this order, but sentence-transformers' "
                    f"pooling_mode_* keys concatenate in its fixed order {order}, and no dense layer follows "
                    "whose inputs could be reordered. Build the pooler in that order, or pass "
                    "pooling_format='v6' (needs a sentence-transformers that reads `pooling_mode`).")
            w = dense[0][1]["linear.weight"]
            blocks = {m: w[:, i * h:(i + 1) * h] for i, m in enumerate(modes)}
            dense[0][1]["linear.weight"] = np.concatenate([blocks[m] for m in order], axis=1)
        pool_cfg = {"word_embedding_dimension": h, **{ST_LEGACY_KEYS[m]: m in modes for m in ST_LEGACY_ORDER},
                    "include_prompt": True}
    return pool_cfg, dense, normalize


def _unused_pooler_tensors(model, params: Mapping | None, have: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The PyTorch base model's own pooler (BERT & co. build one that sentence-transformers never
    uses; the Flax backbone skips it): written so PyTorch reports no freshly initialised weights.
    Taken from the model's BERT-preset pooler, else from the source folder's safetensors."""
    out: dict[str, np.ndarray] = {}
    names = dict(getattr(model, "hf_names", ()) or ())
    hp = (params or model.params)["head"]
    if names.get("pooler/dense", "").endswith(".pooler.dense") and "pooler" in hp:
        got = head_to_hf(_np_tree(hp), (("pooler/dense", names["pooler/dense"]),))
        return {k.split(".", 1)[1]: v for k, v in got.items()}
    src = os.path.join(model.name_or_path or "", "model.safetensors")
    if not os.path.isfile(src):
        return out
    from safetensors import safe_open

    with safe_open(src, "np") as f:
        for k in f.keys():
            parts = k.split(".")
            short = ".".join(parts[1:]) if len(parts) > 1 and parts[1] == "pooler" else k
            if short.startswith("pooler.") and short not in have:
                out[short] = f.get_tensor(k)
    return out


def export_sentence_transformers(model, out: str | os.PathLike, *, params: Mapping | None = None,
                                 tokenizer_from: str | os.PathLike | None = None, pooling_format: str = "legacy",
                                 max_seq_length: int | None = None, overwrite: bool = False) -> str:
    """Write ``model`` as a sentence-transformers folder; returns ``out``.

    Transformer files (config, backbone safetensors without a prefix, tokenizer) at the
    root, ``1_Pooling``, one ``k_Dense`` per dense layer (pooler's, then head's), and
    ``k_Normalize``. The tokenizer files are required (sentence-transformers tokenizes)."""
    if getattr(model, "backbone", None) is None:
        raise ExportError("a sentence-transformers export needs the backbone weights; this source has only a "
                          "head. Use format='head'.")
    pool_cfg, dense, normalize = sentence_transformers_modules(model, params, pooling_format)
    state = backbone_state_dict(model, params)
    state.update(_unused_pooler_tensors(model, params, state))
    src = os.fspath(tokenizer_from) if tokenizer_from else model.name_or_path
    with atomic_dir(out, overwrite) as tmp:
        if not _copy_tokenizer(src, tmp):
            raise ExportError(f"no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...) in {src!r}; "
                              "sentence-transformers needs them: pass tokenizer_from=<folder with the tokenizer> "
                              "(--tokenizer)")
        cfg = model.backbone.config.to_dict()
        for k in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
            cfg.pop(k, None)
        cfg.update(torch_dtype="float32")
        if _transformers_version():
            cfg["transformers_version"] = _transformers_version()
        _write_json(os.path.join(tmp, "config.json"), cfg)
        _save_safetensors(state, os.path.join(tmp, "model.safetensors"))
        sbert = {"max_seq_length": max_seq_length, "do_lower_case": False}
        old = os.path.join(src or "", "sentence_bert_config.json")
        if max_seq_length is None and os.path.isfile(old):
            with open(old) as f:
                sbert = {**sbert, **{k: v for k, v in json.load(f).items() if k in ("max_seq_length", "do_lower_case")}}
        if sbert["max_seq_length"] is None:
            del sbert["max_seq_length"]
        _write_json(os.path.join(tmp, "sentence_bert_config.json"), sbert)
        modules = [dict(idx=0, name="0", path="", type="sentence_transformers.models.Transformer"),
                   dict(idx=1, name="1", path="1_Pooling", type="sentence_transformers.models.Pooling")]
        os.makedirs(os.path.join(tmp, "1_Pooling"))
        _write_json(os.path.join(tmp, "1_Pooling", "config.json"), pool_cfg)
        for cfg_d, weights in dense:
            i = len(modules)
            path = f"{i}_Dense"
            os.makedirs(os.path.join(tmp, path))
            _write_json(os.path.join(tmp, path, "config.json"), cfg_d)
            _save_safetensors(weights, os.path.join(tmp, path, "model.safetensors"))
            modules.append(dict(idx=i, name=str(i), path=path, type="sentence_transformers.models.Dense"))
        if normalize:
            i = len(modules)
            os.makedirs(os.path.join(tmp, f"{i}_Normalize"))
            modules.append(dict(idx=i, name=str(i), path=f"{i}_Normalize",
                                type="sentence_transformers.models.Normalize"))
        _write_json(os.path.join(tmp, "modules.json"), modules)
        _write_json(os.path.join(tmp, "config_sentence_transformers.json"),
                    {"__version__": {"transformers": _transformers_version() or "unknown"},
                     "similarity_fn_name": "cosine"})
    return os.fspath(out)


# ---- head only ----------------------------------------------------------------------------------------
def head_state_dict(head_params: Mapping, hf_names=()) -> dict[str, np.ndarray]:
    """HF names for the modules a preset maps (``hf_names``), generic names for the rest."""
    hp = _np_tree(head_params)
    out = head_to_hf(hp, hf_names) if hf_names else {}
    mapped = {tuple(p.split("/")) for p, _ in hf_names}
    rest: dict[str, dict] = {}
    for k, v in _flatten(hp).items():
        if k[:-1] not in mapped:
            rest.setdefault(".".join(map(str, k[:-1])), {})[k[-1]] = v
    out.update(flax_to_pytorch_names(rest))
    return out


def _meta_of(source) -> dict:
    if hasattr(source, "backbone") and hasattr(source, "num_labels"):
        cfg = source.backbone.config
        return dict(num_labels=source.num_labels, problem_type=source.problem_type,
                    id2label={str(k): v for k, v in (source.id2label or {}).items()} or None,
                    hidden_size=source.hidden_size, backbone_model_type=cfg.model_type,
                    backbone_name_or_path=source.name_or_path, pool_mask=source.pool_mask,
                    pad_token_id=source.pad_token_id, eos_token_id=source.eos_token_id, arch=source.arch)
    return dict(getattr(source, "meta", None) or {})


def export_head(source, out: str | os.PathLike, *, params: Mapping | None = None, meta: Mapping | None = None,
                hf_names=None, overwrite: bool = False) -> str:
    """Write ``head.safetensors`` + ``head_config.json`` for any head; returns ``out``.

    ``source``: a :class:`SequenceModel`, a checkpoint's ``HeadCheckpoint`` (``.head``,
    ``.params``, ``.meta``), or a bare :class:`SequenceHead` with ``params`` (its head
    params ``{"pooler": ..., "head": ...}``). Modules of an HF preset get the PyTorch
    names of that preset (``hf_names``; from the model's ``arch`` when not given), so the
    file loads into the PyTorch head modules with ``load_state_dict(..., strict=False)``."""
    if isinstance(source, SequenceHead):
        head = source
        if params is None:
            raise ValueError("export_head(SequenceHead, ...) needs params= (the head params)")
        hp = params
    else:
        head = source.head
        p = params if params is not None else source.params
        hp = p["head"] if "backbone" in p else p  # full params, or already the head subtree
    info = {**_meta_of(source), **dict(meta or {})}
    if hf_names is None:
        hf_names = getattr(source, "hf_names", ()) or [tuple(x) for x in info.get("hf_names") or ()]
        arch = info.get("arch")
        if not hf_names and arch in PRESETS and getattr(source, "backbone", None) is not None:
            hf_names = PRESETS[arch](source.backbone.config, info.get("num_labels", 2)).hf_names
    state = head_state_dict(hp, tuple(hf_names))
    from .. import __version__

    own = {"format": HEAD_FORMAT, "flaxheads_version": __version__, "sequence_head": _config.to_dict(head),
           "hf_names": [list(x) for x in hf_names],
           "params": {"/".join(map(str, k)): list(np.shape(v)) for k, v in _flatten(_np_tree(hp)).items()}}
    # a checkpoint's meta rides along, minus what this file states itself
    skip = set(own) | {"head_config", "head_shapes", "head_shapes_hash", "library", "library_version"}
    cfg = {**own, **{k: v for k, v in info.items() if k not in skip}}
    with atomic_dir(out, overwrite) as tmp:
        _save_safetensors(state, os.path.join(tmp, HEAD_WEIGHTS))
        _write_json(os.path.join(tmp, HEAD_CONFIG), _jsonable(cfg))
    return os.fspath(out)


def _jsonable(x):
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def load_head_export(folder: str | os.PathLike) -> tuple[SequenceHead, dict, dict]:
    """Read a head-only export back: ``(SequenceHead, head params, config)``."""
    from safetensors.numpy import load_file

    folder = os.fspath(folder)
    cfg_path = os.path.join(folder, HEAD_CONFIG)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{folder!r} has no {HEAD_CONFIG}; is it a flaxheads head export?")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("format") != HEAD_FORMAT:
        raise ValueError(f"{cfg_path}: format is {cfg.get('format')!r}, expected {HEAD_FORMAT!r}")
    head = _config.from_dict(cfg["sequence_head"])
    state = load_file(os.path.join(folder, HEAD_WEIGHTS))
    names = {p: n for p, n in cfg.get("hf_names", [])}
    params: dict = {}
    for path, shape in cfg["params"].items():
        *mod, leaf = path.split("/")
        mod_path = "/".join(mod)
        base = names.get(mod_path, ".".join(mod))
        if leaf == "kernel":
            v = state[f"{base}.weight"]
            v = np.transpose(v, (2, 3, 1, 0)) if v.ndim == 4 else v.T
        elif leaf in ("scale", "embedding"):
            v = state[f"{base}.weight"]
        else:
            v = state[f"{base}.{leaf}" if base else leaf]
        if list(v.shape) != list(shape):
            raise ValueError(f"{folder}: {path} has shape {list(v.shape)} in {HEAD_WEIGHTS}, config says {shape}")
        node = params
        for m in mod:
            node = node.setdefault(m, {})
        node[leaf] = v
    return head, params, cfg


# ---- Orbax checkpoints ------------------------------------------------------------------------------------
def model_from_checkpoint(directory: str | os.PathLike, step: int | str | None = None, *,
                          backbone: str | os.PathLike | None = None, head_only: bool = False):
    """The model saved in a run / checkpoint folder, ready to export.

    ``head_only=True`` returns the ``HeadCheckpoint`` (enough for ``export_head``). Otherwise
    the backbone comes from the checkpoint's ``backbone`` item when it was trained and saved,
    on top of the backbone folder ``backbone`` (default: ``meta["backbone_name_or_path"]``)."""
    from .. import checkpoint as ck
    from ..model import from_pretrained

    step = int(step) if isinstance(step, str) and step.isdigit() else step
    ckpt = ck.load_head(directory, step)
    if head_only:
        return ckpt
    meta = ckpt.meta
    path = os.fspath(backbone) if backbone else meta.get("backbone_name_or_path")
    if not path or not os.path.isdir(path):
        raise FileNotFoundError(
            f"{ckpt.path}: the backbone folder {path!r} (recorded in the checkpoint's meta) does not exist here; "
            "pass backbone=<folder> (--backbone) with the same backbone, or export the head alone with "
            "format='head'")
    base = from_pretrained(path, num_labels=int(meta["num_labels"]), ignore_mismatched_sizes=True)
    if base.model_type != meta.get("backbone_model_type", base.model_type):
        raise ValueError(f"{ckpt.path}: the head was trained on a {meta['backbone_model_type']} backbone, but "
                         f"{path!r} is a {base.model_type}")
    model = ck.attach_head(base, ckpt)
    if meta.get("backbone_saved"):
        if hasattr(ck, "load_backbone_params"):
            bb = ck.load_backbone_params(directory, ckpt.step, target=model.params["backbone"])
        else:  # older checkpoint module without the public helper
            root, _ = ck.resolve_root(directory)
            mgr = ck._manager(root, read_only=True)
            try:
                import jax

                dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                bb = ck._restore_arrays(mgr, root, ckpt.step,
                                        {ck.BACKBONE: ck._abstract(model.params["backbone"], dev)})[ck.BACKBONE]
            finally:
                mgr.close()
        model = dataclasses.replace(model, params={"backbone": bb, "head": model.params["head"]})
    return dataclasses.replace(model, name_or_path=path)


# ---- dispatcher ---------------------------------------------------------------------------------------
def export(source, out: str | os.PathLike, format: str = "transformers", **options) -> str:  # noqa: A002
    """Export ``source`` in ``format`` (``transformers``, ``sentence-transformers``, ``head``)."""
    if format == "transformers":
        return export_transformers(source, out, **options)
    if format in ("sentence-transformers", "sentence_transformers", "st"):
        return export_sentence_transformers(source, out, **options)
    if format == "head":
        return export_head(source, out, **options)
    raise ValueError(f"unknown export format {format!r}; valid formats: {FORMATS}")
