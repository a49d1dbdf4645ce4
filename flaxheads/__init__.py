"""flaxheads: any pooler and any head on native JAX backbones loaded from Hugging Face folders, as Flax modules.

The public names, by concept:

* a run: :func:`train` (a :class:`RunSpec`, or its settings as keywords) -> :class:`Run`
* models: :func:`from_pretrained`, :class:`SequenceModel`, :func:`load` (anything flaxheads reads),
  :func:`export` (any format; per-format functions in :mod:`flaxheads.interop`), :class:`Classifier`
* poolers and heads (Flax modules), presets, LoRA
* training pieces: :class:`Trainer`, :func:`fit`, :class:`TrainConfig`, :class:`OptimConfig`, tasks, losses
* checkpoints: heads saved apart from backbones, run checkpoints
"""
from flaxheads.runtime.phases import guard_command_import

guard_command_import()  # Ctrl-C while the flaxheads command imports its libraries: one line, not a traceback
from flaxheads._version import __version__
from flaxheads.errors import FlaxheadsError

# a run
from flaxheads.run import Run, RunSpec, train

# models, loading and exporting
from flaxheads.model.sequence import LoadReport, SequenceModel, build_head
from flaxheads.backbones.registry import load_backbone
from flaxheads.model.pretrained import from_pretrained
from flaxheads.formats import FORMATS, export, load
from flaxheads.predict import Classifier, Predictions
from flaxheads.heads.describe import describe
from flaxheads.runtime import ComputePlan
from flaxheads import interop
from flaxheads.interop import (ExportError, ModelImportError, export_head, export_sentence_transformers, export_transformers,
                      import_model, load_head_export, load_sentence_transformers, load_transformers)
from flaxheads.interop.cross_encoder import export_cross_encoder
from flaxheads.interop.onnx import export_onnx
from flaxheads.interop.peft import export_peft, load_peft
from flaxheads.interop.tokenizers import Tokenizer, TokenizerError, load_tokenizer

# poolers, heads, presets, LoRA
from flaxheads.heads.poolers import AttentionPool, Concat, DensePooler, Pool, Pooler, SequenceSummary, make_pooler
from flaxheads.heads.heads import Head, IdentityHead, LinearHead, MLPHead, ProjectionHead, SequenceHead, make_head
from flaxheads.config import from_dict, from_json, to_dict, to_json
from flaxheads.heads.presets import PRESETS, PoolMaskError, Preset, PresetMatch, match_preset, preset_for
from flaxheads.model import lora
from flaxheads.model.lora import LoraConfig, merge_model
from flaxheads.training.memory_plan import MemoryPlan, plan_memory

# training pieces
from flaxheads.training.loop import Callback, TrainConfig, Trainer, fit
from flaxheads.training.optim import OptimConfig
from flaxheads.tasks.task import Classification, Task
from flaxheads.tasks.ranking.task import Ranking
from flaxheads.tasks import ranking
from flaxheads.losses import (MULTI_LABEL, REGRESSION, SINGLE_LABEL, infer_problem_type, loss_fn, mean_squared_error,
                     sigmoid_binary_cross_entropy, softmax_cross_entropy, validate_labels)

# checkpoints
from flaxheads.checkpoint import (CheckpointError, CorruptCheckpointError, HeadCheckpoint, HeadMismatchError,
                         IncompatibleCheckpointError, RunCheckpointer, attach_head, load_head, save_head)
from flaxheads.checkpoint.models import model_from_checkpoint
from flaxheads.checkpoint.adapters import load_adapters

__all__ = [
    "__version__", "FlaxheadsError",
    # a run
    "Run", "RunSpec", "train",
    # models, loading and exporting
    "LoadReport", "SequenceModel", "build_head", "from_pretrained", "load_backbone", "FORMATS", "export", "load",
    "Classifier", "Predictions", "describe", "ComputePlan", "interop", "ExportError", "ModelImportError",
    "export_head", "export_sentence_transformers", "export_transformers", "import_model", "load_head_export",
    "load_sentence_transformers", "load_transformers", "export_cross_encoder", "export_onnx", "export_peft",
    "load_peft", "Tokenizer", "TokenizerError", "load_tokenizer",
    # poolers, heads, presets, LoRA
    "AttentionPool", "Concat", "DensePooler", "Pool", "Pooler", "SequenceSummary", "make_pooler",
    "Head", "IdentityHead", "LinearHead", "MLPHead", "ProjectionHead", "SequenceHead", "make_head",
    "from_dict", "from_json", "to_dict", "to_json", "PRESETS", "PoolMaskError", "Preset", "PresetMatch",
    "match_preset", "preset_for", "lora", "LoraConfig", "merge_model", "MemoryPlan", "plan_memory",
    # training pieces
    "Callback", "TrainConfig", "Trainer", "fit", "OptimConfig", "Classification", "Task", "Ranking", "ranking",
    "MULTI_LABEL", "REGRESSION", "SINGLE_LABEL", "infer_problem_type", "loss_fn", "mean_squared_error",
    "sigmoid_binary_cross_entropy", "softmax_cross_entropy", "validate_labels",
    # checkpoints
    "CheckpointError", "CorruptCheckpointError", "HeadCheckpoint", "HeadMismatchError", "IncompatibleCheckpointError",
    "RunCheckpointer", "attach_head", "load_head", "save_head", "model_from_checkpoint", "load_adapters",
]


def __getattr__(name: str):
    # fh.nnx imports Flax NNX on first use: `import flaxheads` stays free of it (older Flax has none)
    if name == "nnx":
        import importlib

        return importlib.import_module(".nnx", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
