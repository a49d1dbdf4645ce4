"""Checkpoints of a run: resuming an interrupted run where it stopped (same params, optimizer state,
dropout key and data position), and the callback that saves as it trains. Every run that ends
holds its model: with ``checkpoint_every=0`` the last step (or the step a signal stopped it at) is
still saved, only the saves along the way are left out."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flaxheads.checkpoint import CheckpointError, RunCheckpointer, read_meta
from flaxheads.checkpoint.meta import CHECKPOINTS_SUBDIR
from flaxheads.errors import UsageError
from flaxheads.run.job import Job
from flaxheads.runtime.logs import get_logger
from flaxheads.runtime.sharding import abstract
from flaxheads.training import loop

logger = get_logger("flaxheads.run")

#: The run settings a resumed run compares with the checkpoint's (a change is warned about).
RESUME_SETTINGS = (
    "model",
    "head_config",
    "problem_type",
    "num_labels",
    "labels",
    "bf16",
    "max_length",
    "data",
    "train",
    "optimizer",
    "lora",
)


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


def _restore(resume: str | int, ckr: RunCheckpointer, trainer: loop.Trainer, settings: dict, lead: bool):
    """The state to resume from (None: start at step 0). ``resume``: auto, never or a step."""
    latest = ckr.latest_step()
    if resume == "never":
        if latest is not None:  # every run saves at least its last step: a new one would mix with these
            raise CheckpointError(
                f"--no-resume: {ckr.root} already has checkpoints (latest step {latest}); use a "
                "new --output-dir, or delete that folder to start this run over"
            )
        return None
    if resume == "auto":
        if latest is None:
            return None
        step = latest
    else:
        step = int(resume)
    changed = loop.changed_settings(ckr.read_meta(step).get("run"), settings)
    state = ckr.restore(step, target_state=restore_target(trainer, ckr))
    if changed and lead:  # after the restore: a setting that cannot resume is its one error line, not a warning too
        logger.warning(
            "resuming with other settings than the checkpoint's (the run will not repeat an "
            "uninterrupted one): " + "; ".join(changed[:8])
        )
    if lead:
        logger.info(f"resuming from step {step} ({ckr.root})")
        _trim_log(Path(ckr.run_dir) / "metrics.jsonl", step)
    return state


def check_resume_model(out: Path, model_path: str, resume: str | int) -> None:
    """Before any model loads: a run folder whose checkpoints were trained from another ``--model``
    (a folder that is still there) is not resumed with this one (one line, exit 2)."""
    root = Path(out) / CHECKPOINTS_SUBDIR
    if resume == "never" or not root.is_dir() or not any(p.name.isdigit() for p in root.iterdir()):
        return
    try:
        meta, step, _ = read_meta(root, None if resume == "auto" else int(resume))
    except CheckpointError:
        return  # no finished step, or a damaged one: the restore reports it
    before = (meta.get("run") or {}).get("model")
    if before and os.path.isdir(before) and os.path.realpath(before) != os.path.realpath(model_path):
        raise UsageError(
            f"--output-dir {out} holds a run trained from --model {before} (checkpoint step {step}), "
            f"not {model_path}: resume it with --model {before}, or start this one in a new "
            "--output-dir"
        )


def open_checkpoints(job: Job, trainer: loop.Trainer, config: dict, lead: bool):
    """The checkpoint callback and the state to resume from. ``checkpoint_every=0``: the callback
    saves the last step only (and the step a signal stops the run at), so the run keeps its model."""
    settings = json.loads(json.dumps({k: config.get(k) for k in RESUME_SETTINGS}, default=str))
    name, c = job.best_metric, job.spec.checkpoints
    mode = "min" if name is not None and job.task.lower_is_better(name) else "max"
    ckr = RunCheckpointer(
        job.out,
        job.model,
        keep=c.keep,
        best_metric=name,
        mode=mode,
        save_backbone=not (job.optim.freeze_backbone or job.model.lora is not None),
        extra_meta={"run": settings},
    )
    state0 = _restore(c.resume, ckr, trainer, settings, lead)
    host = trainer.parallel.get_state if trainer.parallel.mode == "pmap" else None
    return loop.FitCheckpointing(ckr, every=c.checkpoint_every, host_state=host), state0
