"""A run that trains through :func:`~flaxheads.training.loop.fit`: the trainer of the job, its log,
checkpoints (resumed where the folder has them), the memory plan and profile window, the test
split's metrics at the end and the run folder's files. Heads on cached features are
:mod:`flaxheads.run.cached`. What it tells goes to the ``flaxheads.run`` logger
(:mod:`flaxheads.runtime.logs`)."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax
import numpy as np

from flaxheads.data.splits import Split
from flaxheads.data.streaming import StreamSplit
from flaxheads.model.base_dtype import base_dtype_of
from flaxheads.run.checkpoints import open_checkpoints
from flaxheads.run.folder import RunFolder, scalars
from flaxheads.run.job import Job, Run, run_config, split_counts
from flaxheads.run.report_data import ReportPage, throughput_note, worst_of
from flaxheads.runtime.logs import get_logger, use_default_handler
from flaxheads.runtime.parallel import Parallel
from flaxheads.runtime.phases import phase
from flaxheads.runtime.sharding import parse_mesh
from flaxheads.training import loop
from flaxheads.training.memory import memory_report
from flaxheads.training.memory_plan import plan_of
from flaxheads.training.preemption import SignalWatch, StopOnSignal
from flaxheads.training.profiling import ProfileWindow, parse_steps

logger = get_logger("flaxheads.run")


def fit_until_signal(trainer: loop.Trainer, train, ckpt, callbacks: list, **fit_kwargs) -> loop.FitResult:
    """:func:`loop.fit` with the run's checkpoints; SIGTERM / SIGINT (Ctrl-C, a notebook's interrupt) end
    it at a step boundary with that step saved (:class:`~flaxheads.training.preemption.Interrupted`)."""
    with SignalWatch(checkpoints=None if ckpt is None else ckpt.ckr.root) as watch:
        res = loop.fit(
            trainer,
            train,
            callbacks=callbacks + ([ckpt] if ckpt is not None else []) + [StopOnSignal(watch, ckpt)],
            **fit_kwargs,
        )
        if ckpt is not None:
            ckpt.ckr.close()  # wait for the last asynchronous save
    watch.raise_if_signalled(res.step, None if ckpt is None else res.step)
    return res


def fine_tune(job: Job, callbacks: list, *, progress: bool, argv, started, compile_cache) -> Run:
    """Train ``job`` with ``fit`` (``callbacks`` given to it too) and write its run folder."""
    use_default_handler()
    trainer = loop.Trainer.build(
        job.model, job.optim, job.train, Parallel.from_config(job.train.parallel, job.train.mesh), task=job.task
    )
    job.task.check_devices(job.train.batch_size, trainer.parallel.width)
    config = run_config(job, trainer, argv)
    lead = jax.process_index() == 0
    ckpt, state0 = open_checkpoints(job, trainer, config, lead)
    resumed = None if state0 is None else int(state0.step)  # fit consumes state0's arrays
    folder = RunFolder(job.out, lead)
    folder.start(config, _intro(job, trainer))
    if lead:
        logger.info(f"{job.model.plan.describe()}; precision {job.precision.reason}")
    memory = _memory_plan(job, trainer, lead)
    log = folder.logger(
        job.optim, job.steps, job.train.log_every, job.task.headline, report_to=job.report_to, resumed_at=resumed
    )
    evals = {"validation": job.splits["validation"]} if "validation" in job.splits else {}
    window = job.spec.checkpoints.profile_steps
    profile = ProfileWindow(job.out / "profile", *parse_steps(window)) if window and lead else None
    extra = ([ReportPage(job.out)] if lead else []) + ([profile] if profile is not None else [])
    fit_called = time.perf_counter()
    res = fit_until_signal(
        trainer,
        job.splits["train"],
        ckpt,
        [log, *callbacks, *extra],
        evals=evals,
        buckets=job.buckets,
        pad_id=job.pad_id,
        progress=lead and progress,
        state=state0,
        consume_model=True,
    )  # the run's model is rebuilt from the state below
    final, predictions = {}, {}
    if "test" in job.splits:
        with phase("evaluating the test split"):
            final["test"], predictions["test"] = trainer.final(
                res.state.params, job.splits["test"], buckets=job.buckets, pad_id=job.pad_id
            )
    last: dict = next((e["eval"] for e in reversed(res.history) if "eval" in e), {})
    final = {**last, **final}
    summary = {
        **job.task.summary_keys(),
        "steps": res.step,
        "resumed_from": resumed,
        "checkpoints": None if ckpt is None else ckpt.ckr.root,
        "seconds": round(res.seconds, 1),
        "eval_seconds": round(res.eval_seconds, 1),
        **_startup(started, res, fit_called),
        "train_compiles": res.train_compiles,
        "eval_compiles": res.eval_compiles,
        "throughput": res.throughput,
        **(
            {
                "profile": {
                    "steps": [profile.first, profile.last],
                    "folder": str(job.out / "profile"),
                    "files": [str(p) for p in profile.traces()],
                }
            }
            if profile is not None
            else {}
        ),
        "buckets": list(job.buckets),
        **({"memory_plan": memory} if memory else {}),
        "metrics": {n: scalars(r) for n, r in final.items()},
        "run_folder": str(job.out),
    }
    if compile_cache is not None:
        summary["compile_cache"] = {
            "folder": str(compile_cache.folder),
            "loaded": compile_cache.hits,
            "compiled": compile_cache.compiled,
            "stored": compile_cache.stored,
        }
    # the validation rows' predictions are those of fit's evaluation at the last step
    worst = worst_of(job, {"validation": res.final_arrays.get("validation"), "test": predictions.get("test")})
    folder.finish(
        summary,
        final,
        predictions,
        job.model.id2label,
        history=res.history,
        metric=job.task.headline,
        worst=worst,
        tail=f"{res.step} steps in {res.seconds:.0f} s"
        + (
            f" (first step done {summary['seconds_to_first_step']:.0f} s after the start)"
            if "seconds_to_first_step" in summary
            else ""
        )
        + throughput_note(res.throughput)
        + f"; compiles: {res.train_compiles} train, "
        f"{res.eval_compiles} eval (buckets {list(job.buckets)})"
        + (f"; {compile_cache.summary()}" if compile_cache is not None else ""),
    )
    state = trainer.parallel.get_state(res.state) if trainer.parallel.mode == "pmap" else res.state
    return Run(job.spec, summary, dataclasses.replace(job.model, params=state.params), job.out)


def _memory_plan(job: Job, trainer: loop.Trainer, lead: bool) -> list[str] | None:
    """The lines of the step's memory plan where it informs (an accelerator, a mesh that splits
    the params: told at INFO) or is asked for (DEBUG, e.g. ``flaxheads train -v``); else, and under
    pmap, None: on a CPU host the plan of one device is the state alone, nothing to decide on."""
    if trainer.parallel.mode == "pmap":
        return None
    sizes = parse_mesh(job.train.mesh) if job.train.mesh else {}
    informs = jax.default_backend() != "cpu" or sizes.get("fsdp", 1) > 1 or sizes.get("tensor", 1) > 1
    level = logging.INFO if informs else logging.DEBUG
    if not logger.isEnabledFor(level) and not informs:
        return None
    # every process compiles the same program; the first one reports. XLA's analysis costs a
    # compile: on a CPU host with one device the plan is the state alone
    compile = bool(job.train.mesh) or jax.default_backend() != "cpu"
    batch = job.task.largest_batch(job.splits["train"], job.train.batch_size, job.buckets[-1], job.pad_id)
    with phase("compiling"):
        report = memory_report(trainer, batch, compile=compile)
        memory = plan_of(trainer, report, *np.shape(batch["input_ids"]), compiled=compile).lines()
    if lead:
        logger.log(level, "\n".join(memory))
    return memory


def _startup(started: float | None, res: loop.FitResult, fit_called: float) -> dict:
    """How long the first step took (its compile included) and, for a program that says when it
    started, how long from that start (data, tokenizer, model, compile) to that step's end."""
    if res.first_step_seconds is None:
        return {}
    out = {"first_step_seconds": round(res.first_step_seconds, 1)}
    if started is not None:
        out["seconds_to_first_step"] = round(fit_called - started + res.first_step_seconds, 1)
    return out


def _intro(job: Job, trainer: loop.Trainer) -> str:
    """The run's one start line: the model, the data (rows per split), what trains, the devices."""
    what = job.task.describe(split_counts(job.splits), job.steps, job.train.batch_size)
    width, kind = trainer.parallel.width, jax.devices()[0].platform
    devices = f"{width} {kind} device{'s' if width > 1 else ''}" + (
        f" ({job.train.parallel})" if job.train.parallel != "single" else ""
    )
    return (
        f"{job.spec.model.model}: {what}, {_training_kind(job)}, {devices}, {job.precision.name}"
        + _packing_note(job)
        + _stream_note(job)
    )


def _stream_note(job: Job) -> str:
    if not isinstance(job.splits["train"], StreamSplit):
        return ""
    sample = job.splits.get("validation")
    return ", read from disk as it trains (streamed)" + (
        f", evaluating on a sample of {len(sample)} validation examples"
        if isinstance(sample, Split) and job.spec.data.eval_limit
        else ""
    )


def _packing_note(job: Job) -> str:
    if not job.train.pack:
        return ""
    share = "" if job.pack_share is None else f"{job.pack_share:.0%} of the padded token slots; "
    return f", short texts packed ({share}--no-pack to turn off)"


def _training_kind(job: Job) -> str:
    stored = base_dtype_of(job.model.params["backbone"])
    in_16 = f", stored in {stored}" if stored not in (None, "float32") else ""  # --base-dtype
    lora = job.model.lora
    if lora is not None:
        assert lora.targets is not None, "the model's adapters were added with their targets resolved"
        return f"LoRA rank {lora.rank} on {', '.join(lora.targets)} (base frozen{in_16})"
    return f"backbone frozen{in_16}" if job.optim.freeze_backbone else "full fine-tune"
