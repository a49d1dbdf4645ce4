"""The files of a run folder: ``config.json``, ``metrics.jsonl`` and TensorBoard event files
(written while training, by a ``fit`` callback; ``report_to``), ``eval.txt``, ``summary.json``,
``evaluation.json``, ``predictions.npz``, ``curve.png``, ``confusion_matrix.png`` and ``report.html``.
Only process 0 of a multi-process run writes. What a run tells goes to the ``flaxheads.run`` logger
(:mod:`flaxheads.runtime.logs`): its start line and final metrics table at ``SUMMARY`` (a
notebook's default), the folder, evaluations, per-class tables and timings at ``INFO``."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from flaxheads.disk.files import write_marker
from flaxheads.run.reporters import Reporters
from flaxheads.runtime import phases
from flaxheads.runtime.logs import SUMMARY, get_logger
from flaxheads.tasks.metrics import format_table
from flaxheads.training import loop
from flaxheads.training.optim import OptimConfig, learning_rates

#: Keys of fit's step metrics that go to metrics.jsonl (``loop.TIMED``: the wall-clock ones).
LOGGED = ("epoch", "loss", "loss_avg", "grad_norm", "padding", *loop.TIMED)

_logger = get_logger("flaxheads.run")


def scalars(results: dict) -> dict:
    """The scalar metrics of one evaluation (no per-class tables or matrices)."""
    return {k: v for k, v in results.items() if isinstance(v, (int, float))}


class RunLog(loop.Callback):
    """The run's log (``metrics.jsonl``, event files): an entry every ``log_every`` steps (loss,
    throughput, learning rates) and one per evaluation; evaluations are also told at INFO (``lead``)."""

    def __init__(
        self, sinks: Reporters, optim: OptimConfig, total: int, log_every: int, metric: str, lead: bool = True
    ):
        self.sinks, self.optim, self.total, self.log_every, self.metric = sinks, optim, total, log_every, metric
        self.lead = lead

    def write(self, entry: dict) -> None:
        self.sinks.write(entry)

    def on_step_end(self, state, step: int, metrics: dict) -> None:
        if step % self.log_every == 0 or step == self.total:
            # the rates this step used: optimizer step (step - 1) // accumulation
            rates = learning_rates(self.optim, (step - 1) // self.optim.accumulation_steps)
            self.write({"step": step, **{k: metrics[k] for k in LOGGED if k in metrics}, **rates})

    def on_evaluate(self, state, step: int, results: dict) -> None:
        self.write({"step": step, "eval": {n: scalars(r) for n, r in results.items()}})
        if self.lead:
            line = ", ".join(f"{n} {self.metric} {r[self.metric]:.4f}" for n, r in results.items())
            _logger.info(f"step {step}: {line}")


class RunFolder:
    """One run's folder; ``lead=False`` (processes other than 0) writes and tells nothing."""

    def __init__(self, path: Path, lead: bool = True):
        self.path, self.lead = Path(path), lead
        self.log: RunLog | None = None

    def start(self, config: dict, intro: str) -> None:
        """Create the folder, write ``config.json`` and tell where the run goes (INFO) and, in one
        line, what it does (``intro``, SUMMARY)."""
        if not self.lead:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        write_marker(self.path, "run")
        (self.path / "config.json").write_text(json.dumps(config, indent=2, default=str))
        _logger.info(f"run folder: {self.path}")
        _logger.log(SUMMARY, intro)

    def logger(
        self,
        optim: OptimConfig,
        total: int,
        log_every: int,
        metric: str,
        *,
        report_to: Iterable[str] = ("jsonl",),
        resumed_at: int | None = None,
    ) -> RunLog:
        """The ``fit`` callback that writes ``metrics.jsonl`` and the event files (``report_to``;
        ``metric``: the one told per evaluation; ``resumed_at``: the step a resumed run starts
        from, whose log it appends to; else the log starts anew)."""
        sinks = Reporters(
            self.path if self.lead else None,
            report_to,
            purge_step=None if resumed_at is None else resumed_at + 1,
            append=resumed_at is not None,
        )
        self.log = RunLog(sinks, optim, total, log_every, metric, self.lead)
        return self.log

    def write_results(self, summary: dict, final: dict, id2label: dict | None, predictions: dict | None = None) -> str:
        """``eval.txt``, ``summary.json`` and ``predictions.npz``; returns the eval text."""
        text = "\n\n".join(f"== {n} ==\n{format_table(r, id2label)}" for n, r in final.items())
        if not self.lead:
            return text
        (self.path / "eval.txt").write_text(text + "\n")
        (self.path / "evaluation.json").write_text(json.dumps(final, default=_plain))
        if predictions:
            np.savez(
                self.path / "predictions.npz",
                **{f"{split}_{k}": v for split, arrays in predictions.items() for k, v in arrays.items()},
            )
        # last and whole (renamed into place): a run with a summary.json is a finished run
        tmp = self.path / ".summary.json.tmp"
        with phases.temporary(str(tmp)):
            tmp.write_text(json.dumps(summary, indent=2, default=str))
            with phases.committing():
                tmp.replace(self.path / "summary.json")
        return text

    def finish(
        self,
        summary: dict,
        final: dict,
        predictions: dict,
        id2label: dict | None,
        *,
        history: list[dict],
        metric: str,
        tail: str,
        worst: dict | None = None,
    ) -> None:
        """The final log line, the result files, plots and ``report.html`` (``metric``: the curve's
        validation metric; ``worst``: the worst-classified examples' table); then the metrics table
        (SUMMARY), the per-split tables and ``tail`` with the folder and the report (INFO)."""
        if self.log is not None:
            self.log.write({"step": summary["steps"], "final": summary["metrics"]})
            self.log.sinks.close()
        text = self.write_results(summary, final, id2label, predictions)
        if not self.lead:
            return
        from flaxheads.run.plots import (  # matplotlib: loaded when a run ends, not on import
            plot_confusion_matrix,
            plot_curve,
        )
        from flaxheads.run.report import write_report

        if worst is not None:
            (self.path / "worst_examples.json").write_text(json.dumps(worst, default=_plain))
        plot_curve(self.path / "curve.png", history, metric)
        for name in ("test", "validation"):
            if "confusion_matrix" in final.get(name, {}):
                plot_confusion_matrix(
                    self.path / "confusion_matrix.png", final[name]["confusion_matrix"], id2label, name
                )
                break
        page = write_report(self.path)
        if text:
            _logger.info(f"\n{text}\n")
        if final:
            _logger.log(SUMMARY, metrics_table(final))
        _logger.info(f"{tail}; run folder: {self.path}; report: {page}")


def metrics_table(final: dict) -> str:
    """The scalar metrics of each split as one table, a row per split (``-``: not measured there)."""
    rows = {n: scalars(r) for n, r in final.items()}
    cols = list(dict.fromkeys(k for r in rows.values() for k in r))
    if not cols:
        return "no metrics"
    w = max(len(n) for n in rows)
    widths = [max(len(c), 7) for c in cols]

    def cell(v) -> str:
        return "-" if v is None else f"{v:d}" if isinstance(v, int) and not isinstance(v, bool) else f"{v:.4f}"

    lines = [" " * w + "".join(f"  {c:>{n}}" for c, n in zip(cols, widths))]
    lines += [
        f"{name:<{w}}" + "".join(f"  {cell(r.get(c)):>{n}}" for c, n in zip(cols, widths)) for name, r in rows.items()
    ]
    return "\n".join(lines)


def _plain(x):
    """numpy values in an evaluation's tables, as JSON."""
    return x.tolist() if hasattr(x, "tolist") else str(x)
