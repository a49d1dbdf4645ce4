"""A sentence-transformers ``CrossEncoder`` folder, in one of two layouts:

* a model whose pooler + head is a Hugging Face preset: the transformers
  ``XForSequenceClassification`` folder (:mod:`flaxheads.interop.transformers`) with the tokenizer,
  and the activation ``CrossEncoder.predict`` applies recorded where every sentence-transformers
  version since 4 reads it (``config.json`` -> ``sentence_transformers``);
* any other pooler + head that sentence-transformers' modules express (the poolings and Dense
  layers of :mod:`flaxheads.interop.sentence_transformers`): sentence-transformers 6's modular
  CrossEncoder, ``Transformer`` (feature extraction) -> ``Pooling`` -> ``Dense`` layers, the last
  writing ``scores``.

``activation="identity"`` (default): ``CrossEncoder(folder).predict(pairs)`` returns the model's
raw outputs, what :meth:`flaxheads.predict.Classifier.score` returns for a one-output model (a
reranker's relevance or a reward) and its logits for a classifier. ``"sigmoid"``:
sentence-transformers' own default for one output (a relevance probability).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flaxheads.disk.files import write_json
from flaxheads.heads.presets import match_preset
from flaxheads.interop.files import (
    ExportError,
    atomic_dir,
    backbone_config_dict,
    copy_tokenizer,
    save_safetensors,
    transformers_version,
)
from flaxheads.interop.st_modules import (
    _unused_pooler_tensors,
    _write_modules,
    sentence_transformers_modules,
)
from flaxheads.interop.transformers import SAFE, backbone_state_dict, transformers_config, transformers_state_dict

#: ``activation`` -> the class path sentence-transformers imports (torch.* paths need no trust flag).
ACTIVATIONS = {"identity": "torch.nn.modules.linear.Identity", "sigmoid": "torch.nn.modules.activation.Sigmoid"}


def cross_encoder_config(model, activation: str = "identity") -> dict:
    """``config.json`` of the CrossEncoder: the XForSequenceClassification config + its activation."""
    if activation not in ACTIVATIONS:
        raise ExportError(f"cross-encoder activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    cfg = transformers_config(model)
    cfg["sentence_transformers"] = {"activation_fn": ACTIVATIONS[activation]}
    return cfg


def is_preset(model) -> bool:
    """The model's pooler + head is exactly its backbone's HF preset (the transformers layout)."""
    m = match_preset(model.backbone.config, model.num_labels, model.head.pooler, model.head.head, model.pool_mask)
    return bool(m.exact and m.same_pooler and m.same_head)


def export_cross_encoder(
    model,
    out: str | os.PathLike,
    *,
    params: Mapping | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    activation: str = "identity",
    max_length: int | None = None,
    overwrite: bool = False,
) -> str:
    """Write ``model`` as a sentence-transformers CrossEncoder folder; returns ``out``.

    An HF-exact preset head is written as a transformers classifier (any sentence-transformers
    version since 4 loads it); another head as sentence-transformers 6's modular CrossEncoder.
    The tokenizer files are needed (a CrossEncoder tokenizes its pairs): from ``tokenizer_from``,
    default the folder the model was loaded from. ``max_length``: the tokens per pair
    ``CrossEncoder`` truncates to (its tokenizer's ``model_max_length`` otherwise)."""
    if getattr(model, "backbone", None) is None:
        raise ExportError("a CrossEncoder export needs the backbone weights; this source has only a head")
    if activation not in ACTIVATIONS:
        raise ExportError(f"cross-encoder activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    preset = is_preset(model)
    write = (
        _write_preset(model, params, activation) if preset else _write_modular(model, params, activation, max_length)
    )
    src = os.fspath(tokenizer_from) if tokenizer_from else model.name_or_path
    with atomic_dir(out, overwrite) as tmp:
        if not copy_tokenizer(src, tmp):
            raise ExportError(
                f"no tokenizer files in {src!r}; a CrossEncoder tokenizes its pairs: pass "
                "tokenizer_from=<folder with the tokenizer> (--tokenizer)"
            )
        if max_length is not None:
            _set_model_max_length(tmp, int(max_length))
        write(tmp)
    return os.fspath(out)


def _write_preset(model, params, activation: str):
    cfg = cross_encoder_config(model, activation)
    state = transformers_state_dict(model, params)

    def write(tmp: str) -> None:
        write_json(os.path.join(tmp, "config.json"), cfg)
        save_safetensors(state, os.path.join(tmp, SAFE))

    return write


def _write_modular(model, params, activation: str, max_length: int | None):
    pool_cfg, dense, normalize = sentence_transformers_modules(model, params, "v6")
    if normalize or not dense or dense[-1][0]["out_features"] != model.num_labels:
        raise ExportError(
            f"a CrossEncoder scores with its last Dense layer; this head "
            f"({type(model.head.head).__name__}) ends in {'a normalisation' if normalize else 'no Dense'}"
            ". Use a linear or mlp head, or the HF preset head (--pooler preset --head preset)"
        )
    dense[-1][0]["module_output_name"] = "scores"
    state = backbone_state_dict(model, params)
    state.update(_unused_pooler_tensors(model, params, state))
    sbert = {
        "transformer_task": "feature-extraction",
        "module_output_name": "token_embeddings",
        **({"max_seq_length": int(max_length)} if max_length else {}),
    }

    def write(tmp: str) -> None:
        write_json(os.path.join(tmp, "config.json"), backbone_config_dict(model.backbone.config))
        save_safetensors(state, os.path.join(tmp, SAFE))
        write_json(os.path.join(tmp, "sentence_bert_config.json"), sbert)
        _write_modules(tmp, pool_cfg, dense, False)
        write_json(
            os.path.join(tmp, "config_sentence_transformers.json"),
            {
                "__version__": {"transformers": transformers_version() or "unknown"},
                "model_type": "CrossEncoder",
                "activation_fn": ACTIVATIONS[activation],
            },
        )

    return write


def _set_model_max_length(folder: str, n: int) -> None:
    """The tokenizer's ``model_max_length``: where a CrossEncoder without ``max_length`` truncates."""
    import json

    path = os.path.join(folder, "tokenizer_config.json")
    cfg = {}
    if os.path.isfile(path):
        with open(path) as f:
            cfg = json.load(f)
    cfg["model_max_length"] = n
    write_json(path, cfg)
