"""Import and export of the formats flaxheads reads and writes, one module per format:
:mod:`.transformers` (``XForSequenceClassification`` folders), :mod:`.sentence_transformers`,
:mod:`.head_files` (``head.safetensors`` + ``head_config.json``), :mod:`.peft` (LoRA adapter folders),
:mod:`.onnx` (``model.onnx`` for serving); :mod:`.tokenizers` loads a
folder's tokenizer without transformers; :mod:`.files` holds what they share."""
from __future__ import annotations

import os

from flaxheads.model.sequence import SequenceModel
from flaxheads.interop.files import ExportError, ModelImportError
from flaxheads.interop.head_files import HEAD_CONFIG, export_head, load_head_export
from flaxheads.interop.sentence_transformers import export_sentence_transformers, load_sentence_transformers
from flaxheads.interop.transformers import export_transformers, load_transformers

def import_model(folder: str | os.PathLike, **options) -> SequenceModel:
    """Import a sentence-transformers folder (it has ``modules.json``) or a transformers classifier."""
    folder = os.fspath(folder)
    if os.path.isfile(os.path.join(folder, "modules.json")):
        return load_sentence_transformers(folder, **options)
    return load_transformers(folder, **options)
