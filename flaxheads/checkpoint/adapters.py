"""LoRA adapters in checkpoints: the ``lora`` item beside the ``head``, and its config in ``meta``
(:func:`flaxheads.model.lora.adapters_meta`). A run's checkpoints and :func:`~.heads.save_head` write
them; :func:`load_adapters` puts them back on a model of the same base backbone, checked."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from flaxheads.checkpoint import io
from flaxheads.checkpoint.meta import LORA, META, IncompatibleCheckpointError, backbone_checksum, check_adapters
from flaxheads.model.lora import LoraConfig, adapters_meta, with_lora
from flaxheads.model.sequence import SequenceModel


def load_adapters(
    directory: str | os.PathLike, model: SequenceModel, step: int | str | None = None, *, sharding=None
) -> SequenceModel:
    """``model`` (the base backbone, any head) with the LoRA adapters a checkpoint saved.

    The checkpoint must have been written for this backbone: same ``model_type``, the same
    adapted modules with the same kernel shapes, and, when it recorded one, the same base
    weights (checksum); else :class:`IncompatibleCheckpointError` says what differs."""
    with io.open_step(directory, step) as (mgr, root, step):
        where = os.path.join(root, str(step))
        meta = io.read_json(mgr, root, step, META)
        if meta.get(LORA) is None:
            raise IncompatibleCheckpointError(
                f"{where} holds no LoRA adapters (it was not trained with --lora-rank); "
                "load its head with load_head / model_from_checkpoint"
            )
        if meta.get("backbone_model_type") != model.model_type:
            raise IncompatibleCheckpointError(
                f"{where}: the adapters were trained on a {meta.get('backbone_model_type')} backbone "
                f"({meta.get('backbone_name_or_path')!r}), not on this {model.model_type}; load that backbone"
            )
        base = dataclasses.replace(model, lora=None)
        params = {k: v for k, v in base.params.items() if k != LORA}
        target = with_lora(base, LoraConfig.from_dict(meta[LORA]), params=params)
        check_adapters(meta, adapters_meta(target), where)
        saved_sum = meta.get("backbone_checksum")
        if saved_sum is not None:
            have = backbone_checksum(params["backbone"])
            if not np.isclose(have, saved_sum, rtol=1e-6, atol=0.0):
                raise IncompatibleCheckpointError(
                    f"{where}: the adapters were trained on other base weights than this backbone's (weight checksum "
                    f"{have!r} vs {saved_sum!r}; trained on {meta.get('backbone_name_or_path')!r}). Adapters only "
                    "mean something on the exact base they were trained on: load that folder."
                )
        got = io.restore_arrays(
            mgr, root, step, {LORA: io.abstract(target.params[LORA], sharding or io.first_device())}
        )
        return dataclasses.replace(target, params={**target.params, LORA: got[LORA]})
