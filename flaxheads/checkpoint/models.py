"""Whole models from checkpoints: the saved head on its backbone (and the trained backbone, when
the run saved it), ready to evaluate or export."""

from __future__ import annotations

import dataclasses
import os

from flaxheads.checkpoint.adapters import load_adapters
from flaxheads.checkpoint.heads import HeadCheckpoint, attach_head, load_backbone_params, load_head
from flaxheads.checkpoint.meta import CheckpointError, CheckpointNotFoundError
from flaxheads.model.pretrained import from_pretrained
from flaxheads.model.sequence import SequenceModel


def model_from_checkpoint(
    directory: str | os.PathLike,
    step: int | str | None = None,
    *,
    backbone: str | os.PathLike | None = None,
    head_only: bool = False,
    dtype=None,
) -> SequenceModel | HeadCheckpoint:
    """The model saved in a run / checkpoint folder, ready to export.

    ``head_only=True`` returns the ``HeadCheckpoint`` (enough for ``export_head``). Otherwise
    the backbone comes from the checkpoint's ``backbone`` item when it was trained and saved,
    on top of the backbone folder ``backbone`` (default: ``meta["backbone_name_or_path"]``), with
    the LoRA adapters the checkpoint holds (if any).
    ``dtype``: the backbone's compute dtype (default float32; params stay float32)."""
    step = int(step) if isinstance(step, str) and step.isdigit() else step
    ckpt = load_head(directory, step)
    if head_only:
        return ckpt
    meta = ckpt.meta
    path = os.fspath(backbone) if backbone else meta.get("backbone_name_or_path")
    if not path or not os.path.isdir(path):
        raise CheckpointNotFoundError(
            f"{ckpt.path}: the backbone folder {path!r} (recorded in the checkpoint's meta) does not exist here; "
            "pass backbone=<folder> (--backbone) with the same backbone, or export the head alone with "
            "format='head'"
        )
    stored = meta.get("base_dtype")  # a frozen base kept in bfloat16 is loaded as the head was trained on it
    base = from_pretrained(
        path,
        num_labels=int(meta["num_labels"]),
        ignore_mismatched_sizes=True,
        base_dtype=stored if stored in ("bfloat16", "float16") else None,
        quantize=meta.get("quantize"),
        **({} if dtype is None else {"dtype": dtype}),
    )
    if base.model_type != meta.get("backbone_model_type", base.model_type):
        raise CheckpointError(
            f"{ckpt.path}: the head was trained on a {meta['backbone_model_type']} backbone, "
            f"but {path!r} is a {base.model_type}; pass backbone=<folder> (--backbone) with a "
            f"{meta['backbone_model_type']} model"
        )
    model = attach_head(base, ckpt)
    if meta.get("backbone_saved"):
        bb = load_backbone_params(directory, ckpt.step, target=model.params["backbone"])
        model = dataclasses.replace(model, params={"backbone": bb, "head": model.params["head"]})
    if meta.get("lora") is not None:
        model = load_adapters(directory, model, ckpt.step)
    return dataclasses.replace(model, name_or_path=path)
