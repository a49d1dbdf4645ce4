"""Several heads on one backbone forward (multi-task), each with its own loss and weight.

``params = {"backbone": ..., "heads": {task: head_params}}``. The encoder runs once per
batch; every task's pooler + head reads the same hidden states. The objective is
``sum_t weight_t * loss_t`` where ``loss_t`` is the task's weighted-mean loss over the
examples that carry its label (per-task example weights, so a batch may mix examples
labelled for different tasks). :meth:`MultiTaskModel.task_model` gives one task as a plain
:class:`flaxheads.SequenceModel` (predict, export, ``checkpoint.save_head``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from flaxheads.data.batching import extra_inputs
from flaxheads.errors import TrainingError
from flaxheads.heads import linen
from flaxheads.heads.heads import SequenceHead
from flaxheads.losses import check_problem_type, infer_problem_type, loss_fn
from flaxheads.model.sequence import build_head

_HEAD_KEYS = ("pooler", "head", "pooler_options", "head_options")


@dataclasses.dataclass
class Task:
    """One task: its head module, problem type, label count, loss weight and loss options."""

    name: str
    head: SequenceHead
    num_labels: int
    problem_type: str
    weight: float = 1.0
    loss_options: dict = dataclasses.field(default_factory=dict)
    id2label: dict[int, str] | None = None

    def __post_init__(self):
        check_problem_type(self.problem_type, self.num_labels)
        if self.weight < 0:
            raise TrainingError(
                f"task {self.name!r}: loss weight must be >= 0 (0 trains nothing for it), got {self.weight}"
            )


@dataclasses.dataclass
class MultiTaskModel:
    """A :class:`SequenceModel`'s backbone shared by several task heads."""

    base: Any  # SequenceModel: backbone, pooling mask rules, config
    tasks: list[Task]
    params: dict

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def features(self, backbone_params, input_ids, attention_mask, **kw):
        return self.base.features(backbone_params, input_ids, attention_mask, **kw)

    def heads_apply(
        self, heads_params: dict, hidden, mask, *, train: bool = False, dropout_rng: jax.Array | None = None
    ) -> dict[str, jax.Array]:
        """Every task's logits from one set of hidden states."""
        if train and dropout_rng is None:
            raise ValueError("train=True needs a dropout_rng")
        out: dict[str, jax.Array] = {}
        for i, t in enumerate(self.tasks):
            rngs = {"dropout": jax.random.fold_in(dropout_rng, i)} if train and dropout_rng is not None else {}
            logits = linen.module(t.head).apply(
                {"params": heads_params[t.name]}, hidden, mask, deterministic=not train, rngs=rngs
            )
            out[t.name] = cast(jax.Array, logits)  # apply returns the output alone when nothing is mutable
        return out

    def apply(
        self,
        params: dict,
        input_ids,
        attention_mask=None,
        *,
        train: bool = False,
        dropout_rng: jax.Array | None = None,
        **extra,
    ) -> dict[str, jax.Array]:
        """``{task: logits [B, N_task]}`` from one backbone forward."""
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        rb: jax.Array | None = None
        rh: jax.Array | None = None
        if train:
            if dropout_rng is None:
                raise ValueError("train=True needs a dropout_rng")
            rb, rh = jax.random.split(dropout_rng)
        hidden, mask = self.features(
            params["backbone"], input_ids, attention_mask, train=train, dropout_rng=rb, **extra
        )
        return self.heads_apply(params["heads"], hidden, mask, train=train, dropout_rng=rh)

    def loss(self, logits: dict, labels: dict, weights: dict | jax.Array) -> tuple[jax.Array, dict]:
        """``(sum_t w_t * loss_t, {task: loss_t})``. ``weights``: one ``[B]`` array for all tasks
        or ``{task: [B]}`` (0 where an example has no label for that task)."""
        per = {}
        total = jnp.zeros((), jnp.float32)
        for t in self.tasks:
            w = weights[t.name] if isinstance(weights, dict) else weights
            lt = loss_fn(t.problem_type, t.num_labels, **t.loss_options)(logits[t.name], labels[t.name], w)
            # A batch with no labels for this task contributes 0, not NaN (0 / 0).
            lt = jnp.where(jnp.sum(w) > 0, lt, 0.0)
            per[t.name] = lt
            total = total + t.weight * lt
        return total, per

    def task_model(self, name: str, params: dict | None = None):
        """Task ``name`` as a plain :class:`SequenceModel` (its head, the shared backbone)."""
        params = self.params if params is None else params
        t = self.tasks[self.names.index(name)]
        return dataclasses.replace(
            self.base,
            head=t.head,
            num_labels=t.num_labels,
            problem_type=t.problem_type,
            id2label=t.id2label,
            arch=None,
            hf_names=(),
            params={"backbone": params["backbone"], "head": params["heads"][name]},
        )


def multitask(model, tasks: Sequence[dict], *, seed: int = 0) -> MultiTaskModel:
    """Heads for ``tasks`` on ``model``'s backbone. Each task is a dict with ``name``,
    ``num_labels`` and optionally ``pooler``, ``head``, ``pooler_options``, ``head_options``,
    ``problem_type``, ``weight``, ``loss_options``, ``id2label``. A task without ``pooler``
    and ``head`` reuses ``model``'s head configuration and params (e.g. the pretrained pooler)."""
    out, heads, seen = [], {}, set()
    h = model.hidden_size
    for i, spec in enumerate(tasks):
        spec = dict(spec)
        name = spec.pop("name", None)
        if not name or name in seen:
            raise TrainingError(f"task {i}: every task needs a unique 'name' (got {name!r}); name each task once")
        seen.add(name)
        n = int(spec.pop("num_labels"))
        ptype = spec.pop("problem_type", None) or infer_problem_type(n)
        weight = float(spec.pop("weight", 1.0))
        lopts = dict(spec.pop("loss_options", {}) or {})
        id2label = spec.pop("id2label", None)
        unknown = set(spec) - set(_HEAD_KEYS)
        if unknown:
            raise TrainingError(
                f"task {name!r}: unknown keys {sorted(unknown)}; a task takes name, num_labels, "
                f"problem_type, weight, loss_options, id2label and {', '.join(_HEAD_KEYS)}"
            )
        if not any(spec.values()) and n == model.num_labels:
            head, hp = model.head, model.params["head"]
        else:
            head, _ = build_head(
                model.backbone.config,
                n,
                pooler=spec.get("pooler"),
                head=spec.get("head"),
                pooler_options=spec.get("pooler_options"),
                head_options=spec.get("head_options"),
            )
            hp = linen.init_head(head, h, jax.random.PRNGKey(seed + i))
        out.append(Task(name, head, n, ptype, weight, lopts, id2label))
        heads[name] = hp
    return MultiTaskModel(model, out, {"backbone": model.params["backbone"], "heads": heads})


def make_multitask_train_step(
    mt: MultiTaskModel, tx: optax.GradientTransformation, *, freeze_backbone: bool = False
) -> Callable:
    """``step(state, batch) -> (state, metrics)`` with ``state = (step, params, opt_state, rng)``
    as a dict. ``batch``: ``input_ids``, ``attention_mask``, ``labels`` ({task: [B, ...]}),
    ``weights`` ([B] or {task: [B]}). Metrics: ``loss`` and ``loss/<task>``."""

    def trainable(p):
        return {"heads": p["heads"]} if freeze_backbone else p

    def step(state: dict, batch: dict):
        key = jax.random.fold_in(state["rng"], state["step"])
        extra = extra_inputs(batch)

        def objective(t):
            params = {**state["params"], **t}
            if freeze_backbone:
                rb, rh = jax.random.split(key)
                hidden, mask = mt.features(
                    params["backbone"], batch["input_ids"], batch["attention_mask"], train=False, **extra
                )
                logits = mt.heads_apply(
                    params["heads"], jax.lax.stop_gradient(hidden), mask, train=True, dropout_rng=rh
                )
            else:
                logits = mt.apply(
                    params, batch["input_ids"], batch["attention_mask"], train=True, dropout_rng=key, **extra
                )
            total, per = mt.loss(logits, batch["labels"], batch["weights"])
            return total, per

        t = trainable(state["params"])
        (loss, per), grads = jax.value_and_grad(objective, has_aux=True)(t)
        updates, opt = tx.update(grads, state["opt_state"], t)
        t = optax.apply_updates(t, updates)
        new = {**state, "step": state["step"] + 1, "params": {**state["params"], **t}, "opt_state": opt}
        return new, {"loss": loss, **{f"loss/{k}": v for k, v in per.items()}}

    return step


def init_multitask_state(
    mt: MultiTaskModel, tx: optax.GradientTransformation, *, freeze_backbone: bool = False, seed: int = 0
) -> dict:
    t = {"heads": mt.params["heads"]} if freeze_backbone else mt.params
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": mt.params,
        "opt_state": tx.init(t),
        "rng": jax.random.PRNGKey(seed),
    }
