"""A profiled window of training steps: a ``jax.profiler`` trace of steps A to B (``--profile-steps
A:B``, both included, counted as the log counts them: step 1 is the first). The trace starts after
step A-1 has finished and stops once step B has, so it holds those steps only (each marked by a
``StepTraceAnnotation`` named ``train``, which TensorBoard's profile plugin and Perfetto show as steps).

Written to ``<dir>/plugins/profile/<time>/`` (``*.xplane.pb`` for TensorBoard's profile plugin,
``*.trace.json.gz`` for Perfetto / chrome://tracing). Only process 0 traces."""

from __future__ import annotations

from pathlib import Path

import jax

from flaxheads.errors import UsageError
from flaxheads.training.loop import Callback


def parse_steps(text: str) -> tuple[int, int]:
    """``"20:25"`` -> ``(20, 25)``; refuses anything but two step numbers 1 <= A <= B."""
    try:
        a, b = (int(x) for x in str(text).split(":"))
    except ValueError:
        a = b = 0
    if not 1 <= a <= b:
        raise UsageError(
            f"--profile-steps {text}: expected A:B, two step numbers with 1 <= A <= B (e.g. 20:25: "
            "steps 20 to 25, both included)"
        )
    return a, b


class ProfileWindow(Callback):
    """Traces steps ``first`` to ``last`` into ``folder`` (see the module docstring)."""

    def __init__(self, folder: str | Path, first: int, last: int):
        self.folder, self.first, self.last = Path(folder), first, last
        self.tracing = False
        self.done = False

    def _start(self) -> None:
        if not self.tracing and not self.done:
            jax.profiler.start_trace(str(self.folder), create_perfetto_trace=True)
            self.tracing = True

    def _stop(self, state) -> None:
        if self.tracing:
            jax.block_until_ready(state)  # the traced steps' device work inside the window
            jax.profiler.stop_trace()
            self.tracing, self.done = False, True

    def on_begin(self, state, step: int) -> None:
        if step == self.first - 1:
            self._start()

    def on_step_end(self, state, step: int, metrics: dict) -> None:
        if step == self.first - 1:
            self._start()
        elif step == self.last:
            self._stop(state)

    def on_end(self, state, step: int) -> None:
        self._stop(state)  # a run shorter than the window: what it ran

    def traces(self) -> list[Path]:
        """The trace files written (Perfetto JSON and XPlane)."""
        return sorted(p for p in self.folder.glob("plugins/profile/*/*") if p.is_file())
