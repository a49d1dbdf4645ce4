"""Import and export of the formats flaxheads reads and writes, one module per format:
:mod:`.transformers` (``XForSequenceClassification`` folders), :mod:`.sentence_transformers`,
:mod:`.head_files` (``head.safetensors`` + ``head_config.json``), :mod:`.peft` (LoRA adapter folders),
:mod:`.cross_encoder`, :mod:`.onnx` (``model.onnx`` for serving); :mod:`.tokenizers` loads a
folder's tokenizer without transformers; :mod:`.files` holds what they share.

Most programs need none of these by name: :func:`flaxheads.load` reads every format and
:func:`flaxheads.export` writes every format; the functions here are what they call."""

from __future__ import annotations

import os

from flaxheads.checkpoint.kinds import FolderKind, folder_kind
from flaxheads.interop.cross_encoder import export_cross_encoder
from flaxheads.interop.files import ExportError, ModelImportError
from flaxheads.interop.head_files import export_head, load_head_export
from flaxheads.interop.onnx import export_onnx  # torch is imported only when it exports
from flaxheads.interop.peft import export_peft, load_peft
from flaxheads.interop.sentence_transformers import export_sentence_transformers, load_sentence_transformers
from flaxheads.interop.tokenizers import Tokenizer, TokenizerError, load_tokenizer
from flaxheads.interop.transformers import export_transformers, load_transformers
from flaxheads.model.sequence import SequenceModel

__all__ = [
    "ExportError",
    "ModelImportError",
    "import_model",
    "export_head",
    "load_head_export",
    "export_sentence_transformers",
    "load_sentence_transformers",
    "export_transformers",
    "load_transformers",
    "export_cross_encoder",
    "export_onnx",
    "export_peft",
    "load_peft",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]


def import_model(folder: str | os.PathLike, **options) -> SequenceModel:
    """Import a whole model another tool's folder holds, by what :func:`~flaxheads.checkpoint.kinds.folder_kind`
    says it is: a sentence-transformers folder, a PEFT adapter (``backbone=``: its base folder) or a
    transformers classifier (anything else goes to :func:`load_transformers`, which says what is missing)."""
    folder = os.fspath(folder)
    kind = folder_kind(folder)
    if kind is FolderKind.SENTENCE_TRANSFORMERS:
        return load_sentence_transformers(folder, **options)
    if kind is FolderKind.PEFT_ADAPTER:
        return load_peft(folder, **options)
    return load_transformers(folder, **options)
