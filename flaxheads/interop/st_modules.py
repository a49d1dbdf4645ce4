"""The sentence-transformers modules, both ways: the Pooling, Dense and Normalize folders of
:mod:`flaxheads.interop.sentence_transformers`, built from a flaxheads pooler and head on export
and read back (checked against their configs) on import.

The Transformer files at the folder's root, the folder as a whole (``export_sentence_transformers``,
``load_sentence_transformers``) and its prompts stay in :mod:`flaxheads.interop.sentence_transformers`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from flaxheads.backbones.weights import BIN, SAFE, head_to_hf, read_torch_bin
from flaxheads.disk.files import write_json
from flaxheads.heads.heads import IdentityHead, LinearHead, MLPHead, ProjectionHead
from flaxheads.heads.poolers import Concat, DensePooler, Pool
from flaxheads.heads.presets import match_preset
from flaxheads.interop.files import ExportError, ModelImportError, np_tree, read_json, save_safetensors
from flaxheads.interop.transformers import read_config

# flaxheads pool mode -> sentence-transformers pooling mode.
ST_POOL_MODES = {
    "cls": "cls",
    "first_non_pad": "cls",
    "max": "max",
    "mean": "mean",
    "mean_sqrt_len": "mean_sqrt_len_tokens",
    "weighted_mean": "weightedmean",
    "last": "lasttoken",
}
# sentence-transformers pooling mode -> flaxheads pool mode (on import, "cls" is the first kept token).
ST_TO_POOL = {
    "cls": "first_non_pad",
    "max": "max",
    "mean": "mean",
    "mean_sqrt_len_tokens": "mean_sqrt_len",
    "weightedmean": "weighted_mean",
    "lasttoken": "last",
}
# The legacy ``pooling_mode_*`` keys, in the fixed order sentence-transformers concatenates them.
ST_LEGACY_KEYS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}
ST_LEGACY_ORDER = tuple(ST_LEGACY_KEYS)
_IDENTITY = "torch.nn.modules.linear.Identity"
# activation name -> the torch class sentence-transformers' Dense instantiates (with no arguments).
ST_ACTIVATIONS = {
    None: _IDENTITY,
    "linear": _IDENTITY,
    "identity": _IDENTITY,
    "tanh": "torch.nn.modules.activation.Tanh",
    "relu": "torch.nn.modules.activation.ReLU",
    "gelu": "torch.nn.modules.activation.GELU",
    "sigmoid": "torch.nn.modules.activation.Sigmoid",
    "silu": "torch.nn.modules.activation.SiLU",
    "swish": "torch.nn.modules.activation.SiLU",
}
# torch class -> activation name (first name wins; Identity is no activation).
_TORCH_TO_ACT = {cls: None if cls == _IDENTITY else name for name, cls in reversed(list(ST_ACTIVATIONS.items()))}
_HEAD_ONLY = "Export with format='head' (head.safetensors + head_config.json) instead."


# ---- export: modules ------------------------------------------------------------------------------------
def _st_pool_modes(pooler) -> tuple[list[str], list[dict]]:
    """(ST pooling modes in flaxheads order, dense layers the pooler itself applies)."""
    why = (
        "sentence-transformers Pooling supports cls, max, mean, mean_sqrt_len, weighted_mean, last and their "
        "concatenation (optionally a token pick -> dense -> activation, as BERT's pooler)"
    )
    if isinstance(pooler, Pool):
        if pooler.mode not in ST_POOL_MODES:
            raise ExportError(
                f"pool mode {pooler.mode!r} has no sentence-transformers equivalent ({why}). {_HEAD_ONLY}"
            )
        return [ST_POOL_MODES[pooler.mode]], []
    if isinstance(pooler, Concat):
        modes = []
        for p in pooler.parts:
            if not isinstance(p, Pool):
                raise ExportError(
                    f"a concatenation containing {type(p).__name__} has no sentence-transformers "
                    f"equivalent ({why}). {_HEAD_ONLY}"
                )
            modes += _st_pool_modes(p)[0]
        if len(set(modes)) != len(modes):
            raise ExportError(
                f"pooling modes {modes} repeat a mode; sentence-transformers concatenates each mode once. {_HEAD_ONLY}"
            )
        return modes, []
    if isinstance(pooler, DensePooler) and pooler.source in ST_POOL_MODES:
        return [ST_POOL_MODES[pooler.source]], [dict(path=("pooler", "dense"), activation=pooler.activation, bias=True)]
    raise ExportError(f"pooler {type(pooler).__name__} has no sentence-transformers equivalent ({why}). {_HEAD_ONLY}")


def _st_head_layers(head) -> tuple[list[dict], bool]:
    """(dense layers of the head, normalize?)."""
    if isinstance(head, IdentityHead):
        return [], bool(getattr(head, "normalize", False))
    if isinstance(head, ProjectionHead):
        return [
            dict(path=("head", f"dense_{i}"), activation=head.activation, bias=head.use_bias)
            for i in range(len(head.widths))
        ], head.normalize
    if isinstance(head, LinearHead):
        return [dict(path=("head", "classifier"), activation=None, bias=head.use_bias)], False
    if isinstance(head, MLPHead) and not head.layer_norm:
        return (
            [
                dict(path=("head", f"dense_{i}"), activation=head.activation, bias=head.dense_bias)
                for i in range(len(head.hidden_dims))
            ]
            + [dict(path=("head", "out_proj"), activation=None, bias=head.out_bias)]
        ), False
    raise ExportError(
        f"head {type(head).__name__}"
        f"{' with layer_norm' if isinstance(head, MLPHead) else ''} has no sentence-transformers "
        f"equivalent (Dense layers with one activation each, then optional Normalize). {_HEAD_ONLY}"
    )


def _st_activation(name: str | None) -> str:
    if name not in ST_ACTIVATIONS:
        raise ExportError(
            f"activation {name!r} has no torch class sentence-transformers' Dense can build "
            f"(supported: {sorted(k for k in ST_ACTIVATIONS if k)} or None). {_HEAD_ONLY}"
        )
    return ST_ACTIVATIONS[name]


def _dense_module(head_params: Mapping, layer: dict) -> list:
    """[Dense config.json, {"linear.weight", "linear.bias"}] of one dense layer."""
    node = head_params
    for p in layer["path"]:
        node = node[p]
    w = np.asarray(node["kernel"]).T
    weights = {"linear.weight": w}
    if layer["bias"]:
        weights["linear.bias"] = np.asarray(node["bias"])
    return [
        dict(
            in_features=int(w.shape[1]),
            out_features=int(w.shape[0]),
            bias=bool(layer["bias"]),
            activation_function=_st_activation(layer["activation"]),
        ),
        weights,
    ]


def _legacy_pooling_config(modes: list[str], dense: list, h: int) -> dict:
    """``pooling_mode_*`` keys; a flaxheads order other than ST's fixed one permutes the first dense layer's inputs."""
    order = [m for m in ST_LEGACY_ORDER if m in modes]
    if order != modes:
        if not dense:
            raise ExportError(
                f"pooling modes {modes} are concatenated in this order, but sentence-transformers' "
                f"pooling_mode_* keys concatenate in its fixed order {order}, and no dense layer follows "
                "whose inputs could be reordered. Build the pooler in that order, or pass "
                "pooling_format='v6' (needs a sentence-transformers that reads `pooling_mode`)."
            )
        w = dense[0][1]["linear.weight"]
        blocks = {m: w[:, i * h : (i + 1) * h] for i, m in enumerate(modes)}
        dense[0][1]["linear.weight"] = np.concatenate([blocks[m] for m in order], axis=1)
    return {
        "word_embedding_dimension": h,
        **{ST_LEGACY_KEYS[m]: m in modes for m in ST_LEGACY_ORDER},
        "include_prompt": True,
    }


def sentence_transformers_modules(model, params: Mapping | None = None, pooling_format: str = "legacy"):
    """(pooling config, [(dense config, {"linear.weight", "linear.bias"})], normalize) for ``model``.

    ``pooling_format="legacy"`` writes ``word_embedding_dimension`` + ``pooling_mode_*`` booleans,
    which every sentence-transformers version reads but concatenates in its fixed order
    (cls, max, mean, mean_sqrt_len, weightedmean, lasttoken): a different flaxheads order is
    reordered by permuting the first dense layer's inputs, or rejected when there is none.
    ``"v6"`` writes ``embedding_dimension`` + ``pooling_mode`` (a list, kept in order)."""
    if pooling_format not in ("legacy", "v6"):
        raise ExportError(f"pooling_format must be 'legacy' or 'v6', got {pooling_format!r}")
    if model.pool_mask != "attention_mask":
        raise ExportError(
            f"this model pools by {model.pool_mask!r}, but sentence-transformers pools by the "
            "attention mask. Export with format='transformers' (if an HF preset) or 'head'."
        )
    hp = np_tree((params or model.params)["head"])
    modes, layers = _st_pool_modes(model.head.pooler)
    head_layers, normalize = _st_head_layers(model.head.head)
    dense = [_dense_module(hp, layer) for layer in layers + head_layers]
    h = model.hidden_size
    if pooling_format == "v6":
        pool_cfg = {
            "embedding_dimension": h,
            "pooling_mode": modes[0] if len(modes) == 1 else list(modes),
            "include_prompt": True,
        }
    else:
        pool_cfg = _legacy_pooling_config(modes, dense, h)
    return pool_cfg, dense, normalize


def _unused_pooler_tensors(model, params: Mapping | None, have: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The PyTorch base model's own pooler (BERT & co. build one that sentence-transformers never
    uses; the JAX backbone skips it): written so PyTorch reports no freshly initialised weights.
    Taken from the model's pooler when it is the HF preset's, else from the source folder's safetensors."""
    names = dict(
        match_preset(
            model.backbone.config, model.num_labels, model.head.pooler, model.head.head, model.pool_mask
        ).weight_names
    )
    hp = (params or model.params)["head"]
    if names.get("pooler/dense", "").endswith(".pooler.dense") and "pooler" in hp:
        got = head_to_hf(np_tree(hp), (("pooler/dense", names["pooler/dense"]),))
        return {k.split(".", 1)[1]: v for k, v in got.items()}
    src = os.path.join(model.name_or_path or "", SAFE)
    if not os.path.isfile(src):
        return {}
    from flaxheads.backbones.safetensors_file import SafetensorsFile  # checked as it reads

    out: dict[str, np.ndarray] = {}
    with SafetensorsFile(src) as f:
        for k in f.keys():
            parts = k.split(".")
            short = ".".join(parts[1:]) if len(parts) > 1 and parts[1] == "pooler" else k
            if short.startswith("pooler.") and short not in have:
                out[short] = f.read(k)
    return out


# ---- export: files ----------------------------------------------------------------------------------------
def _sbert_config(src: str | None, max_seq_length: int | None) -> dict:
    """``sentence_bert_config.json``: ``max_seq_length`` given, else the source folder's."""
    sbert = {"max_seq_length": max_seq_length, "do_lower_case": False}
    old = os.path.join(src or "", "sentence_bert_config.json")
    if max_seq_length is None and os.path.isfile(old):
        sbert.update({k: v for k, v in read_json(old).items() if k in ("max_seq_length", "do_lower_case")})
    if sbert["max_seq_length"] is None:
        del sbert["max_seq_length"]
    return sbert


def _write_modules(tmp: str, pool_cfg: dict, dense: list, normalize: bool) -> None:
    """``modules.json``, ``1_Pooling``, ``k_Dense`` and ``k_Normalize`` folders."""
    modules = [
        dict(idx=0, name="0", path="", type="sentence_transformers.models.Transformer"),
        dict(idx=1, name="1", path="1_Pooling", type="sentence_transformers.models.Pooling"),
    ]
    os.makedirs(os.path.join(tmp, "1_Pooling"))
    write_json(os.path.join(tmp, "1_Pooling", "config.json"), pool_cfg)
    for cfg_d, weights in dense:
        i = len(modules)
        path = f"{i}_Dense"
        os.makedirs(os.path.join(tmp, path))
        write_json(os.path.join(tmp, path, "config.json"), cfg_d)
        save_safetensors(weights, os.path.join(tmp, path, SAFE))
        modules.append(dict(idx=i, name=str(i), path=path, type="sentence_transformers.models.Dense"))
    if normalize:
        i = len(modules)
        os.makedirs(os.path.join(tmp, f"{i}_Normalize"))
        modules.append(dict(idx=i, name=str(i), path=f"{i}_Normalize", type="sentence_transformers.models.Normalize"))
    write_json(os.path.join(tmp, "modules.json"), modules)


# ---- import -------------------------------------------------------------------------------------------------
def st_pooling_modes(cfg: dict) -> list[str]:
    """The pooling modes of a ``1_Pooling/config.json``, in the order sentence-transformers
    concatenates them: the ``pooling_mode`` key (str or list, kept in order) or the legacy
    ``pooling_mode_*`` booleans (ST's fixed order; none set means mean, as ST does)."""
    if "pooling_mode" in cfg and cfg["pooling_mode"] is not None:
        m = cfg["pooling_mode"]
        modes = [m] if isinstance(m, str) else list(m)
    else:
        modes = [m for m, key in ST_LEGACY_KEYS.items() if cfg.get(key, False)] or ["mean"]
    bad = [m for m in modes if m not in ST_TO_POOL]
    if bad:
        raise ModelImportError(f"unknown sentence-transformers pooling mode(s) {bad}; known: {sorted(ST_TO_POOL)}")
    return modes


def _st_dense(path: str) -> tuple[dict, np.ndarray, np.ndarray | None]:
    """(config, weight [out, in], bias or None) of a ``k_Dense`` folder, checked against its config."""
    cfg = read_json(os.path.join(path, "config.json"))
    if os.path.isfile(os.path.join(path, SAFE)):
        from flaxheads.backbones.weights import read_safetensors

        state = read_safetensors(os.path.join(path, SAFE))
    elif os.path.isfile(os.path.join(path, BIN)):
        state = read_torch_bin(os.path.join(path, BIN))
    else:
        raise ModelImportError(f"{path}: Dense module without weights ({SAFE} or {BIN})")
    if "linear.weight" not in state:
        raise ModelImportError(f"{path}: Dense weights have no 'linear.weight' (found {sorted(state)})")
    w, b = state["linear.weight"], state.get("linear.bias")
    want = (int(cfg["out_features"]), int(cfg["in_features"]))
    if tuple(w.shape) != want:
        raise ModelImportError(
            f"{path}: linear.weight has shape {tuple(w.shape)}, config.json says "
            f"[out_features, in_features] = {list(want)}"
        )
    if bool(cfg.get("bias", True)) != (b is not None):
        raise ModelImportError(
            f"{path}: config.json bias={cfg.get('bias', True)} but linear.bias is "
            f"{'absent' if b is None else 'present'}"
        )
    return cfg, w, b


def _st_module_folders(folder: str) -> tuple[list[str], list[str]]:
    """(module kinds, module folders) of ``modules.json``, checked to be a chain flaxheads imports."""
    mpath = os.path.join(folder, "modules.json")
    if not os.path.isfile(mpath):
        raise ModelImportError(f"{folder}: no modules.json, so not a sentence-transformers folder")
    modules = sorted(read_json(mpath), key=lambda m: int(m.get("idx", 0)))
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    known = {"Transformer", "Pooling", "Dense", "Normalize", "Dropout"}
    if (
        kinds[:2] != ["Transformer", "Pooling"]
        or any(k not in known for k in kinds)
        or "Normalize" in kinds[:-1]
        or kinds.count("Pooling") != 1
        or kinds.count("Transformer") != 1
    ):
        raise ModelImportError(
            f"{folder}: modules {kinds} are not Transformer -> Pooling -> [Dense | Dropout]* -> [Normalize]; "
            "flaxheads imports that chain only."
        )
    return kinds, [os.path.join(folder, m.get("path", "")) for m in modules]


def _st_head(folder: str, dense: list, normalize: bool, width: int):
    """The ProjectionHead (one activation and bias setting for all Dense layers) or IdentityHead."""
    acts = []
    for cfg, _, _ in dense:
        name = cfg.get("activation_function", "torch.nn.modules.activation.Tanh")  # ST's default is Tanh
        if name not in _TORCH_TO_ACT:
            raise ModelImportError(
                f"{folder}: Dense activation {name!r} has no flaxheads equivalent; supported: {sorted(_TORCH_TO_ACT)}"
            )
        acts.append(_TORCH_TO_ACT[name])
    biases = [b is not None for _, _, b in dense]
    if len(set(acts)) > 1 or len(set(biases)) > 1:
        raise ModelImportError(
            f"{folder}: Dense layers with different activations {acts} or bias settings "
            f"{biases}: flaxheads' ProjectionHead applies one activation and bias setting to "
            "every layer."
        )
    if not dense:
        return IdentityHead(width=width, normalize=normalize)
    return ProjectionHead(
        features=tuple(int(w.shape[0]) for _, w, _ in dense),
        activation=acts[0],
        use_bias=biases[0],
        normalize=normalize,
    )


def _hidden_size(folder: str, backbone_dir: str, pool_cfg: dict) -> int:
    """The backbone's width (config.json), checked against the Pooling module's dimension."""
    h = read_config(backbone_dir).get("hidden_size")
    dim = pool_cfg.get("embedding_dimension", pool_cfg.get("word_embedding_dimension"))
    width = h if h is not None else dim
    if width is None:
        raise ModelImportError(
            f"{folder}: neither the backbone's config.json nor 1_Pooling/config.json gives "
            "the hidden width (hidden_size / word_embedding_dimension)"
        )
    if h is not None and dim is not None and int(dim) != int(h):
        raise ModelImportError(f"{folder}: Pooling embedding dimension {dim} != the backbone's hidden_size {h}")
    return int(width)
