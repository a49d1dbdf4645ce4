"""The sentence-transformers folder, both ways: Transformer -> Pooling -> Dense* -> [Normalize].

Layout: ``modules.json``, the Transformer files at the root (backbone ``config.json``,
``model.safetensors`` without a prefix, tokenizer files, ``sentence_bert_config.json``),
``1_Pooling/config.json``, one ``k_Dense/`` per dense layer, ``k_Normalize``. A flaxheads
model fits when its pooler is a sentence-transformers pooling mode (or a concatenation of
them, or a token pick -> dense -> activation, as BERT's pooler) and its head is dense layers
with optional L2 normalisation. ST's ``cls`` is the first token the attention mask keeps:
flaxheads' ``first_non_pad`` (equal to ``cls`` under right padding).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from flaxheads.backbones.weights import SAFE
from flaxheads.disk.files import write_json
from flaxheads.heads.heads import LinearHead, MLPHead
from flaxheads.heads.poolers import Concat, Pool
from flaxheads.interop.files import (
    TOKENIZER_FILES,
    ExportError,
    ModelImportError,
    atomic_dir,
    backbone_config_dict,
    copy_tokenizer,
    read_json,
    save_safetensors,
    transformers_version,
)
from flaxheads.interop.st_modules import (
    _TORCH_TO_ACT,
    ST_TO_POOL,
    _hidden_size,
    _sbert_config,
    _st_dense,
    _st_head,
    _st_module_folders,
    _unused_pooler_tensors,
    _write_modules,
    sentence_transformers_modules,
    st_pooling_modes,
)
from flaxheads.interop.transformers import backbone_state_dict, check_weights_present
from flaxheads.model.pretrained import from_pretrained
from flaxheads.model.sequence import SequenceModel


# ---- export -----------------------------------------------------------------------------------------------
def export_sentence_transformers(
    model,
    out: str | os.PathLike,
    *,
    params: Mapping | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    pooling_format: str = "legacy",
    max_seq_length: int | None = None,
    overwrite: bool = False,
) -> str:
    """Write ``model`` as a sentence-transformers folder; returns ``out``.

    Transformer files (config, backbone safetensors without a prefix, tokenizer) at the
    root, ``1_Pooling``, one ``k_Dense`` per dense layer (pooler's, then head's), and
    ``k_Normalize``. The tokenizer files are required (sentence-transformers tokenizes)."""
    if getattr(model, "backbone", None) is None:
        raise ExportError(
            "a sentence-transformers export needs the backbone weights; this source has only a head. Use format='head'."
        )
    pool_cfg, dense, normalize = sentence_transformers_modules(model, params, pooling_format)
    state = backbone_state_dict(model, params)
    state.update(_unused_pooler_tensors(model, params, state))
    src = os.fspath(tokenizer_from) if tokenizer_from else model.name_or_path
    with atomic_dir(out, overwrite) as tmp:
        if not copy_tokenizer(src, tmp):
            raise ExportError(
                f"no tokenizer files ({', '.join(TOKENIZER_FILES[:5])}, ...) in {src!r}; "
                "sentence-transformers needs them: pass tokenizer_from=<folder with the tokenizer> "
                "(--tokenizer)"
            )
        write_json(os.path.join(tmp, "config.json"), backbone_config_dict(model.backbone.config))
        save_safetensors(state, os.path.join(tmp, SAFE))
        write_json(os.path.join(tmp, "sentence_bert_config.json"), _sbert_config(src, max_seq_length))
        _write_modules(tmp, pool_cfg, dense, normalize)
        write_json(
            os.path.join(tmp, "config_sentence_transformers.json"),
            {"__version__": {"transformers": transformers_version() or "unknown"}, "similarity_fn_name": "cosine"},
        )
    return os.fspath(out)


# ---- import -------------------------------------------------------------------------------------------------
def is_cross_encoder(folder: str | os.PathLike) -> bool:
    """A sentence-transformers 6 modular CrossEncoder (its last Dense layer writes ``scores``)."""
    path = os.path.join(os.fspath(folder), "config_sentence_transformers.json")
    return os.path.isfile(path) and read_json(path).get("model_type") == "CrossEncoder"


def _load_cross_encoder(folder: str, backbone_dir: str, pooler, dense: list, dtype) -> SequenceModel:
    """A modular CrossEncoder as a classifier or scorer: its last Dense layer (no activation) is the
    output layer; one Dense is a linear head, more an MLP head whose hidden layers share an activation."""
    acts = [
        _TORCH_TO_ACT.get(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"), "?")
        for cfg, _, _ in dense
    ]
    if (
        not dense
        or acts[-1] is not None
        or len(set(acts[:-1])) > 1
        or "?" in acts
        or len({b is not None for _, _, b in dense[:-1]}) > 1
        or dense[-1][2] is None
        and len(dense) > 1
    ):
        raise ModelImportError(
            f"{folder}: a CrossEncoder whose Dense layers ({acts}) are not hidden layers of "
            "one activation then an output layer without one: flaxheads imports linear and MLP "
            "heads"
        )
    n = int(dense[-1][1].shape[0])
    head: LinearHead | MLPHead
    if len(dense) == 1:
        head, names = LinearHead(num_labels=n, dropout=0.0, use_bias=dense[0][2] is not None), ["classifier"]
    else:
        head = MLPHead(
            num_labels=n,
            hidden_dims=tuple(int(w.shape[0]) for _, w, _ in dense[:-1]),
            activation=acts[0],
            dropout=0.0,
            dense_bias=dense[0][2] is not None,
        )
        names = [f"dense_{i}" for i in range(len(dense) - 1)] + ["out_proj"]
    model = from_pretrained(
        backbone_dir,
        pooler=pooler,
        head=head,
        num_labels=n,
        dtype=dtype,
        problem_type="regression" if n == 1 else "single_label_classification",
        pool_mask="attention_mask",
        ignore_mismatched_sizes=True,
    )
    layers = {
        name: {"kernel": jnp.asarray(w.T), **({"bias": jnp.asarray(b)} if b is not None else {})}
        for name, (_, w, b) in zip(names, dense)
    }
    expect = {k: {p: np.shape(v) for p, v in d.items()} for k, d in model.params["head"]["head"].items()}
    got = {k: {p: np.shape(v) for p, v in d.items()} for k, d in layers.items()}
    if expect != got:
        raise ModelImportError(
            f"{folder}: the CrossEncoder's Dense layers {got} do not fit a {type(head).__name__} {expect}"
        )
    return dataclasses.replace(model, params={**model.params, "head": {**model.params["head"], "head": layers}})


def load_sentence_transformers(folder: str | os.PathLike, *, dtype=jnp.float32) -> SequenceModel:
    """A sentence-transformers folder as backbone + pooler + projection head with the same embeddings.

    Supported modules: Transformer, Pooling (``pooling_mode`` or legacy ``pooling_mode_*``
    keys), Dense (one activation and bias setting shared by all Dense layers), Dropout
    (a no-op at inference), Normalize (last). ST's ``cls`` is the first token the attention
    mask keeps, imported as the ``first_non_pad`` pooler."""
    folder = os.fspath(folder)
    kinds, where = _st_module_folders(folder)
    check_weights_present(where[0])
    pool_cfg = read_json(os.path.join(where[1], "config.json"))
    pools = [Pool(ST_TO_POOL[m]) for m in st_pooling_modes(pool_cfg)]
    pooler = pools[0] if len(pools) == 1 else Concat(tuple(pools))
    dense = [_st_dense(where[i]) for i, k in enumerate(kinds) if k == "Dense"]
    width = pooler.out_features(_hidden_size(folder, where[0], pool_cfg))
    if is_cross_encoder(folder):
        return _load_cross_encoder(folder, where[0], pooler, dense, dtype)
    head = _st_head(folder, dense, kinds[-1] == "Normalize", width)
    model = from_pretrained(where[0], pooler=pooler, head=head, dtype=dtype, pool_mask="attention_mask")
    head_params = dict(model.params["head"])
    if dense:
        layers = {}
        for i, (_, w, b) in enumerate(dense):
            if w.shape[1] != width:
                raise ModelImportError(f"{folder}: Dense layer {i} takes {w.shape[1]} inputs but receives {width}")
            layers[f"dense_{i}"] = {"kernel": jnp.asarray(w.T), **({"bias": jnp.asarray(b)} if b is not None else {})}
            width = int(w.shape[0])
        head_params["head"] = layers
    return dataclasses.replace(
        model,
        params={"backbone": model.params["backbone"], "head": head_params},
        num_labels=width,
        arch=None,
        hf_names=(),
    )


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A sentence-transformers model's prompts (``config_sentence_transformers.json``): texts put before
    the input, by name, the one used when none is asked for, and whether pooling reads the prompt's
    tokens (``1_Pooling``'s ``include_prompt``, true unless the folder says otherwise)."""

    prompts: Mapping[str, str] = dataclasses.field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True


def read_prompts(folder: str | os.PathLike) -> Prompts:
    """The prompts of a sentence-transformers folder; none for any other folder."""
    import json

    folder = os.fspath(folder)
    path = os.path.join(folder, "config_sentence_transformers.json")
    if not os.path.isfile(path):
        return Prompts()
    with open(path) as f:
        cfg = json.load(f)
    prompts = {str(k): str(v) for k, v in (cfg.get("prompts") or {}).items()}
    include = True
    if os.path.isfile(os.path.join(folder, "modules.json")):
        with open(os.path.join(folder, "modules.json")) as f:
            for m in json.load(f):
                pool_cfg = os.path.join(folder, m.get("path", ""), "config.json")
                if m.get("type", "").endswith("Pooling") and os.path.isfile(pool_cfg):
                    with open(pool_cfg) as g:
                        include = bool(json.load(g).get("include_prompt", True))
    default = cfg.get("default_prompt_name")
    return Prompts(prompts, default if default in prompts else None, include)
