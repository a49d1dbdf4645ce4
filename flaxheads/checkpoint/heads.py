"""Heads stored on their own: save one, read it back without the backbone, attach it to a
backbone of the same width, and read a trained backbone a run saved."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from flaxheads.checkpoint import io
from flaxheads.checkpoint.meta import (
    BACKBONE,
    HEAD,
    LORA,
    META,
    STEP,
    CheckpointExistsError,
    CheckpointNotFoundError,
    HeadMismatchError,
    backbone_checksum,
    build_head,
    check_format,
    check_params_fit,
    check_saved_shapes,
    expected_head_shapes,
    int_keys,
    make_meta,
    path_str,
)
from flaxheads.heads.heads import SequenceHead
from flaxheads.heads.presets import check_pool_mask, match_preset
from flaxheads.model.sequence import LoadReport, SequenceModel, _module_paths


@dataclasses.dataclass
class HeadCheckpoint:
    """A head restored from a checkpoint: module, params (the ``head`` subtree) and ``meta``."""

    head: SequenceHead
    params: dict
    meta: dict
    step: int
    path: str

    @property
    def id2label(self) -> dict[int, str] | None:
        return int_keys(self.meta.get("id2label"))


def _head_params_of(model: SequenceModel, params) -> dict:
    if params is None:
        return model.params["head"]
    if isinstance(params, Mapping) and {"backbone", "head"} <= set(params):
        return params["head"]
    return params


def save_head(
    directory: str | os.PathLike,
    model: SequenceModel,
    params=None,
    *,
    step: int = 0,
    extra_meta: Mapping[str, Any] | None = None,
) -> str:
    """Save the head of ``model`` (``params``: full params, the head subtree, or None for
    ``model.params``) as step ``step`` under ``directory``; returns the step's folder.

    Writes the ``head`` and ``meta`` items only (plus ``lora`` for a model with adapters): the
    backbone is referenced by ``meta.backbone_name_or_path``. Blocks until the files are complete."""
    head_params = _head_params_of(model, params)
    check_params_fit(model.head, model.hidden_size, head_params, "save_head")
    arrays, extra = {HEAD: head_params}, dict(extra_meta or {})
    if getattr(model, "lora", None) is not None:  # adapters go with the head; the base is named and checksummed
        full = model.params if params is None or params is head_params else params
        arrays[LORA] = full[LORA]
        extra["backbone_checksum"] = backbone_checksum(full["backbone"])
    meta = make_meta(model, head_params, backbone_saved=False, extra=extra)
    root = os.path.abspath(os.fspath(directory))
    mgr = io.manager(root, async_save=False)
    try:
        if step in mgr.all_steps():
            raise CheckpointExistsError(
                f"{root} already has a checkpoint for step {step}; pass another step= or a new directory"
            )
        args = io.save_args(arrays, {META: meta, STEP: {"step": int(step), "metrics": None}})
        mgr.save(int(step), args=args, force=True)
        mgr.wait_until_finished()
        io.seal_step(root, int(step))
    finally:
        mgr.close()
    return os.path.join(root, str(int(step)))


def read_meta(directory: str | os.PathLike, step: int | str | None = None) -> tuple[dict, int, str]:
    """(meta, step, root) of a checkpoint; reads nothing but the ``meta`` item."""
    with io.open_step(directory, step) as (mgr, root, step):
        return io.read_json(mgr, root, step, META), step, root


def load_head(
    directory: str | os.PathLike, step: int | str | None = None, *, sharding: jax.sharding.Sharding | None = None
) -> HeadCheckpoint:
    """Restore a head (module + params + meta) without reading the backbone item.

    ``directory``: a run folder, a checkpoint root or one step's folder; ``step``: an int,
    ``None``/``"latest"`` or ``"best"``. Params land on ``sharding`` (default: the first
    device). Raises :class:`IncompatibleCheckpointError` when the saved config does not
    produce the saved shapes, :class:`CorruptCheckpointError` for damaged files."""
    with io.open_step(directory, step) as (mgr, root, step):
        where = os.path.join(root, str(step))
        meta = io.read_json(mgr, root, step, META)
        check_format(meta, where)
        head = build_head(meta, where)
        want = expected_head_shapes(head, int(meta["hidden_size"]))
        check_saved_shapes(meta, want, where)
        # restore in the dtypes that were saved (float32 or bfloat16), shapes from the config
        saved = meta.get("head_shapes", {})
        target = jax.tree_util.tree_map_with_path(
            lambda p, x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(saved.get(path_str(p), [None, x.dtype.name])[1])), want
        )
        params = io.restore_arrays(mgr, root, step, {HEAD: io.abstract(target, sharding or io.first_device())})[HEAD]
        return HeadCheckpoint(head=head, params=params, meta=meta, step=step, path=where)


def attach_head(model: SequenceModel, ckpt: HeadCheckpoint, *, pool_mask: str | None = None) -> SequenceModel:
    """``model`` with the checkpoint's head, head params, labels and problem type.

    The backbone must have the hidden width the head was trained on, and whatever its
    pooling mask needs (``non_pad_token``: a ``pad_token_id``; ``eos_token``: an
    ``eos_token_id``). ``pool_mask`` overrides the saved one (e.g. ``"attention_mask"``)."""
    meta = ckpt.meta
    src = (
        f"head checkpoint {ckpt.path} (trained on {meta.get('backbone_model_type')} "
        f"{meta.get('backbone_name_or_path')!r})"
    )
    tgt = f"backbone {model.model_type} {model.name_or_path!r}"
    if int(meta["hidden_size"]) != model.hidden_size:
        raise HeadMismatchError(
            f"hidden width mismatch: {src} expects hidden_size={meta['hidden_size']}, {tgt} has "
            f"hidden_size={model.hidden_size}. A head moves only between backbones of the same width; pick a "
            f"backbone with hidden_size={meta['hidden_size']} or train a new head on this one."
        )
    match = match_preset(
        model.backbone.config,
        int(meta["num_labels"]),
        ckpt.head.pooler,
        ckpt.head.head,
        pool_mask or meta.get("pool_mask", "attention_mask"),
    )
    check_pool_mask(
        match.pool_mask,
        pad_token_id=model.pad_token_id,
        eos_token_id=model.eos_token_id,
        subject=f"{src} attached to {tgt}",
        error=HeadMismatchError,
    )
    check_params_fit(ckpt.head, model.hidden_size, ckpt.params, f"attach_head({ckpt.path})")
    report = LoadReport(pretrained=[(p, f"{ckpt.path}/{HEAD}") for p in _module_paths(ckpt.params)], new=[])
    return dataclasses.replace(
        model,
        head=ckpt.head,
        num_labels=int(meta["num_labels"]),
        problem_type=meta["problem_type"],
        params={**model.params, "head": ckpt.params},
        id2label=ckpt.id2label,
        pool_mask=match.pool_mask,
        arch=match.arch,
        hf_names=match.hf_names,
        report=report,
    )


def load_backbone_params(
    directory: str | os.PathLike,
    step: int | str | None = None,
    *,
    target,
    sharding: jax.sharding.Sharding | None = None,
):
    """The ``backbone`` item of a checkpoint that saved it, in the structure/dtypes of ``target``
    (e.g. ``from_pretrained(meta["backbone_name_or_path"]).params["backbone"]``). Raises
    :class:`CheckpointNotFoundError` (a ``FileNotFoundError``) when the backbone was frozen (not
    saved: load it from its folder)."""
    with io.open_step(directory, step) as (mgr, root, step):
        meta = io.read_json(mgr, root, step, META)
        if not meta.get("backbone_saved"):
            raise CheckpointNotFoundError(
                f"{os.path.join(root, str(step))} does not contain the backbone (it was frozen); load it from "
                f"{meta.get('backbone_name_or_path')!r}"
            )
        return io.restore_arrays(mgr, root, step, {BACKBONE: io.abstract(target, sharding or io.first_device())})[
            BACKBONE
        ]
