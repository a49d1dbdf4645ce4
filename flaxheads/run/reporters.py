"""Where a run's log entries go (``report_to``): ``metrics.jsonl`` (the format the library reads
back: resume, the report page) and TensorBoard event files (``<run>/tensorboard/``), written with
tensorboardX's ``SummaryWriter``. Only process 0 of a multi-process run writes.

One log entry (a line of ``metrics.jsonl``) becomes these TensorBoard scalars (:func:`scalars_of`):
a training line's keys as ``train/<key>`` (``loss``, ``grad_norm``, ``lr_head``, ``lr_backbone``,
``padding``, ``examples_per_s``, ``tokens_per_s``, ``step_seconds``, ``model_tflops_per_s``, ``mfu``,
``epoch``...), an evaluation's as ``<split>/<metric>``, the final metrics as ``final/<split>/<metric>``;
characters TensorBoard refuses in a tag become ``_`` (``ndcg@10`` is ``ndcg_10``).
"""
from __future__ import annotations

import importlib.util
import contextlib
import json
import re
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import UsageError

#: The values ``report_to`` takes (several joined by commas), besides ``none``.
REPORTERS = ("jsonl", "tensorboard")
#: The run folder's subfolder of TensorBoard event files.
EVENTS_DIR = "tensorboard"


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboardX") is not None


def resolve_report_to(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``report_to`` as the reporters to use: None: ``jsonl`` and, where tensorboardX is
    installed, ``tensorboard``; ``none``: nothing; else the names given (checked)."""
    if value is None:
        return ("jsonl", "tensorboard") if tensorboard_available() else ("jsonl",)
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    if names == ["none"]:
        return ()
    bad = [n for n in names if n not in REPORTERS]
    if bad or not names:
        raise UsageError(f"--report-to {','.join(names)!s}: expected one or more of {', '.join(REPORTERS)} joined "
                         "by commas, or none")
    if "tensorboard" in names and not tensorboard_available():
        raise UsageError("--report-to tensorboard needs tensorboardX: pip install 'flaxheads[tensorboard]' "
                         "(or leave tensorboard out of --report-to)")
    return tuple(dict.fromkeys(names))


#: What TensorBoard allows in a tag (its writers replace anything else with ``_``).
_NOT_IN_TAGS = re.compile(r"[^-/\w.]")


def scalars_of(entry: dict) -> list[tuple[str, float]]:
    """The TensorBoard (tag, value) pairs of one ``metrics.jsonl`` entry (see the module docstring)."""
    if "eval" in entry:
        pairs = [(f"{split}/{k}", v) for split, r in entry["eval"].items() for k, v in r.items()]
    elif "final" in entry:
        pairs = [(f"final/{split}/{k}", v) for split, r in entry["final"].items() for k, v in r.items()]
    else:
        pairs = [(f"train/{k}", v) for k, v in entry.items() if k != "step"]
    return [(_NOT_IN_TAGS.sub("_", tag), float(v)) for tag, v in pairs if isinstance(v, (int, float))]


class EventWriter:
    """TensorBoard event files of a run (``<run>/tensorboard``). ``purge_step``: a resumed run's first
    new step; TensorBoard drops the events an interrupted run wrote from there on."""

    def __init__(self, run_dir: str | Path, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(Path(run_dir) / EVENTS_DIR), purge_step=purge_step,
                                    flush_secs=10)

    def write(self, entry: dict) -> None:
        for tag, value in scalars_of(entry):
            self.writer.add_scalar(tag, value, global_step=int(entry["step"]))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Reporters:
    """The run's log sinks: ``metrics.jsonl`` (appended) and the event files, as ``report_to`` says."""

    def __init__(self, run_dir: str | Path | None, report_to: Iterable[str], *, purge_step: int | None = None):
        names = tuple(report_to) if run_dir is not None else ()
        self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a") if "jsonl" in names else None
        self.events = EventWriter(run_dir, purge_step) if "tensorboard" in names else None

    @property
    def active(self) -> bool:
        return self.jsonl is not None or self.events is not None

    def write(self, entry: dict) -> None:
        if self.jsonl is not None:
            try:
                self.jsonl.write(json.dumps(entry) + "\n")
                self.jsonl.flush()
            except OSError as e:  # a full disk or a quota: name the file; close it now, so no second report at exit
                with contextlib.suppress(OSError):
                    self.jsonl.close()
                name, self.jsonl = self.jsonl.name, None
                raise OSError(e.errno, e.strerror, name) from e
        if self.events is not None:
            self.events.write(entry)

    def flush(self) -> None:
        if self.events is not None:
            self.events.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.events is not None:
            self.events.close()
