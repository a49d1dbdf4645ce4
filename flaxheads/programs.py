"""Compiled programs shared by training and prediction: the inference-mode forward of a model
(:func:`make_eval_step`), a forward with its parameters compiled in as constants, the compiled
form of a method called outside a trace (:func:`compiled_method`), and counts of how many programs
a jitted function compiled (one per padded shape it has seen).

Training's steps are in :mod:`flaxheads.training.steps`, how a program runs on devices in
:mod:`flaxheads.parallel`.
"""
from __future__ import annotations

import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .batching import extra_inputs
from .host.plan import ComputePlan


def make_eval_step(model) -> Callable:
    """``eval_step(params, batch) -> logits`` [B, N] float32, inference mode."""
    def eval_step(params, batch):
        return model.apply(params, batch["input_ids"], batch["attention_mask"], train=False, **extra_inputs(batch))
    return eval_step


def constants_program(fn: Callable, params, plan: ComputePlan, dtype=jnp.float32, *,
                      force: bool | None = None) -> Callable | None:
    """``jax.jit(batch -> fn(params, batch))`` with ``params`` compiled in as constants, for an
    inference program whose parameters stay the same over many calls, where ``plan`` says so for
    their size and the compute ``dtype`` (:meth:`~flaxheads.host.plan.ComputePlan.constant_weights`;
    ``force``: True or False instead of asking); None where they should stay an argument."""
    use = force if force is not None else plan.constant_weights(sum(x.nbytes for x in jax.tree.leaves(params)), dtype)
    return jax.jit(lambda batch: fn(params, batch)) if use else None


def outside_traces(*args, **kwargs) -> bool:
    """Whether a call with these arguments runs eagerly: no leaf is a tracer (the call is not inside
    ``jit``, ``grad`` or ``vmap``) and every keyword is an array or None (what ``jax.jit`` can take)."""
    if not all(v is None or isinstance(v, (np.ndarray, jax.Array)) for v in kwargs.values()):
        return False
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))


class _Held:
    """A compiled method kept on its object. A shallow copy of the object keeps the entry but does
    not use it: its ``owner`` id differs, and it holds the original only weakly, so a copy with new
    params does not keep the old ones alive."""

    __slots__ = ("owner", "fn")

    def __init__(self, owner: int, fn: Callable):
        self.owner, self.fn = owner, fn


def compiled_method(owner, method: str, **jit_kwargs) -> Callable:
    """``jax.jit(owner.<method>, **jit_kwargs)``, made once per object (kept in its ``__dict__``), for
    the methods that would otherwise run op by op when called outside a trace: on XLA:CPU each new
    operation compiles its own program (~50-100 ms), so an eager forward of a small encoder compiles
    a hundred programs where one jitted call compiles one."""
    name = f"_compiled_{method}"
    held = owner.__dict__.get(name)
    if held is None or held.owner != id(owner):
        ref = weakref.ref(owner)

        def call(*args, **kwargs):
            return getattr(ref(), method)(*args, **kwargs)

        held = _Held(id(owner), jax.jit(call, **jit_kwargs))
        owner.__dict__[name] = held
    return held.fn


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
