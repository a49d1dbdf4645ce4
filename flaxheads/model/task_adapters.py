"""Task adapters shipped inside a model folder, selected by task name: Jina Embeddings v3's five LoRA
adapters (``retrieval.query``, ``retrieval.passage``, ``separation``, ``classification``, ``text-matching``).

:func:`with_task` puts one task's adapters on a model loaded from that folder, either

* as LoRA adapters (``merge=False``, the default): ``model.lora`` and ``params["lora"]`` hold the task's
  adapters of the linear layers, so they train on (as any LoRA model: the base stays frozen) and
  export as a PEFT folder, or merged, as any model with adapters; or
* merged (``merge=True``): a plain model whose kernels hold ``W + (alpha / r) A B``.

Adapters of embedding tables (jina adapts the word and token-type embeddings too) have no LoRA form in
flaxheads (its adapters act on dense kernels), so both ways add their delta to the tables. The logits are
those of PEFT's ``PeftModel`` / jina's code with the task's adapter on the same weights. Where the
adapters come from (jina's own layout or PEFT subfolders) is the family's business
(:func:`flaxheads.backbones.families.jina_v3.task_adapters`).

So a PEFT export of a task model whose adapters touch the embeddings holds the kernel adapters only, and
on the folder's own base lacks the table deltas: export such a model merged (the transformers format),
whose weights hold everything.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from flaxheads.backbones.families import jina_v3
from flaxheads.errors import ConfigError, UsageError
from flaxheads.model.lora import LORA, A, B, LoraConfig, check_adapters, merge_lora


def task_names(model, folder: str | os.PathLike | None = None) -> list[str]:
    """The tasks whose adapters ``folder`` (default: the folder the model was loaded from) holds."""
    _check_family(model)
    return jina_v3.task_names(os.fspath(folder or model.name_or_path), model.backbone.config)


def check_task(folder: str | os.PathLike, config, task: str) -> None:
    """Refuse, in one line naming the folder's tasks, a ``task`` whose adapters ``folder`` (of ``config``, its
    family's config) does not hold, or a folder of another family: before any weight is read."""
    if config.get("model_type") not in jina_v3.JinaV3Backbone.model_types:
        raise ConfigError(
            f"task={task!r}: task adapters are Jina Embeddings v3's (model_type jina_embeddings_v3); "
            f"{os.fspath(folder)} is a {config.get('model_type')}: load it without task"
        )
    known = jina_v3.task_names(os.fspath(folder), config)
    if task not in known and jina_v3.task_dir(task) not in known:
        raise UsageError(
            f"unknown task {task!r}: {os.fspath(folder)} has adapters for "
            f"{', '.join(known) if known else 'no task'}; pass one of those"
        )


def _check_family(model) -> None:
    if not isinstance(model.backbone, jina_v3.JinaV3Backbone):
        raise ConfigError(
            f"task adapters are Jina Embeddings v3's (model_type jina_embeddings_v3); this model is a "
            f"{model.model_type}: give it LoRA adapters with model.with_lora(...) instead"
        )


def with_task(model, task: str, *, merge: bool = False, folder: str | os.PathLike | None = None):
    """``model`` with the adapters of ``task`` from ``folder`` (default: the folder the model was loaded from):
    as LoRA adapters, or merged into the weights with ``merge=True`` (see the module docstring)."""
    _check_family(model)
    if getattr(model, "lora", None) is not None:
        raise ConfigError("this model already has LoRA adapters; start from the model as loaded to pick a task")
    source = os.fspath(folder or model.name_or_path)
    if not source:
        raise ConfigError("the model does not know its folder (name_or_path is empty): pass folder=...")
    check_task(source, model.backbone.config, task)
    ad = jina_v3.task_adapters(source, model.backbone.config, task)
    flat = flatten_dict(model.params["backbone"])
    for path, delta in ad.deltas.items():
        if path not in flat or np.shape(flat[path]) != np.shape(delta):
            raise ConfigError(
                f"{source}: the adapter of task {task!r} changes {'/'.join(path)} "
                f"{np.shape(delta)}, which this backbone does not have in that shape"
            )
        flat[path] = flat[path] + jnp.asarray(delta, flat[path].dtype)
    backbone = unflatten_dict(flat)
    params = {**model.params, "backbone": backbone}
    if not ad.kernels:  # the task adapts embedding tables only
        return dataclasses.replace(model, params=params)
    lora = unflatten_dict(
        {m + (part,): jnp.asarray(x, jnp.float32) for m, ab in ad.kernels.items() for part, x in zip((A, B), ab)}
    )
    config = LoraConfig(rank=ad.rank, alpha=ad.alpha, targets=tuple("/".join(m) for m in ad.kernels))
    check_adapters(config, lora, backbone, model.model_type, f"{source} (task {task!r})")
    if merge:
        return dataclasses.replace(
            model,
            params={
                **params,
                "backbone": jax.tree.map(jnp.asarray, merge_lora(backbone, lora, config, model.model_type)),
            },
        )
    return dataclasses.replace(model, lora=config, params={**params, LORA: lora})
