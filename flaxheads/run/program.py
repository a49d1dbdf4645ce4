"""The one training program: a :class:`~flaxheads.run.spec.RunSpec` -> data, tokenizer, model and
task (:func:`prepare`) -> the library's ``fit`` with the run folder's log and checkpoints
(:func:`train`). Classification and every ranking objective run through it; the cached-features
/ sweep path is :mod:`flaxheads.run.cached`."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from flaxheads._version import __version__
from flaxheads.model.base_dtype import base_dtype_of, resolve_base_dtype
from flaxheads.data.batching import make_buckets
from flaxheads.errors import UsageError
from flaxheads.runtime import ComputePlan
from flaxheads.runtime.precision import Precision
from flaxheads.model.hub import resolve_model_source
from flaxheads.interop.peft import load_peft
from flaxheads.interop.tokenizers import load_tokenizer, model_max_positions
from flaxheads.model.lora import LoraConfig
from flaxheads.model.sequence import SequenceModel
from flaxheads.model.pretrained import from_pretrained
from flaxheads.runtime.parallel import Parallel
from flaxheads.runtime.phases import phase
from flaxheads.runtime.sharding import parse_mesh
from flaxheads.disk.preflight import check_run_folder
from flaxheads.data.groups import collate_groups
from flaxheads.tasks.ranking.task import Ranking
from flaxheads.data.tables import LabelSpace
from flaxheads.training import loop
from flaxheads.data.splits import SPLITS, Split
from flaxheads.training.memory_plan import plan_of
from flaxheads.training.memory import memory_report
from flaxheads.training.optim import OptimConfig, count_params
from flaxheads.data.packing import AUTO_PACK_SHARE, packed_slot_share
from flaxheads.training.preemption import SignalWatch, StopOnSignal
from flaxheads.training.profiling import ProfileWindow, parse_steps
from flaxheads.data.streaming import StreamSplit, ordered_batches
from flaxheads.tasks.task import Classification, Task
from flaxheads.run.checkpoints import check_resume_model, open_checkpoints
from flaxheads.run.checks import check_spec
from flaxheads.run.data import RunData, load_data
from flaxheads.run.folder import RunFolder, scalars
from flaxheads.run.reporters import resolve_report_to
from flaxheads.run.report_data import ReportPage, label_counts, throughput_note, worst_examples
from flaxheads.run.spec import DEFAULT_HEAD_LR, DEFAULT_LR, LORA_LR, PROBE_LR, RunSpec


@dataclasses.dataclass
class Job:
    """What a spec resolves to: data, model, task and the settings the library takes."""

    spec: RunSpec
    model_path: str
    model: SequenceModel
    task: Task
    data: RunData
    splits: dict[str, Any]
    buckets: tuple[int, ...]
    max_length: int
    pad_id: int
    out: Path
    train: loop.TrainConfig
    optim: OptimConfig
    best_metric: str | None
    precision: Precision
    pack_share: float | None = None  # packed token slots over padded ones, where the run packs


@dataclasses.dataclass
class Run:
    """A finished run: its spec, summary (``summary.json``), trained model and folder."""

    spec: RunSpec
    summary: dict
    model: SequenceModel
    folder: Path

    @property
    def metrics(self) -> dict[str, dict]:
        """The final metrics per split (validation and test)."""
        return self.summary["metrics"]


def init_distributed(spec: RunSpec) -> None:
    """Join a multi-process run (``jax.distributed``) when a coordinator address is given."""
    d = spec.devices
    if d.coordinator_address is None:
        return
    # CPU devices need a collectives backend across processes (gloo); GPU/TPU ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if d.coordinator_address == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                                   process_id=d.process_id)


def train_config(spec: RunSpec) -> loop.TrainConfig:
    o, t = spec.optim, spec.task
    return loop.TrainConfig(epochs=o.epochs, batch_size=o.batch_size, eval_batch_size=o.eval_batch_size,
                            max_steps=o.max_steps, eval_every=o.eval_every, log_every=o.log_every, seed=spec.seed,
                            parallel=spec.parallel_mode, mesh=spec.devices.mesh, threshold=t.threshold,
                            pack=bool(spec.data.pack),
                            loss_options={"label_smoothing": t.label_smoothing} if t.label_smoothing else {})


def optim_config(spec: RunSpec, n_train: int, tcfg: loop.TrainConfig) -> OptimConfig:
    """AdamW settings; the schedule counts optimizer steps (micro-steps / accumulation steps)."""
    o, frozen = spec.optim, spec.frozen
    default_lr = LORA_LR if spec.trains_adapters else PROBE_LR if frozen else DEFAULT_LR
    lr = o.lr if o.lr is not None else default_lr
    head_lr = o.head_lr if o.head_lr is not None else (lr if frozen else DEFAULT_HEAD_LR)
    opt_steps = max(loop.total_steps(n_train, tcfg) // o.accumulation_steps, 1)
    return OptimConfig(learning_rate=lr, head_learning_rate=head_lr, weight_decay=o.weight_decay,
                       schedule=o.schedule, warmup_steps=int(o.warmup_ratio * opt_steps), total_steps=opt_steps,
                       max_grad_norm=o.max_grad_norm or None, accumulation_steps=o.accumulation_steps,
                       freeze_backbone=frozen)


def lora_config(spec: RunSpec) -> LoraConfig | None:
    m = spec.model
    if m.lora_rank is None:
        return None
    alpha = m.lora_alpha if m.lora_alpha is not None else 2.0 * m.lora_rank
    return LoraConfig(rank=m.lora_rank, alpha=alpha, dropout=m.lora_dropout, targets=m.lora_targets)


def base_dtype(spec: RunSpec, plan: ComputePlan):
    """The storage dtype of the run's base (``--base-dtype``; auto: bfloat16 when it does not train
    and the compute precision is bfloat16)."""
    return resolve_base_dtype(spec.model.base_dtype, frozen=spec.base_frozen,
                              compute_dtype=plan.precision.dtype)


def build_model(spec: RunSpec, path: str, space: LabelSpace | None, plan: ComputePlan) -> SequenceModel:
    """The model the spec names; ``space`` None: a one-output scorer (ranking)."""
    m = spec.model
    id2label = space.id2label if space is not None and space.names else None
    num_labels, problem_type = (space.num_labels, space.problem_type) if space is not None else (1, "regression")
    if m.lora_from is not None:
        model = load_peft(m.lora_from, backbone=path, id2label=id2label, problem_type=problem_type,
                          dtype=plan.precision.dtype, plan=plan, remat=m.remat)
        if model.num_labels != num_labels:
            raise UsageError(f"--lora-from {m.lora_from}: the adapter's classifier has {model.num_labels} outputs but "
                             f"the data has {num_labels} labels; continue it on data with the same labels")
        model = model.with_base_dtype(base_dtype(spec, plan))
        return model if m.quantize is None else model.with_quantized_base(m.quantize)
    pooler = None if m.pooler == "preset" else m.pooler.split(",") if "," in m.pooler else m.pooler
    model = from_pretrained(path, pooler=pooler, head=None if m.head == "preset" else m.head, id2label=id2label,
                            num_labels=num_labels, problem_type=problem_type, dtype=plan.precision.dtype, plan=plan,
                            seed=spec.seed, ignore_mismatched_sizes=True, base_dtype=base_dtype(spec, plan),
                            remat=m.remat, quantize=m.quantize, mesh=_param_mesh(spec),
                            head_options={"hidden_dims": tuple(m.head_hidden)} if m.head_hidden else None)
    cfg = lora_config(spec)
    return model if cfg is None else model.with_lora(cfg, seed=spec.seed)


def _param_mesh(spec: RunSpec) -> str | None:
    """The run's mesh where it splits params (fsdp or tensor > 1): the backbone is read straight onto it."""
    shape = spec.devices.mesh
    if not shape:
        return None
    sizes = parse_mesh(shape)
    return shape if sizes.get("fsdp", 1) > 1 or sizes.get("tensor", 1) > 1 else None


def usable_max_length(requested: int, tok, model: SequenceModel, path: str) -> int:
    """``max_length``, or the model's positions with a warning when it asks for more."""
    limit = model_max_positions(tok, model.backbone.config)
    if limit is not None and requested > limit:
        print(f"warning: --max-length {requested} is more than the {limit} positions of {path}; "
              f"using --max-length {limit}", file=sys.stderr, flush=True)
        return limit
    return requested


def run_folder_path(spec: RunSpec) -> Path:
    """``output_dir``, or ``runs/<time>-<data name>[-<objective>]``."""
    d = spec.data
    stem = Path(str(d.train_file or d.data)).stem + (f"-{spec.task.objective}" if spec.ranking else "")
    return Path(spec.checkpoints.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{stem}")


def checked_run_folder(spec: RunSpec, model_path: str) -> Path:
    """The run folder, checked before any model loads (a folder, writable, room for ``keep`` checkpoints)."""
    out = run_folder_path(spec)
    c = spec.checkpoints
    check_run_folder(out, model_path, trains_backbone=not spec.base_frozen, keep=c.keep,
                     keep_best=c.keep_best_by != "none", checkpoints=c.checkpoint_every != 0)
    return out


def _require_validation(spec: RunSpec, has_validation: bool) -> None:
    needs = [flag for flag, on in (("--eval-every", spec.optim.eval_every is not None),
                                    ("--sweep K>1 (picks the best head)", spec.optim.sweep > 1),
                                    (f"--keep-best-by {spec.checkpoints.keep_best_by}",
                                     spec.checkpoints.keep_best_by not in ("auto", "none"))) if on]
    if needs and not has_validation:
        how = "--validation-file" if spec.data.train_file else "a validation fraction in --split (e.g. 0.8,0.1,0.1)"
        raise UsageError(f"{needs[0]} needs a validation split, and this run has none: give {how}")


def task_for(spec: RunSpec, data: RunData) -> Task:
    """The task of the spec on its data."""
    t = spec.task
    if spec.ranking:
        options = ({"margin": t.margin} if t.objective in ("pairwise", "hinge") and t.margin is not None else
                   {"scale": t.scale} if t.objective in ("listwise", "listnet") and t.scale is not None else {})
        return Ranking(t.objective, data.group_size, options=options, kind=data.kind)
    return Classification(data.space.problem_type, data.space.num_labels, threshold=t.threshold)


def prepare(spec: RunSpec) -> Job:
    """Data, tokenizer, model and task for a checked spec."""
    path = resolve_model_source(spec.model.model, what="--model")
    out = checked_run_folder(spec, path)
    init_distributed(spec)  # before anything starts JAX's backend (reading a checkpoint's meta does)
    check_resume_model(out, path, spec.checkpoints.resume)
    with phase("reading the data"):
        data = load_data(spec)
    _require_validation(spec, data.has_validation)
    task = task_for(spec, data)
    best = task.best_metric(spec.checkpoints.keep_best_by, has_validation=data.has_validation)
    plan = ComputePlan.for_host(precision=spec.model.precision)  # the one plan of this run
    with phase(f"loading the model {path}"):
        model = build_model(spec, path, data.space, plan)
        tok = load_tokenizer(path)
    max_length = usable_max_length(spec.data.max_length, tok, model, path)
    with phase("tokenising"):
        splits = data.tokenize(tok, max_length)
    buckets = make_buckets(max_length, min(spec.data.bucket_step, max_length))
    tcfg = train_config(spec)
    pack, share = (False, None) if spec.ranking else resolve_pack(spec.data.pack, model, splits["train"], tcfg,
                                                                  buckets, spec.cached)
    tcfg = dataclasses.replace(tcfg, pack=pack)
    return Job(spec, path, model, task, data, splits, buckets, max_length,
               tok.pad_token_id if tok.pad_token_id is not None else 0, out, tcfg,
               optim_config(spec, len(splits["train"]), tcfg), best, plan.precision, share if pack else None)


def resolve_pack(want: bool | None, model: SequenceModel, train: Split, tcfg: loop.TrainConfig,
                 buckets: tuple[int, ...], cached: bool) -> tuple[bool, float | None]:
    """Whether the run packs, and the packed share of the padded token slots
    (``training.packing.packed_slot_share``; None where nothing would pack).

    ``pack`` True / False as given; None: packed when the backbone keeps packed texts apart, the
    backbone is not cached, the training split is in memory and the share is at most ``AUTO_PACK_SHARE``. Packing changes no batch
    and no loss, only the token slots a step computes."""
    if isinstance(train, StreamSplit):  # packed only when asked: the share needs every text tokenized
        return bool(want), None
    packable = not cached and "packing" in getattr(model.backbone, "features", ())
    if want is False or (want is None and not packable):
        return False, None
    share = packed_slot_share(train, tcfg.batch_size, buckets, seed=tcfg.seed)
    return (share <= AUTO_PACK_SHARE if want is None else want), share


def split_counts(splits: dict) -> str:
    """``"36 train / 6 validation / 0 test"``: every split, 0 for one the run does not have."""
    return " / ".join(f"{len(splits[n]) if n in splits else 0} {n}" for n in SPLITS)


def run_config(job: Job, trainer: loop.Trainer | None = None, argv: Sequence[str] | None = None) -> dict:
    """Every resolved setting of the run (its ``config.json``), with the spec that made it;
    ``trainer`` None: heads on cached features, one device."""
    model, spec = job.model, job.spec
    width, mesh = (1, None) if trainer is None else (trainer.parallel.width, trainer.parallel.mesh)
    task = {} if not spec.ranking else {
        "objective": spec.task.objective, "objective_options": job.task.options, "group_size": job.task.group_size,
        "rows": {n: int(s.offsets[-1]) for n, s in job.splits.items()}}
    return {"model": job.model_path, **task, "pooler": spec.model.pooler, "head": spec.model.head,
            "head_config": model.head_config(), "problem_type": model.problem_type,
            "labels": None if job.data.space is None else job.data.space.names, "num_labels": model.num_labels,
            "bf16": job.precision.name == "bfloat16", "precision": dataclasses.asdict(job.precision),
            "compute_plan": model.plan.describe(), "max_length": job.max_length, "buckets": list(job.buckets),
            "data": job.data.config, "sizes": {n: len(s) for n, s in job.splits.items()},
            "label_counts": label_counts(job.data), "headline": job.task.headline,
            "train": dataclasses.asdict(job.train), "optimizer": dataclasses.asdict(job.optim),
            "checkpoints": {"keep": spec.checkpoints.keep, "best_metric": job.best_metric,
                            "every": spec.checkpoints.checkpoint_every},
            "devices": {"parallel": job.train.parallel, "count": jax.device_count(), "width": width,
                        "processes": jax.process_count(), "platform": jax.devices()[0].platform,
                        **({"mesh": dict(mesh.shape)} if mesh is not None else {})},
            "lora": None if model.lora is None else model.lora.to_dict(),
            "params": {k: count_params(v) for k, v in model.params.items()},
            "spec": spec.replace(output_dir=str(job.out)).to_dict(),
            "argv": list(argv) if argv is not None else None, "flaxheads_version": __version__}


def fit_until_signal(trainer: loop.Trainer, train, ckpt, callbacks: list, **fit_kwargs) -> loop.FitResult:
    """:func:`loop.fit` with the run's checkpoints; SIGTERM / SIGINT (Ctrl-C, a notebook's interrupt) end
    it at a step boundary with that step saved (:class:`~flaxheads.training.preemption.Interrupted`)."""
    with SignalWatch(checkpoints=None if ckpt is None else ckpt.ckr.root) as watch:
        res = loop.fit(trainer, train, callbacks=callbacks + ([ckpt] if ckpt is not None else [])
                       + [StopOnSignal(watch, ckpt)], **fit_kwargs)
        if ckpt is not None:
            ckpt.ckr.close()  # wait for the last asynchronous save
    watch.raise_if_signalled(res.step, None if ckpt is None else res.step)
    return res


def _intro(job: Job, trainer: loop.Trainer, total: int) -> str:
    if job.spec.ranking:
        what = (f"{split_counts(job.splits)} groups of up to {job.task.group_size} candidates, objective "
                f"{job.spec.task.objective}, {total} steps of {job.train.batch_size} groups")
    else:
        what = (f"{split_counts(job.splits)} examples, {job.model.num_labels} labels, {total} steps of "
                f"{job.train.batch_size}")
    return (f"{what}, {_training_kind(job)}, {trainer.parallel.width} device(s) ({job.train.parallel}), "
            f"{job.precision.name} ({job.precision.reason})" + _packing_note(job) + _stream_note(job))


def train(spec: RunSpec | None = None, *, callbacks: Sequence[loop.Callback] = (), progress: bool = True,
          argv: Sequence[str] | None = None, started: float | None = None, compile_cache=None,
          **settings: Any) -> Run:
    """Run ``spec`` (or ``RunSpec.from_kwargs(**settings)``; both: the spec with those settings
    changed): the run folder with ``config.json``, ``metrics.jsonl`` and TensorBoard events
    (``report_to``), checkpoints (resumed when the folder has them), the final metrics,
    ``summary.json`` (with the throughput), the plots, ``report.html`` and, with ``profile_steps``, a
    ``jax.profiler`` trace.

    ``callbacks`` are :class:`~flaxheads.training.loop.Callback` objects given to ``fit``. A
    SIGTERM or Ctrl-C saves the step reached and raises
    :class:`~flaxheads.training.preemption.Interrupted`; calling again resumes. ``argv``,
    ``started`` (``time.perf_counter()`` at the program's start) and ``compile_cache`` are what the
    command records of itself."""
    spec = check_spec((spec or RunSpec()).replace(**settings))
    job = prepare(spec)
    if spec.cached:
        from flaxheads.run.cached import run_cached

        return run_cached(job, argv=argv)
    return _fine_tune(job, list(callbacks), progress=progress, argv=argv, started=started, compile_cache=compile_cache)


def _fine_tune(job: Job, callbacks: list, *, progress: bool, argv, started, compile_cache) -> Run:
    trainer = loop.Trainer.build(job.model, job.optim, job.train,
                                 Parallel.from_config(job.train.parallel, job.train.mesh), task=job.task)
    if job.spec.ranking and job.train.batch_size % trainer.parallel.width:
        raise UsageError(f"--batch-size {job.train.batch_size} (groups) must be a multiple of the "
                         f"{trainer.parallel.width} data-parallel devices, so that every group stays on one device")
    config = run_config(job, trainer, argv)
    lead = jax.process_index() == 0
    ckpt, state0 = open_checkpoints(job, trainer, config, lead)
    resumed = None if state0 is None else int(state0.step)  # fit consumes state0's arrays
    folder = RunFolder(job.out, lead)
    total = loop.total_steps(len(job.splits["train"]), job.train)
    folder.start(config, _intro(job, trainer, total))
    if lead:
        print(job.model.plan.describe(), flush=True)
    memory = None
    if trainer.parallel.mode != "pmap":  # every process compiles the same program; the first one reports
        # XLA's analysis costs a compile: on a CPU host with one device the plan is the state alone
        compile = bool(job.train.mesh) or jax.default_backend() != "cpu"
        batch = _largest_batch(job)
        with phase("compiling"):
            memory = plan_of(trainer, memory_report(trainer, batch, compile=compile),
                             *np.shape(batch["input_ids"])).lines()
        if lead:
            print("\n".join(memory), flush=True)
    log = folder.logger(job.optim, total, job.train.log_every, job.task.headline,
                        report_to=resolve_report_to(job.spec.checkpoints.report_to),
                        resumed_at=resumed)
    evals = {"validation": job.splits["validation"]} if "validation" in job.splits else {}
    window = job.spec.checkpoints.profile_steps
    profile = ProfileWindow(job.out / "profile", *parse_steps(window)) if window and lead else None
    extra = ([ReportPage(job.out)] if lead else []) + ([profile] if profile is not None else [])
    fit_called = time.perf_counter()
    res = fit_until_signal(trainer, job.splits["train"], ckpt, [log, *callbacks, *extra], evals=evals,
                           buckets=job.buckets, pad_id=job.pad_id, progress=lead and progress, state=state0,
                           consume_model=True)  # the run's model is rebuilt from the state below
    final, predictions = {}, {}
    if "test" in job.splits:
        with phase("evaluating the test split"):
            final["test"], predictions["test"] = trainer.final(res.state.params, job.splits["test"], buckets=job.buckets,
                                                           pad_id=job.pad_id)
    last = next((e["eval"] for e in reversed(res.history) if "eval" in e), {})
    final = {**last, **final}
    summary = {**({"objective": job.spec.task.objective} if job.spec.ranking else {}), "steps": res.step,
               "resumed_from": resumed,
               "checkpoints": None if ckpt is None else ckpt.ckr.root, "seconds": round(res.seconds, 1),
               "eval_seconds": round(res.eval_seconds, 1), **_startup(started, res, fit_called),
               "train_compiles": res.train_compiles, "eval_compiles": res.eval_compiles, "throughput": res.throughput,
               **({"profile": {"steps": list(parse_steps(window)), "folder": str(job.out / "profile"),
                               "files": [str(p) for p in profile.traces()]}} if profile is not None else {}),
               "buckets": list(job.buckets), **({"memory_plan": memory} if memory else {}),
               "metrics": {n: scalars(r) for n, r in final.items()},
               "run_folder": str(job.out)}
    if compile_cache is not None:
        summary["compile_cache"] = {"folder": str(compile_cache.folder), "loaded": compile_cache.hits,
                                    "compiled": compile_cache.compiled, "stored": compile_cache.stored}
    worst = worst_examples(job, *_worst_source(job, res, predictions))
    folder.finish(summary, final, predictions, job.model.id2label, history=res.history, metric=job.task.headline,
                  worst=worst, tail=f"{res.step} steps in {res.seconds:.0f} s"
                       + (f" (first step done {summary['seconds_to_first_step']:.0f} s after the start)"
                          if "seconds_to_first_step" in summary else "") + throughput_note(res.throughput)
                       + f"; compiles: {res.train_compiles} train, "
                       f"{res.eval_compiles} eval (buckets {list(job.buckets)})"
                       + (f"; {compile_cache.summary()}" if compile_cache is not None else ""))
    state = trainer.parallel.get_state(res.state) if trainer.parallel.mode == "pmap" else res.state
    return Run(job.spec, summary, dataclasses.replace(job.model, params=state.params), job.out)


def _worst_source(job: Job, res: loop.FitResult, predictions: dict) -> tuple[str, dict | None]:
    """The split whose worst-classified rows the report shows, and its predictions: validation (the
    trained model's, from fit's evaluation at the last step) where it is in memory, else the test split's."""
    val = job.splits.get("validation")
    if job.spec.ranking or not isinstance(val, Split) or getattr(job.data.tables.get("validation"), "texts", None) \
            is None:
        return "test", predictions.get("test")
    return "validation", res.final_arrays.get("validation")


def _startup(started: float | None, res: loop.FitResult, fit_called: float) -> dict:
    """How long the first step took (its compile included) and, for a program that says when it
    started, how long from that start (data, tokenizer, model, compile) to that step's end."""
    if res.first_step_seconds is None:
        return {}
    out = {"first_step_seconds": round(res.first_step_seconds, 1)}
    if started is not None:
        out["seconds_to_first_step"] = round(fit_called - started + res.first_step_seconds, 1)
    return out


def _largest_batch(job: Job) -> dict:
    """A training batch padded to the longest bucket (the most activation memory a step takes)."""
    train, bs = job.splits["train"], job.train.batch_size
    if job.spec.ranking:
        groups = np.arange(min(bs, len(train)))
        return collate_groups(train, groups, bs, job.task.group_size, job.buckets[-1:], job.pad_id)
    return next(iter(ordered_batches(train, bs, job.buckets[-1:], pad_id=job.pad_id)))


def _stream_note(job: Job) -> str:
    if not isinstance(job.splits["train"], StreamSplit):
        return ""
    sample = job.splits.get("validation")
    return (", read from disk as it trains (streamed)"
            + (f", evaluating on a sample of {len(sample)} validation examples" if isinstance(sample, Split)
               and job.spec.data.eval_limit else ""))


def _packing_note(job: Job) -> str:
    if not job.train.pack:
        return ""
    share = "" if job.pack_share is None else f"{job.pack_share:.0%} of the padded token slots; "
    return f", short texts packed ({share}--no-pack to turn off)"


def _training_kind(job: Job) -> str:
    stored = base_dtype_of(job.model.params["backbone"])
    in_16 = f", stored in {stored}" if stored not in (None, "float32") else ""  # --base-dtype
    if job.model.lora is not None:
        return f"LoRA rank {job.model.lora.rank} on {', '.join(job.model.lora.targets)} (base frozen{in_16})"
    return f"backbone frozen{in_16}" if job.optim.freeze_backbone else "full fine-tune"
