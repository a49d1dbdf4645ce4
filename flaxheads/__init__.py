"""flaxheads: any pooler and any head on native JAX backbones loaded from Hugging Face folders, as Flax modules."""
from .checkpoint import (CheckpointError, CorruptCheckpointError, HeadCheckpoint, HeadMismatchError,
                    IncompatibleCheckpointError, RunCheckpointer, attach_head, load_head, save_head)
from .config import from_dict, from_json, to_dict, to_json
from .describe import describe
from .host import ComputePlan
from .nn.heads import Head, IdentityHead, LinearHead, MLPHead, ProjectionHead, SequenceHead, make_head
from .checkpoint.models import model_from_checkpoint
from .interop import (ExportError, ModelImportError, export_head, export_sentence_transformers, export_transformers,
                      import_model, load_head_export, load_sentence_transformers, load_transformers)
from .interop.tokenizers import Tokenizer, TokenizerError, load_tokenizer
from . import lora
from .checkpoint.adapters import load_adapters
from .interop.cross_encoder import export_cross_encoder
from .interop.onnx import export_onnx
from .interop.peft import export_peft, load_peft
from . import ranking
from .ranking.train import RankingTrainer
from .lora import LoraConfig, merge_model
from .losses import (MULTI_LABEL, REGRESSION, SINGLE_LABEL, infer_problem_type, loss_fn, mean_squared_error,
                     sigmoid_binary_cross_entropy, softmax_cross_entropy, validate_labels)
from .model import LoadReport, SequenceModel, build_head, from_pretrained, load_backbone
from .nn.poolers import (AttentionPool, Concat, DensePooler, Pool, Pooler, SequenceSummary, make_pooler)
from .predict import Classifier, Predictions
from .presets import PRESETS, PoolMaskError, Preset, PresetMatch, match_preset, preset_for

from ._version import __version__
from .errors import FlaxheadsError

__all__ = [
    "ExportError", "ModelImportError", "export_head", "export_sentence_transformers",
    "export_transformers", "import_model", "load_head_export", "load_sentence_transformers", "load_transformers",
    "model_from_checkpoint", "Tokenizer", "TokenizerError", "load_tokenizer", "PoolMaskError", "PresetMatch",
    "match_preset",
    "AttentionPool", "CheckpointError", "Concat", "CorruptCheckpointError", "HeadCheckpoint", "HeadMismatchError",
    "IncompatibleCheckpointError", "RunCheckpointer", "attach_head", "load_head", "save_head",
    "DensePooler", "Head", "IdentityHead", "LinearHead", "LoadReport", "MLPHead",
    "MULTI_LABEL", "PRESETS", "Pool", "Pooler", "Preset", "ProjectionHead", "REGRESSION", "SINGLE_LABEL",
    "SequenceHead", "SequenceModel", "SequenceSummary", "build_head", "describe", "from_dict", "from_json",
    "from_pretrained", "infer_problem_type", "load_backbone", "loss_fn", "make_head", "make_pooler",
    "mean_squared_error", "preset_for", "sigmoid_binary_cross_entropy", "softmax_cross_entropy", "to_dict",
    "to_json", "validate_labels", "lora", "LoraConfig", "merge_model", "export_peft", "export_onnx", "load_peft",
    "load_adapters",
    "Classifier", "Predictions", "FlaxheadsError", "ComputePlan",
    "ranking", "RankingTrainer", "export_cross_encoder",
]


def __getattr__(name: str):
    # fh.nnx imports Flax NNX on first use: `import flaxheads` stays free of it (older Flax has none)
    if name == "nnx":
        import importlib

        return importlib.import_module(".nnx", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
