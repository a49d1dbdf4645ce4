"""flaxheads: any pooler and any head on native JAX backbones loaded from Hugging Face folders, as Flax modules.

The front door (``import flaxheads as fh``), by concept:

* a run: :func:`train` (a :class:`RunSpec`, or its settings as keywords) -> :class:`Run`; how much it
  tells: :func:`set_verbosity`
* models: :func:`from_pretrained` (a new head on a backbone), :func:`load` (anything flaxheads reads),
  :func:`export` (any of :data:`FORMATS`), :class:`SequenceModel`, :class:`Classifier` (texts in,
  :class:`Predictions` out), :func:`describe`, :func:`load_tokenizer`
* poolers, heads and adapters: the Flax modules, :func:`make_pooler`, :func:`make_head`, :class:`LoraConfig`
* training: :class:`Trainer`, :func:`fit`, :class:`TrainConfig`, :class:`OptimConfig`, :class:`Callback`,
  the tasks :class:`Classification` and :class:`Ranking`
* checkpoints: heads saved apart from backbones, run checkpoints; the memory plan; :class:`FlaxheadsError`

Everything else lives in its submodule, reachable as an attribute: ``fh.interop`` (each format's own
reader and writer), ``fh.checkpoint``, ``fh.losses``, ``fh.lora``, ``fh.ranking``, ``fh.nnx``,
``fh.runtime``, ``fh.formats``. Each name is imported on first use: ``import flaxheads`` itself imports
neither jax nor flax, and reads nothing of the process (the ``flaxheads`` command guards its own
imports: :func:`flaxheads.cli.entry`). The names of earlier releases still resolve, with a
:class:`DeprecationWarning` saying where each lives now.
"""

import importlib as _importlib
import importlib.util as _importlib_util
import warnings as _warnings

from flaxheads._version import __version__

#: The front door: each public name and the module it is imported from on first use.
_PUBLIC: dict[str, str] = {
    # a run
    "train": "flaxheads.run",
    "RunSpec": "flaxheads.run",
    "Run": "flaxheads.run",
    "set_verbosity": "flaxheads.runtime.logs",
    # models: make, load, export, describe, predict
    "from_pretrained": "flaxheads.model.pretrained",
    "load": "flaxheads.formats",
    "export": "flaxheads.formats",
    "FORMATS": "flaxheads.formats",
    "SequenceModel": "flaxheads.model.sequence",
    "Classifier": "flaxheads.predict",
    "Predictions": "flaxheads.predict",
    "describe": "flaxheads.heads.describe",
    "load_tokenizer": "flaxheads.interop.tokenizers",
    "Tokenizer": "flaxheads.interop.tokenizers",
    # poolers, heads and adapters
    "Pooler": "flaxheads.heads.poolers",
    "Pool": "flaxheads.heads.poolers",
    "AttentionPool": "flaxheads.heads.poolers",
    "Concat": "flaxheads.heads.poolers",
    "DensePooler": "flaxheads.heads.poolers",
    "SequenceSummary": "flaxheads.heads.poolers",
    "make_pooler": "flaxheads.heads.poolers",
    "Head": "flaxheads.heads.heads",
    "LinearHead": "flaxheads.heads.heads",
    "MLPHead": "flaxheads.heads.heads",
    "ProjectionHead": "flaxheads.heads.heads",
    "IdentityHead": "flaxheads.heads.heads",
    "TokenLogits": "flaxheads.heads.heads",
    "SequenceHead": "flaxheads.heads.heads",
    "make_head": "flaxheads.heads.heads",
    "LoraConfig": "flaxheads.model.lora",
    # training
    "Trainer": "flaxheads.training.loop",
    "fit": "flaxheads.training.loop",
    "TrainConfig": "flaxheads.training.loop",
    "OptimConfig": "flaxheads.training.optim",
    "Callback": "flaxheads.training.loop",
    "Task": "flaxheads.tasks.task",
    "Classification": "flaxheads.tasks.task",
    "Ranking": "flaxheads.tasks.ranking.task",
    # checkpoints
    "save_head": "flaxheads.checkpoint",
    "load_head": "flaxheads.checkpoint",
    "attach_head": "flaxheads.checkpoint",
    "HeadCheckpoint": "flaxheads.checkpoint",
    "RunCheckpointer": "flaxheads.checkpoint",
    # memory plan
    "plan_memory": "flaxheads.training.memory_plan",
    "MemoryPlan": "flaxheads.training.memory_plan",
    # errors
    "FlaxheadsError": "flaxheads.errors",
}

__all__ = ["__version__", *_PUBLIC]

#: Submodules reachable as attributes (``fh.interop``) that are not front-door names; any other
#: ``flaxheads.<name>`` module is reachable the same way.
_SUBMODULES: dict[str, str] = {
    "interop": "flaxheads.interop",
    "checkpoint": "flaxheads.checkpoint",
    "losses": "flaxheads.losses",
    "lora": "flaxheads.model.lora",
    "ranking": "flaxheads.tasks.ranking",
    "nnx": "flaxheads.nnx",
    "runtime": "flaxheads.runtime",
    "formats": "flaxheads.formats",
}

_LOAD = "fh.load(folder)"
#: The top-level names of the release before (0.2), each with the module it lives in now and, where
#: the front door does the same, what to call instead. They resolve for one more release, and warn.
_MOVED: dict[str, tuple[str, str | None]] = {
    # loading: fh.load reads every format
    "import_model": ("flaxheads.interop", _LOAD),
    "load_transformers": ("flaxheads.interop", _LOAD),
    "load_sentence_transformers": ("flaxheads.interop", _LOAD),
    "load_peft": ("flaxheads.interop", "fh.load(adapter_folder, backbone=...)"),
    "load_head_export": ("flaxheads.interop", "fh.load(head_folder, backbone=...) for the model"),
    "model_from_checkpoint": ("flaxheads.checkpoint", "fh.load(run_folder, step=...)"),
    "load_adapters": ("flaxheads.checkpoint.adapters", None),
    "load_backbone": ("flaxheads.backbones.registry", None),
    # exporting: fh.export writes every format
    "export_transformers": ("flaxheads.interop", "fh.export(model, dest)"),
    "export_sentence_transformers": ("flaxheads.interop", "fh.export(model, dest, format='sentence-transformers')"),
    "export_head": ("flaxheads.interop", "fh.export(model, dest, format='head')"),
    "export_onnx": ("flaxheads.interop", "fh.export(model, dest, format='onnx')"),
    "export_cross_encoder": ("flaxheads.interop", "fh.export(model, dest, format='cross-encoder')"),
    "export_peft": ("flaxheads.interop", "fh.export(model, dest, format='peft')"),
    "ExportError": ("flaxheads.interop", None),
    "ModelImportError": ("flaxheads.interop", None),
    "TokenizerError": ("flaxheads.interop", None),
    # the model's parts
    "LoadReport": ("flaxheads.model.sequence", None),
    "build_head": ("flaxheads.model.sequence", None),
    "merge_model": ("flaxheads.model.lora", None),
    "ComputePlan": ("flaxheads.runtime", None),
    "PRESETS": ("flaxheads.heads.presets", None),
    "Preset": ("flaxheads.heads.presets", None),
    "PresetMatch": ("flaxheads.heads.presets", None),
    "PoolMaskError": ("flaxheads.heads.presets", None),
    "match_preset": ("flaxheads.heads.presets", None),
    "preset_for": ("flaxheads.heads.presets", None),
    "from_dict": ("flaxheads.config", None),
    "from_json": ("flaxheads.config", None),
    "to_dict": ("flaxheads.config", None),
    "to_json": ("flaxheads.config", None),
    # losses and problem types
    **{
        name: ("flaxheads.losses", None)
        for name in (
            "MULTI_LABEL",
            "REGRESSION",
            "SINGLE_LABEL",
            "infer_problem_type",
            "loss_fn",
            "mean_squared_error",
            "sigmoid_binary_cross_entropy",
            "softmax_cross_entropy",
            "validate_labels",
        )
    },
    # checkpoint errors
    **{
        name: ("flaxheads.checkpoint", None)
        for name in ("CheckpointError", "CorruptCheckpointError", "HeadMismatchError", "IncompatibleCheckpointError")
    },
}


def _moved_message(name: str) -> str:
    """The :class:`DeprecationWarning` of the old top-level name ``name``."""
    module, instead = _MOVED[name]
    where = f"{module}.{name}"
    return (
        f"fh.{name} moved: use {f'{instead} or {where}' if instead else where}; fh.{name} goes away in the next release"
    )


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBMODULES:
        value = _importlib.import_module(_SUBMODULES[name])
    elif name in _MOVED:  # not cached: it warns on every use
        _warnings.warn(_moved_message(name), DeprecationWarning, stacklevel=2)
        return getattr(_importlib.import_module(_MOVED[name][0]), name)
    elif not name.startswith("__") and _importlib_util.find_spec(f"{__name__}.{name}") is not None:
        value = _importlib.import_module(f"{__name__}.{name}")  # fh.training, fh.heads, ...
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next use finds it without this function
    return value


def __dir__() -> list[str]:
    """The front door, the submodules and the module's own attributes (not the names that moved)."""
    own = {n for n in globals() if not n.startswith("_") or n.startswith("__")}
    return sorted(own | set(__all__) | set(_SUBMODULES))
