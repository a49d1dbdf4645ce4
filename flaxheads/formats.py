"""One loader and one exporter for every format: :func:`load` reads anything flaxheads reads (a run
folder or one of its steps, transformers / sentence-transformers / PEFT / head-export folders, hub
ids in the local cache); :func:`export` writes any format. The per-format functions stay in
:mod:`flaxheads.interop`."""
from __future__ import annotations

import os
from typing import Any

from .errors import UsageError
from .interop.cross_encoder import export_cross_encoder
from .interop.head_files import export_head
from .interop.peft import export_peft
from .interop.sentence_transformers import export_sentence_transformers
from .interop.transformers import export_transformers
from .model import SequenceModel
from .predict.sources import load_source

#: ``format=`` values of :func:`export`.
FORMATS = ("transformers", "sentence-transformers", "head", "onnx", "cross-encoder", "peft")


def load(source: str | os.PathLike, *, step: int | str | None = None, backbone: str | os.PathLike | None = None,
         dtype: Any = None, revision: str | None = None) -> SequenceModel:
    """The model in ``source``: a run folder (``step``: ``"latest"``, ``"best"`` or a number), a
    checkpoint folder, a transformers classifier, a sentence-transformers folder, a PEFT LoRA
    adapter or a head export (on ``backbone``, default: the folder it names), or a hub id found in
    the local cache."""
    return load_source(source, step=step, backbone=backbone, dtype=dtype, revision=revision).model


def export(model: SequenceModel, dest: str | os.PathLike, format: str = "transformers",  # noqa: A002
           **options: Any) -> str:
    """Write ``model`` to the folder ``dest`` in ``format`` (one of :data:`FORMATS`); ``options``
    go to that format's exporter in :mod:`flaxheads.interop` (``overwrite``, ``tokenizer_from``,
    ``max_seq_length``, ...). Returns the folder written."""
    if format == "transformers":
        return export_transformers(model, dest, **options)
    if format == "sentence-transformers":
        return export_sentence_transformers(model, dest, **options)
    if format == "head":
        return export_head(model, dest, **options)
    if format == "onnx":
        from .interop.onnx import export_onnx  # torch: imported only for this format

        return export_onnx(model, dest, **options)
    if format == "cross-encoder":
        return export_cross_encoder(model, dest, **options)
    if format == "peft":
        if getattr(model, "lora", None) is None:
            raise UsageError("format='peft' writes LoRA adapters, and this model has none (it was not trained with "
                             "lora_rank); export the whole model in another format")
        return export_peft(model, dest, **options)
    raise UsageError(f"unknown export format {format!r}: expected one of {', '.join(FORMATS)}")
