"""Preemption: SIGTERM (a scheduler's notice) or SIGINT (Ctrl-C) during training stops the run at
a step boundary, with that step checkpointed, so rerunning the same command loses nothing.

The pieces:

- :class:`SignalWatch` (a context manager) records the signal while training runs; the step in
  flight, its evaluation and its callbacks finish.
- :class:`StopOnSignal` (a :func:`~flaxheads.training.loop.fit` callback, placed after the
  checkpointing one) saves the step where the run stops, waits for the save, and raises
  :class:`Interrupted`; programs print its one line and exit ``128 + signal`` (130 / 143).
- A second signal after the first ends the process at once (one line, the same exit code):
  Orbax writes each step into a temporary folder and renames it when complete, so the previous
  checkpoint stays intact and the next run removes the half-written one.

Several processes (``jax.distributed``) must stop at the same step. JAX's distributed runtime owns
SIGTERM there: its preemption service tells every process and picks a step all of them reach
(:func:`jax.experimental.multihost_utils.reached_preemption_sync_point`, asked at every step).
A SIGINT on one process is handed to that service as a SIGTERM to itself.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
from jax.experimental import multihost_utils

from flaxheads.runtime.logs import get_logger
from flaxheads.training.loop import Callback, FitCheckpointing

SIGNALS = (signal.SIGTERM, signal.SIGINT)
logger = get_logger("flaxheads.training")


def exit_code(signum: int) -> int:
    """The shell's code for a process ended by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class Interrupted(Exception):
    """Training stopped by a signal at ``step``; ``saved`` is the step checkpointed there (None when
    the run saves no checkpoints). Not a ``FlaxheadsError``: programs exit ``128 + signal``."""

    def __init__(self, step: int, signum: int, saved: int | None):
        self.step, self.signum, self.saved = int(step), int(signum), saved
        super().__init__(self.line())

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)

    def line(self) -> str:
        if self.saved is None:
            return (
                f"interrupted at step {self.step}; no checkpoint saved (fit was given none to save with); "
                "a rerun starts over"
            )
        return f"interrupted at step {self.step}; checkpoint saved; rerun the same command to resume"


def finished_steps(root: str | os.PathLike | None) -> list[int]:
    """Step folders Orbax has committed under ``root`` (a save in progress has a temporary name)."""
    try:
        return sorted(int(n) for n in os.listdir(root) if n.isdigit())
    except (OSError, TypeError):
        return []


class SignalWatch:
    """While entered, SIGTERM and SIGINT are recorded (``signum``), not acted on; a second one ends
    the process at once (see the module docstring). ``multihost``: SIGTERM is left to JAX's
    preemption service, and :meth:`due` asks it for the step every process stops at.

    ``checkpoints`` is the folder whose latest finished step the abort line names; the line goes to
    ``write`` (default: the ``flaxheads.training`` logger, at ERROR: the process ends after it)."""

    def __init__(
        self,
        *,
        multihost: bool | None = None,
        checkpoints: str | os.PathLike | None = None,
        write: Callable[[str], None] | None = None,
    ):
        self.multihost = jax.process_count() > 1 if multihost is None else multihost
        self.checkpoints = checkpoints
        self.signum: int | None = None
        self.step = 0  # the last step the loop finished (for the abort line)
        self._write = write or logger.error
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | signal.Handlers | None] = {}

    def __enter__(self) -> SignalWatch:
        for s in SIGNALS:
            if self.multihost and s == signal.SIGTERM:
                continue  # the distributed runtime's preemption notifier listens to it
            if signal.getsignal(s) == signal.SIG_IGN:
                continue  # ignored on purpose (a shell's background job, nohup): stays ignored
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            self._abort(signum)
        self.signum = signum
        if self.multihost:  # tell every process through JAX's preemption service
            os.kill(os.getpid(), signal.SIGTERM)

    def _abort(self, signum: int) -> None:
        steps = finished_steps(self.checkpoints)
        kept = f"the latest checkpoint (step {steps[-1]}) is intact" if steps else "no checkpoint was saved"
        self._write(
            f"interrupted again after step {self.step}; stopped without saving it; {kept}; "
            "rerun the same command to resume"
        )
        os._exit(exit_code(self.signum or signum))

    def due(self, step: int) -> bool:
        """Whether the run stops after ``step`` (every process of a multi-process run gets the same
        answer; they must all ask at every step)."""
        self.step = step
        if self.multihost:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signum is not None

    def raise_if_signalled(self, step: int, saved: int | None) -> None:
        """After the loop: a signal that came after the last step's check still ends the run as
        interrupted (its final checkpoint is written by then)."""
        if self.signum is not None:
            raise Interrupted(step, self.signum, saved)


class StopOnSignal(Callback):
    """Ends :func:`~flaxheads.training.loop.fit` after the step where ``watch`` says to stop: saves
    that step through ``checkpoints`` (unless saved already), waits for the save, raises
    :class:`Interrupted`. Put it after ``checkpoints`` in the callbacks."""

    def __init__(self, watch: SignalWatch, checkpoints: FitCheckpointing | None):
        self.watch, self.checkpoints = watch, checkpoints

    def on_step_end(self, state, step: int, metrics=None) -> None:
        if not self.watch.due(step):
            return
        saved = None
        if self.checkpoints is not None:
            self.checkpoints.ckr.wait_until_finished()  # an earlier save in flight completes first
            self.checkpoints.on_end(state, step)  # this step, unless its evaluation saved it
            self.checkpoints.ckr.wait_until_finished()
            saved = step
        raise Interrupted(step, self.watch.signum or signal.SIGTERM, saved)
