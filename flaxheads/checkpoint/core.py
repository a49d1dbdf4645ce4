"""Glue between :func:`flaxheads.training.fit` and :class:`RunCheckpointer`: the save hooks, and
the run settings a resumed run compares."""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from .runs import RunCheckpointer


def flat_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``{"validation": {"accuracy": 0.9, ...}}`` -> ``{"validation/accuracy": 0.9, ...}`` (scalars only)."""
    return {f"{split}/{k}": float(v) for split, r in results.items() for k, v in r.items()
            if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}


class FitCheckpointing:
    """``on_step_end`` / ``on_eval`` hooks for :func:`flaxheads.train.fit` that save through a
    :class:`RunCheckpointer`: at every evaluation (with its metrics, for keep-best), every
    ``every`` steps (None: evaluations only; 0: never) and at the last step.

    ``host_state`` turns the placed state into a saveable one (``parallel.get_state`` under
    pmap, whose state has a leading device axis); None saves it as placed (single device or
    mesh-replicated arrays, copied asynchronously)."""

    def __init__(self, ckr: RunCheckpointer, *, every: int | None, eval_every: int, total: int, has_evals: bool,
                 host_state=None):
        self.ckr, self.every, self.eval_every, self.total = ckr, every, eval_every, total
        self.has_evals, self.host_state = has_evals, host_state
        self.saved: list[int] = []

    def _evaluated(self, step: int) -> bool:  # mirrors fit(): each eval_every steps, and the last step
        return self.has_evals and (step % self.eval_every == 0 or step == self.total)

    def _due(self, step: int) -> bool:
        if self.every == 0:
            return False
        return step == self.total or bool(self.every and step % self.every == 0) or self._evaluated(step)

    def _save(self, state, step: int, metrics=None) -> None:
        if step in self.ckr.all_steps():  # resumed at the very step it was saved (e.g. the last one)
            return
        self.ckr.save(step, state if self.host_state is None else self.host_state(state), metrics=metrics)
        self.saved.append(step)

    def on_step_end(self, state, step: int, metrics=None) -> None:
        if self._due(step) and not self._evaluated(step):
            self._save(state, step)

    def on_eval(self, state, step: int, results) -> None:
        if self._due(step):
            m = flat_metrics(results)
            if self.ckr.best_metric is not None and self.ckr.best_metric not in m:
                raise KeyError(f"best metric {self.ckr.best_metric!r} is not among the evaluation metrics "
                               f"{sorted(m)}")
            self._save(state, step, m)


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
