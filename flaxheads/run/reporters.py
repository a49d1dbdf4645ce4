"""Where a run's log entries go (``report_to``): ``metrics.jsonl`` (the format the library reads
back: resume, the report page) and TensorBoard event files (``<run>/tensorboard/``, written by
:mod:`flaxheads.run.tfevents`: no TensorFlow, protobuf or torch). Only process 0 of a multi-process
run writes.

One log entry (a line of ``metrics.jsonl``) becomes these TensorBoard scalars (:func:`scalars_of`):
a training line's keys as ``train/<key>`` (``loss``, ``grad_norm``, ``lr_head``, ``lr_backbone``,
``padding``, ``examples_per_s``, ``tokens_per_s``, ``step_seconds``, ``model_tflops_per_s``, ``mfu``,
``epoch``...), an evaluation's as ``<split>/<metric>``, the final metrics as ``final/<split>/<metric>``;
characters TensorBoard refuses in a tag become ``_`` (``ndcg@10`` is ``ndcg_10``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from flaxheads.errors import UsageError
from flaxheads.run.tfevents import EventFile
from flaxheads.runtime.logs import get_logger

#: The values ``report_to`` takes (several joined by commas), besides ``none``.
REPORTERS = ("jsonl", "tensorboard")
logger = get_logger("flaxheads.run")
#: The run folder's subfolder of TensorBoard event files.
EVENTS_DIR = "tensorboard"


def resolve_report_to(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``report_to`` as the reporters to use: None: both; ``none``: nothing; else the names given
    (checked)."""
    if value is None:
        return REPORTERS
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    if names == ["none"]:
        return ()
    bad = [n for n in names if n not in REPORTERS]
    if bad or not names:
        raise UsageError(
            f"--report-to {','.join(names)!s}: expected one or more of {', '.join(REPORTERS)} joined by commas, or none"
        )
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
    new step; TensorBoard drops the events an interrupted run wrote from there on. The events are a
    view of ``metrics.jsonl``: a disk that refuses them is said once and the run goes on."""

    def __init__(self, run_dir: str | Path, purge_step: int | None = None):
        self.folder = Path(run_dir) / EVENTS_DIR
        self.file: EventFile | None = None
        try:
            self.file = EventFile(self.folder, purge_step)
        except OSError as e:
            self._refused(e)

    def _refused(self, e: OSError) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        logger.warning(
            f"could not write TensorBoard events in {self.folder}: {e.strerror or e}; training goes "
            "on (metrics.jsonl keeps every entry)"
        )

    def write(self, entry: dict) -> None:
        if self.file is not None:
            try:
                self.file.add_scalars(int(entry["step"]), scalars_of(entry))
            except OSError as e:
                self._refused(e)

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError as e:
                self._refused(e)
            self.file = None


class Reporters:
    """The run's log sinks: ``metrics.jsonl`` (``append``: after what is there; else an earlier
    run's log is removed) and the event files, as ``report_to`` says."""

    def __init__(
        self,
        run_dir: str | Path | None,
        report_to: Iterable[str],
        *,
        purge_step: int | None = None,
        append: bool = True,
    ):
        folder = Path(run_dir) if run_dir is not None else None
        names = tuple(report_to) if folder is not None else ()
        if folder is not None and not append:
            (folder / "metrics.jsonl").unlink(missing_ok=True)
        self.jsonl = open(folder / "metrics.jsonl", "a") if folder is not None and "jsonl" in names else None
        self.events = EventWriter(folder, purge_step) if folder is not None and "tensorboard" in names else None

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

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.events is not None:
            self.events.close()
