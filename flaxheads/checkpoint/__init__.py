"""Orbax checkpoints: heads saved apart from backbones, with the meta that checks compatibility.

Layout: one directory per step (``<root>/<step>/``), one Orbax item per piece::

    head/       the head params {"pooler": ..., "head": ...}          (always, unless it has no params)
    backbone/   the backbone params                                   (only when the backbone was trained)
    opt_state/  the optimiser state                                   (training checkpoints)
    extra/      any other array fields of the train state (rng, ...)  (training checkpoints, when present)
    step/       JSON: {"step": k, "metrics": {...}}
    meta/       JSON: library version, pooler/head config, problem type, labels, hidden width,
                backbone type and name/path, dtype, per-leaf shapes and their hash

A frozen backbone is not copied: ``meta`` names it (``backbone_name_or_path``). Restoring a
head reads ``meta`` and ``head`` only, never ``backbone``. Saves are Orbax's: asynchronous
and atomic (written to a temporary folder and renamed when complete), so a killed save never
becomes the latest step.

Modules: :mod:`.meta` (format, meta, errors), :mod:`.io` (Orbax plumbing), :mod:`.heads`
(head checkpoints), :mod:`.runs` (training runs), :mod:`.inspect` (verify, list, print),
:mod:`.models` (whole models from checkpoints).
"""

from flaxheads.checkpoint.heads import (
    HeadCheckpoint,
    attach_head,
    load_backbone_params,
    load_head,
    read_meta,
    save_head,
)
from flaxheads.checkpoint.inspect import format_listing, format_meta, list_checkpoints, verify_checkpoint
from flaxheads.checkpoint.io import is_checkpoint_folder, resolve_root
from flaxheads.checkpoint.meta import (
    FORMAT,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    HeadMismatchError,
    IncompatibleCheckpointError,
    backbone_checksum,
    expected_head_shapes,
    head_shapes,
    head_shapes_hash,
    make_meta,
)
from flaxheads.checkpoint.models import model_from_checkpoint
from flaxheads.checkpoint.runs import RunCheckpointer

__all__ = [
    "FORMAT",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "HeadCheckpoint",
    "HeadMismatchError",
    "IncompatibleCheckpointError",
    "RunCheckpointer",
    "attach_head",
    "backbone_checksum",
    "expected_head_shapes",
    "format_listing",
    "format_meta",
    "head_shapes",
    "head_shapes_hash",
    "is_checkpoint_folder",
    "list_checkpoints",
    "load_backbone_params",
    "load_head",
    "make_meta",
    "model_from_checkpoint",
    "read_meta",
    "resolve_root",
    "save_head",
    "verify_checkpoint",
]
