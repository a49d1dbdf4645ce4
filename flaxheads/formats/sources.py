"""Loading a model to predict with, by what its folder holds: a run folder or checkpoint
(:func:`~flaxheads.checkpoint.model_from_checkpoint`), a head export on a backbone folder, a PEFT
LoRA adapter on its base folder (:func:`~flaxheads.interop.peft.load_peft`), a sentence-transformers
folder or a transformers classifier (:func:`~flaxheads.interop.import_model`).
Each gives the model, its tokenizer folder and the settings it was made with (maximum length,
buckets, threshold)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp

from flaxheads.checkpoint import attach_head, model_from_checkpoint, resolve_root
from flaxheads.checkpoint.heads import HeadCheckpoint
from flaxheads.checkpoint.kinds import FolderKind, folder_kind, not_loadable
from flaxheads.checkpoint.meta import CHECKPOINTS_SUBDIR
from flaxheads.disk import checksums
from flaxheads.errors import UsageError
from flaxheads.interop import import_model, load_head_export
from flaxheads.interop.peft import adapter_tokenizer_folder, load_peft
from flaxheads.interop.remote_code import threshold_of
from flaxheads.model.hub import resolve_model_source
from flaxheads.model.pretrained import from_pretrained
from flaxheads.model.sequence import SequenceModel
from flaxheads.runtime.phases import phase


@dataclasses.dataclass
class Loaded:
    """A model and what its source says about using it (None: not recorded there)."""

    model: SequenceModel
    tokenizer_folder: str
    kind: FolderKind  # run, head export, PEFT adapter, sentence-transformers or transformers
    max_length: int | None = None
    buckets: tuple[int, ...] | None = None
    threshold: float | None = None


def run_config(path: str) -> dict:
    """The ``config.json`` of the training run a checkpoint folder belongs to ({} if none)."""
    root, _ = resolve_root(path)
    run_dir = os.path.dirname(root) if os.path.basename(root) == CHECKPOINTS_SUBDIR else root
    cfg_path = os.path.join(run_dir, "config.json")
    if not os.path.isfile(cfg_path):
        return {}
    with open(cfg_path) as f:
        cfg = json.load(f)
    return cfg if isinstance(cfg, dict) and "max_length" in cfg else {}


def _from_run(path: str, step, backbone: str | None, dtype) -> Loaded:
    cfg = run_config(path)
    if dtype is None:
        dtype = jnp.bfloat16 if cfg.get("bf16") else jnp.float32
    model = model_from_checkpoint(path, step, backbone=backbone, dtype=dtype)
    assert isinstance(model, SequenceModel)  # not head_only: the whole model
    return Loaded(
        model,
        backbone or model.name_or_path,
        FolderKind.RUN,
        cfg.get("max_length"),
        tuple(cfg["buckets"]) if cfg.get("buckets") else None,
        (cfg.get("train") or {}).get("threshold"),
    )


def _from_head_export(path: str, backbone: str | None, dtype) -> Loaded:
    head, params, cfg = load_head_export(path)
    backbone = backbone or cfg.get("backbone_name_or_path")
    if not backbone or not os.path.isdir(backbone):
        raise UsageError(
            f"{path} is a head export (no backbone weights): pass the backbone folder it was trained on "
            f"(backbone=..., --backbone); the export names {cfg.get('backbone_name_or_path')!r}, which "
            "is not a folder here"
        )
    base = from_pretrained(
        backbone, num_labels=int(cfg["num_labels"]), ignore_mismatched_sizes=True, dtype=dtype or jnp.float32
    )
    model = attach_head(base, HeadCheckpoint(head=head, params=params, meta=cfg, step=0, path=path))
    return Loaded(model, backbone, FolderKind.HEAD_EXPORT)


def _sbert_max_length(path: str) -> int | None:
    p = os.path.join(path, "sentence_bert_config.json")
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        n = json.load(f).get("max_seq_length")
    return int(n) if n else None


def load_source(
    source: str | os.PathLike,
    *,
    step=None,
    backbone: str | os.PathLike | None = None,
    dtype=None,
    revision: str | None = None,
    verify: bool = False,
    task: str | None = None,
) -> Loaded:
    """The model in ``source`` (a local folder or a hub id), with its tokenizer folder and settings:
    what :func:`flaxheads.load` and :meth:`flaxheads.Classifier.from_pretrained` read through.

    ``step``: a run's checkpoint step (an int, ``"latest"`` or ``"best"``); ``backbone``: the
    backbone folder of a head export or of a PEFT adapter, or of a run whose recorded backbone moved;
    ``verify``: check every byte against the recorded checksums (else their size and sampled bytes);
    ``task``: a transformers folder's task adapters (:func:`flaxheads.from_pretrained`'s ``task``)."""
    path = resolve_model_source(source, revision=revision)
    backbone = None if backbone is None else resolve_model_source(backbone, what="backbone")
    with checksums.full(verify), phase(f"loading the model {path}"):
        return _load(path, step, backbone, dtype, task)


def _load(path: str, step, backbone: str | None, dtype, task: str | None = None) -> Loaded:
    if not os.path.isdir(path):
        raise UsageError(
            f"{path!r} is a file; expected a run folder, a checkpoint folder, a transformers or "
            "sentence-transformers model folder, or a head export"
        )
    kind = folder_kind(path)
    if kind is None:  # nothing flaxheads reads: say what the folder holds and what it lacks
        raise UsageError(not_loadable(path))
    if kind is not FolderKind.RUN:  # a checkpoint step checks its own files as they are read
        checksums.verify_folder(path)
    if step not in (None, "latest") and kind is not FolderKind.RUN:
        raise UsageError(
            f"a checkpoint step ({step!r}) was given, but {path} is {kind.described}, not a run or checkpoint folder"
        )
    if task is not None and kind is not FolderKind.TRANSFORMERS:
        raise UsageError(f"task={task!r} picks a transformers folder's task adapters; {path} is a {kind.value} folder")
    if kind is FolderKind.PEFT_ADAPTER:
        model = load_peft(path, backbone=backbone, dtype=dtype or jnp.float32)
        return Loaded(model, adapter_tokenizer_folder(path, model.name_or_path), kind)
    if kind is FolderKind.HEAD_EXPORT:
        return _from_head_export(path, backbone, dtype)
    if kind is FolderKind.RUN:
        return _from_run(path, step, backbone, dtype)
    if backbone is not None:
        raise UsageError(
            f"a backbone folder was given, but {path} holds a whole model (backbone included); "
            "the backbone option is for head exports and runs"
        )
    options = {} if dtype is None else {"dtype": dtype}
    options = options if task is None else {**options, "task": task}
    model = import_model(path, **options)  # a transformers folder, or one that says what it lacks
    if kind is FolderKind.SENTENCE_TRANSFORMERS:
        return Loaded(model, path, kind, _sbert_max_length(path))
    return Loaded(model, path, FolderKind.TRANSFORMERS, threshold=threshold_of(path))
