"""The loop's log of its steps: throughput (examples, tokens, model FLOPs per second, MFU), the mean
loss between log lines, the whole run's throughput and the progress bar."""

from __future__ import annotations

import time

import jax
import numpy as np
from tqdm.auto import tqdm

#: The wall-clock keys of a log entry (they differ between two runs of the same settings).
TIMED = ("examples_per_s", "tokens_per_s", "step_seconds", "model_tflops_per_s", "mfu")


class StepLog:
    """Throughput (examples, tokens, model FLOPs per second, MFU) and mean loss over the steps since
    the last log line, the whole run's throughput, and the progress bar. Evaluation time is left
    out of both; the run's totals also leave out the first step of the call (its compile)."""

    def __init__(self, every: int, total: int, start: int, progress: bool, peak: float | None = None):
        self.every, self.total, self.peak = every, total, peak
        self.bar = (
            tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, smoothing=0.1)
            if progress and jax.process_index() == 0
            else None
        )
        self.last = time.perf_counter()
        self.window = self._zero()
        self.run, self.run_seconds = self._zero(), 0.0
        self.prev: float | None = None  # when the previous step ended (pauses added)
        self.losses: list[float] = []

    @staticmethod
    def _zero() -> dict:
        return {"examples": 0.0, "tokens": 0.0, "flops": 0.0, "steps": 0}

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` (an evaluation) out of the rates."""
        self.last += seconds
        if self.prev is not None:
            self.prev += seconds

    def rates(self, totals: dict, seconds: float) -> dict:
        """examples / tokens / model TFLOP/s, seconds per step and MFU (where the peak is known)."""
        s = max(seconds, 1e-9)
        out = {
            "examples_per_s": totals["examples"] / s,
            "tokens_per_s": totals["tokens"] / s,
            "step_seconds": s / max(totals["steps"], 1),
        }
        if totals["flops"]:
            out["model_tflops_per_s"] = totals["flops"] / s / 1e12
            if self.peak:
                out["mfu"] = totals["flops"] / s / self.peak
        return out

    def step(self, m: dict, step: int) -> dict | None:
        """Adds the window's rates and ``loss_avg`` to ``m`` on a log step; returns the history entry."""
        now = time.perf_counter()
        # the first step of the call (its compile) is left out of the run's rates
        for totals in (self.window, self.run) if self.prev is not None else (self.window,):
            totals["examples"] += m["weight"]
            totals["tokens"] += m.get("tokens", 0)
            totals["flops"] += m.get("flops", 0.0)
            totals["steps"] += 1
        if self.prev is not None:
            self.run_seconds += now - self.prev
        self.prev = now
        self.losses.append(m["loss"])
        entry = None
        if step % self.every == 0 or step == self.total:
            m.update(self.rates(self.window, now - self.last))
            m["loss_avg"] = float(np.mean(self.losses))
            self.last, self.window, self.losses = now, self._zero(), []
            entry = {
                "step": step,
                "epoch": m["epoch"],
                "loss": m["loss_avg"],
                "step_loss": m["loss"],
                "grad_norm": m["grad_norm"],
                **{k: m[k] for k in TIMED if k in m},
            }
            if self.bar is not None:
                extra = {"tok_s": f"{m['tokens_per_s']:.0f}"} | ({"mfu": f"{m['mfu']:.1%}"} if "mfu" in m else {})
                self.bar.set_postfix(
                    loss=f"{m['loss']:.4f}", ex_s=f"{m['examples_per_s']:.1f}", **extra, ep=f"{m['epoch']:.2f}"
                )
        if self.bar is not None:
            self.bar.update(1)
        return entry

    def summary(self) -> dict:
        """The rates of the steps after the first of this call ({} when there were none)."""
        if not self.run["steps"]:
            return {}
        out = {k: float(f"{v:.6g}") for k, v in self.rates(self.run, self.run_seconds).items()}
        out["steps_timed"] = self.run["steps"]
        if self.run["flops"] and self.run["tokens"]:
            out["model_flops_per_token"] = round(self.run["flops"] / self.run["tokens"])
        if self.peak:
            out["peak_tflops"] = self.peak / 1e12
        return out

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
