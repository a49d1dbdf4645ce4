"""Checkpoints of a ``flaxheads train`` run: which metric keeps the best step, and resuming an
interrupted run where it stopped (same params, optimizer state, dropout key and data position)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..checkpoint import CheckpointError, RunCheckpointer
from ..errors import UsageError
from ..losses import MULTI_LABEL, SINGLE_LABEL
from ..sharding import abstract
from ..tables import LabelSpace
from ..training import loop
from ..training.metrics import compute_metrics, headline

if TYPE_CHECKING:  # annotation only: fit_program imports this module
    from .fit_program import Job

#: Metrics where lower is better (every other metric: higher is better).
LOWER_IS_BETTER = ("mse",)
#: The run settings a resumed run compares with the checkpoint's (a change is warned about).
RESUME_SETTINGS = ("model", "head_config", "problem_type", "num_labels", "labels", "bf16", "max_length", "data",
                   "train", "optimizer", "lora")


def validation_metrics(problem_type: str, num_labels: int) -> list[str]:
    """The scalar metrics a validation of this task reports (their names as the library computes them)."""
    n, k = 2, max(num_labels, 1)
    labels = (np.arange(n) % k if problem_type == SINGLE_LABEL else np.zeros((n, k)) if problem_type == MULTI_LABEL
              else np.zeros((n, k) if k > 1 else n))
    m = compute_metrics(problem_type, np.zeros((n, k)), labels, k)
    return sorted(name for name, v in m.items() if isinstance(v, float) and name != "threshold")


def best_metric(flag: str, space: LabelSpace, *, has_validation: bool) -> str | None:
    """``--keep-best-by``: ``auto`` (the validation headline metric, if there is a validation
    split), ``none``, or ``validation/<metric>``, checked against the metrics this task has."""
    if flag == "none" or (flag == "auto" and not has_validation):
        return None
    if flag == "auto":
        return f"validation/{headline(space.problem_type)}"
    valid = validation_metrics(space.problem_type, space.num_labels)
    split, _, name = flag.partition("/")
    if split != "validation" or name not in valid:
        raise UsageError(f"--keep-best-by {flag!r}: a {space.problem_type} run evaluates validation/<metric> with "
                         f"metric one of {', '.join(valid)} (or use `auto` / `none`)")
    return flag


def _trim_log(path: Path, step: int) -> None:
    """Drop the log lines an interrupted run wrote after the step it resumes from."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the interruption
        if e.get("step", 0) <= step and "final" not in e:
            keep.append(line)
    path.write_text("".join(x + "\n" for x in keep))


def restore_target(trainer: loop.Trainer, ckr: RunCheckpointer):
    """What a checkpoint is restored into: on a mesh, the shapes with this run's shardings, so each
    process reads only its shards, whatever mesh wrote them; else (and when the backbone is not
    saved, so it comes from the target) a fresh state."""
    par = trainer.parallel
    if par.mode != "mesh" or not ckr.save_backbone:
        return trainer.init_state()
    state = trainer.abstract_state()
    # the step as a plain int: fit reads it on every process, and a global array is not readable there
    return abstract(state, par.shardings(state)).replace(step=0)


def _restore(args: argparse.Namespace, ckr: RunCheckpointer, trainer: loop.Trainer, settings: dict, lead: bool):
    """The state to resume from (None: start at step 0)."""
    latest = ckr.latest_step()
    if args.no_resume:
        if latest is not None and args.checkpoint_every != 0:
            raise CheckpointError(f"--no-resume: {ckr.root} already has checkpoints (latest step {latest}); use a "
                                  "new --output-dir, or delete that folder to start this run over")
        return None
    if args.resume_step is None and latest is None:
        return None
    step = args.resume_step if args.resume_step is not None else latest
    changed = loop.changed_settings(ckr.read_meta(step).get("run"), settings)
    if changed and lead:
        print("warning: resuming with other settings than the checkpoint's (the run will not repeat an "
              "uninterrupted one): " + "; ".join(changed[:8]), file=sys.stderr)
    state = ckr.restore(step, target_state=restore_target(trainer, ckr))
    if lead:
        print(f"resuming from step {step} ({ckr.root})", flush=True)
        _trim_log(Path(ckr.run_dir) / "metrics.jsonl", step)
    return state


def open_checkpoints(args: argparse.Namespace, job: Job, trainer: loop.Trainer, config: dict, lead: bool):
    """The checkpoint callback (None with ``--checkpoint-every 0``) and the state to resume from."""
    settings = json.loads(json.dumps({k: config.get(k) for k in RESUME_SETTINGS}, default=str))
    had_folder = (job.out / "checkpoints").exists()
    name = job.best_metric
    mode = "min" if name is not None and name.rpartition("/")[2] in LOWER_IS_BETTER else "max"
    ckr = RunCheckpointer(job.out, job.model, keep=args.keep, best_metric=name, mode=mode,
                          save_backbone=not (job.optim.freeze_backbone or job.model.lora is not None),
                          extra_meta={"run": settings})
    state0 = _restore(args, ckr, trainer, settings, lead)
    if args.checkpoint_every == 0:
        ckr.close()
        root = Path(ckr.root)
        if lead and not had_folder and root.is_dir() and not any(root.iterdir()):
            root.rmdir()  # opened only to look for a run to resume; leave no empty folder behind
        return None, state0
    host = trainer.parallel.get_state if trainer.parallel.mode == "pmap" else None
    return loop.FitCheckpointing(ckr, every=args.checkpoint_every, host_state=host), state0
