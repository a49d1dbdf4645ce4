"""What :func:`~flaxheads.training.loop.fit` tells as it trains: :class:`Callback` (and :func:`hooks`,
one from plain functions), and :class:`FitCheckpointing`, the callback that saves a run at fit's
evaluations, so it has no schedule of its own to drift from fit's."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # annotation only: the checkpoint package does not depend on training
    from flaxheads.checkpoint import RunCheckpointer


class Callback:
    """What :func:`~flaxheads.training.loop.fit` calls; override any of these (the defaults do nothing). ``state`` is
    placed for the parallel mode (``trainer.parallel.get_state`` gives host arrays); ``step`` is
    the number of steps done."""

    def on_begin(self, state, step: int) -> None:
        """Before the first step this call of fit runs (``step`` steps are done already)."""

    def on_evaluate(self, state, step: int, results: dict[str, dict]) -> None:
        """After an evaluation: ``results`` is ``{split name: metrics}``."""

    def on_step_end(self, state, step: int, metrics: dict) -> None:
        """After every step, once that step's evaluation (if any) has been reported."""

    def on_end(self, state, step: int) -> None:
        """After the last step and its evaluation."""


class _Hooks(Callback):
    def __init__(self, on_step_end, on_evaluate, on_end):
        self._fns = {"on_step_end": on_step_end, "on_evaluate": on_evaluate, "on_end": on_end}

    def on_step_end(self, state, step, metrics):
        self._call("on_step_end", state, step, metrics)

    def on_evaluate(self, state, step, results):
        self._call("on_evaluate", state, step, results)

    def on_end(self, state, step):
        self._call("on_end", state, step)

    def _call(self, name, *args):
        if self._fns[name] is not None:
            self._fns[name](*args)


def hooks(
    *, on_step_end: Callable | None = None, on_evaluate: Callable | None = None, on_end: Callable | None = None
) -> Callback:
    """A :class:`Callback` from plain functions with the methods' signatures."""
    return _Hooks(on_step_end, on_evaluate, on_end)


def flat_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``{"validation": {"accuracy": 0.9, ...}}`` -> ``{"validation/accuracy": 0.9, ...}`` (scalars only)."""
    return {
        f"{split}/{k}": float(v)
        for split, r in results.items()
        for k, v in r.items()
        if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
    }


class FitCheckpointing(Callback):
    """Saves a :func:`~flaxheads.training.loop.fit` run through a
    :class:`~flaxheads.checkpoint.RunCheckpointer`: at every evaluation fit makes (with its metrics,
    for keep-best), every ``every`` steps (None: evaluations and the end only) and at the end;
    ``every=0``: at the end only (with the metrics of an evaluation there), so a finished run always
    holds its model. Each step is saved once.

    ``host_state`` turns the placed state into a saveable one (``parallel.get_state`` under
    pmap, whose state has a leading device axis); None saves it as placed (single device or
    mesh-replicated arrays, copied asynchronously)."""

    def __init__(self, ckr: RunCheckpointer, *, every: int | None = None, host_state: Callable | None = None):
        self.ckr, self.every, self.host_state = ckr, every, host_state
        self.saved: list[int] = []
        self._evaluated: tuple[int, dict] | None = None  # every=0: the latest evaluation, for the end's save

    def on_evaluate(self, state, step: int, results) -> None:
        m = flat_metrics(results)
        if self.ckr.best_metric is not None and self.ckr.best_metric not in m:
            raise KeyError(f"best metric {self.ckr.best_metric!r} is not among the evaluation metrics {sorted(m)}")
        if self.every != 0:
            self._save(state, step, m)
        else:
            self._evaluated = (step, m)

    def on_step_end(self, state, step: int, metrics=None) -> None:
        if self.every and step % self.every == 0:
            self._save(state, step)

    def on_end(self, state, step: int) -> None:
        evaluated = self._evaluated
        self._save(state, step, evaluated[1] if evaluated is not None and evaluated[0] == step else None)

    def _save(self, state, step: int, metrics=None) -> None:
        # saved already: at this step's evaluation, or before a run resumed at this very step
        if step in self.saved or step in self.ckr.all_steps():
            return
        self.ckr.save(step, state if self.host_state is None else self.host_state(state), metrics=metrics)
        self.saved.append(step)


def changed_settings(saved: Mapping[str, Any] | None, current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Keys whose values differ between a checkpoint's recorded run settings and the current ones."""
    out = []
    saved = saved or {}
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k), current.get(k)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += changed_settings(a, b, f"{prefix}{k}.")
        elif json.dumps(a, default=str, sort_keys=True) != json.dumps(b, default=str, sort_keys=True):
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out
