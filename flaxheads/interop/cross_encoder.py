"""A sentence-transformers ``CrossEncoder`` folder of a model whose pooler + head is a Hugging Face
preset: the transformers ``XForSequenceClassification`` folder (:mod:`flaxheads.interop.transformers`)
with the tokenizer, and the activation ``CrossEncoder.predict`` applies recorded where every
sentence-transformers version since 4 reads it (``config.json`` -> ``sentence_transformers``).

``activation="identity"`` (default): ``CrossEncoder(folder).predict(pairs)`` returns the model's
raw outputs, what :meth:`flaxheads.predict.Classifier.score` returns for a one-output model (a
reranker's relevance or a reward) and its logits for a classifier. ``"sigmoid"``:
sentence-transformers' own default for one output (a relevance probability).
"""
from __future__ import annotations

import os
from typing import Mapping

from .files import ExportError, atomic_dir, copy_tokenizer, save_safetensors, write_json
from .transformers import SAFE, transformers_config, transformers_state_dict

#: ``activation`` -> the class path sentence-transformers imports (torch.* paths need no trust flag).
ACTIVATIONS = {"identity": "torch.nn.modules.linear.Identity", "sigmoid": "torch.nn.modules.activation.Sigmoid"}


def cross_encoder_config(model, activation: str = "identity") -> dict:
    """``config.json`` of the CrossEncoder: the XForSequenceClassification config + its activation."""
    if activation not in ACTIVATIONS:
        raise ExportError(f"cross-encoder activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    cfg = transformers_config(model)
    cfg["sentence_transformers"] = {"activation_fn": ACTIVATIONS[activation]}
    return cfg


def export_cross_encoder(model, out: str | os.PathLike, *, params: Mapping | None = None,
                         tokenizer_from: str | os.PathLike | None = None, activation: str = "identity",
                         max_length: int | None = None, overwrite: bool = False) -> str:
    """Write ``model`` as a sentence-transformers CrossEncoder folder; returns ``out``.

    Needs an HF-exact preset head (as a transformers export) and the tokenizer files (a
    CrossEncoder tokenizes its pairs): from ``tokenizer_from``, default the folder the model was
    loaded from. ``max_length``: the tokens per pair ``CrossEncoder`` truncates to (its
    tokenizer's ``model_max_length`` otherwise)."""
    cfg = cross_encoder_config(model, activation)
    state = transformers_state_dict(model, params)
    src = os.fspath(tokenizer_from) if tokenizer_from else model.name_or_path
    with atomic_dir(out, overwrite) as tmp:
        if not copy_tokenizer(src, tmp):
            raise ExportError(f"no tokenizer files in {src!r}; a CrossEncoder tokenizes its pairs: pass "
                              "tokenizer_from=<folder with the tokenizer> (--tokenizer)")
        if max_length is not None:
            cfg["sentence_transformers"]["max_length"] = int(max_length)
            _set_model_max_length(tmp, int(max_length))
        write_json(os.path.join(tmp, "config.json"), cfg)
        save_safetensors(state, os.path.join(tmp, SAFE))
    return os.fspath(out)


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
