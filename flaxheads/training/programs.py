"""Compiled programs shared by training and prediction: the inference-mode forward of a model
(:func:`make_eval_step`), a forward with its parameters compiled in as constants, and counts of
how many programs a jitted function compiled (one per padded shape it has seen).

Training's steps are in :mod:`flaxheads.training.steps`, how a program runs on devices in
:mod:`flaxheads.runtime.parallel`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from flaxheads.data.batching import extra_inputs
from flaxheads.runtime.plan import ComputePlan


def make_eval_step(model) -> Callable:
    """``eval_step(params, batch) -> logits`` [B, N] float32, inference mode."""

    def eval_step(params, batch):
        return model.apply(params, batch["input_ids"], batch["attention_mask"], train=False, **extra_inputs(batch))

    return eval_step


def constants_program(
    fn: Callable, params, plan: ComputePlan, dtype=jnp.float32, *, force: bool | None = None
) -> Callable | None:
    """``jax.jit(batch -> fn(params, batch))`` with ``params`` compiled in as constants, for an
    inference program whose parameters stay the same over many calls, where ``plan`` says so for
    their size and the compute ``dtype`` (:meth:`~flaxheads.runtime.plan.ComputePlan.constant_weights`;
    ``force``: True or False instead of asking); None where they should stay an argument."""
    use = force if force is not None else plan.constant_weights(sum(x.nbytes for x in jax.tree.leaves(params)), dtype)
    return jax.jit(lambda batch: fn(params, batch)) if use else None


def jit_count(fn: Callable) -> int:
    """How many programs a jitted function holds (one per padded shape it has seen); -1 for a
    function that is not jitted."""
    size = getattr(fn, "_cache_size", None)
    return int(size()) if callable(size) else -1


class TraceCounter:
    """Counts how often a function is traced (= compiled, for a jitted function): one per new
    input shape. ``wrap(fn)`` returns the counting function to hand to ``jax.jit``."""

    def __init__(self) -> None:
        self.count = 0
        self.shapes: list[tuple] = []

    def wrap(self, fn: Callable) -> Callable:
        def counted(*args):
            self.count += 1
            self.shapes.append(tuple(np.shape(x) for x in jax.tree.leaves(args[-1])[:1]))
            return fn(*args)

        counted.__name__ = getattr(fn, "__name__", "step")
        return counted
