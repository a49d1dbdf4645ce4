"""The one training program: a checked :class:`~flaxheads.run.spec.RunSpec` is resolved once into a
:class:`~flaxheads.run.job.Job` (:func:`prepare`: the run folder checked, data, task, model,
tokenizer, the library's settings), which :func:`train` runs through ``fit``
(:mod:`flaxheads.run.finetune`) or as heads on cached features (:mod:`flaxheads.run.cached`).
Every objective runs through it: what differs between them is the job's
:class:`~flaxheads.tasks.task.Task`'s to say."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from flaxheads.data.batching import make_buckets
from flaxheads.data.chat import pair_tokenizer
from flaxheads.data.packing import AUTO_PACK_SHARE, packed_slot_share
from flaxheads.data.splits import Split
from flaxheads.data.streaming import StreamSplit
from flaxheads.data.tables import LabelSpace
from flaxheads.disk.preflight import check_run_folder
from flaxheads.errors import UsageError
from flaxheads.heads.token_logits import reranker_head
from flaxheads.interop.peft import load_peft
from flaxheads.interop.tokenizers import load_tokenizer, model_max_positions
from flaxheads.model.base_dtype import resolve_base_dtype
from flaxheads.model.hub import resolve_model_source
from flaxheads.model.lora import LoraConfig
from flaxheads.model.pretrained import from_pretrained
from flaxheads.model.sequence import SequenceModel
from flaxheads.run.cached import head_steps, run_cached
from flaxheads.run.checkpoints import check_resume_model
from flaxheads.run.checks import check_spec
from flaxheads.run.data import check_same_data, load_data
from flaxheads.run.finetune import fine_tune
from flaxheads.run.job import Job, Run
from flaxheads.run.reporters import resolve_report_to
from flaxheads.run.spec import RunSpec
from flaxheads.runtime import ComputePlan
from flaxheads.runtime.logs import verbosity as verbosity_of
from flaxheads.runtime.phases import phase
from flaxheads.runtime.sharding import parse_mesh
from flaxheads.training import loop
from flaxheads.training.optim import OptimConfig


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
        jax.distributed.initialize(
            coordinator_address=d.coordinator_address, num_processes=d.num_processes, process_id=d.process_id
        )


def train_config(spec: RunSpec) -> loop.TrainConfig:
    o, t = spec.optim, spec.task
    return loop.TrainConfig(
        epochs=o.epochs,
        batch_size=o.batch_size,
        eval_batch_size=o.eval_batch_size,
        max_steps=o.max_steps,
        eval_every=o.eval_every,
        log_every=o.log_every,
        seed=spec.seed,
        parallel=spec.parallel_mode,
        mesh=spec.devices.mesh,
        threshold=t.threshold,
        pack=bool(spec.data.pack),
        loss_options={"label_smoothing": t.label_smoothing} if t.label_smoothing else {},
    )


def optim_config(spec: RunSpec, steps: int) -> OptimConfig:
    """AdamW settings for a run of ``steps`` micro-steps; the schedule counts optimizer steps
    (micro-steps / accumulation steps)."""
    o = spec.optim
    lr, head_lr = spec.learning_rates
    opt_steps = max(steps // o.accumulation_steps, 1)
    return OptimConfig(
        learning_rate=lr,
        head_learning_rate=head_lr,
        weight_decay=o.weight_decay,
        schedule=o.schedule,
        warmup_steps=int(o.warmup_ratio * opt_steps),
        total_steps=opt_steps,
        max_grad_norm=o.max_grad_norm or None,
        accumulation_steps=o.accumulation_steps,
        freeze_backbone=spec.frozen,
    )


def lora_config(spec: RunSpec) -> LoraConfig | None:
    m = spec.model
    if m.lora_rank is None:
        return None
    alpha = m.lora_alpha if m.lora_alpha is not None else 2.0 * m.lora_rank
    return LoraConfig(rank=m.lora_rank, alpha=alpha, dropout=m.lora_dropout, targets=m.lora_targets)


def base_dtype(spec: RunSpec, plan: ComputePlan):
    """The storage dtype of the run's base (``--base-dtype``; auto: bfloat16 when it does not train
    and the compute precision is bfloat16)."""
    return resolve_base_dtype(spec.model.base_dtype, frozen=spec.base_frozen, compute_dtype=plan.precision.dtype)


def build_model(spec: RunSpec, path: str, space: LabelSpace | None, plan: ComputePlan) -> SequenceModel:
    """The model the spec names; ``space`` None: a one-output scorer (ranking)."""
    m = spec.model
    id2label = space.id2label if space is not None and space.names else None
    num_labels, problem_type = (space.num_labels, space.problem_type) if space is not None else (1, "regression")
    if m.lora_from is not None:
        model = load_peft(
            m.lora_from,
            backbone=path,
            id2label=id2label,
            problem_type=problem_type,
            dtype=plan.precision.dtype,
            plan=plan,
            remat=m.remat,
        )
        if model.num_labels != num_labels:
            raise UsageError(
                f"--lora-from {m.lora_from}: the adapter's classifier has {model.num_labels} outputs but "
                f"the data has {num_labels} labels; continue it on data with the same labels"
            )
        model = model.with_base_dtype(base_dtype(spec, plan))
        return model if m.quantize is None else model.with_quantized_base(m.quantize)
    # a token-logit reranker reads the LM head at the preset's pooled token, the last one
    preset = m.pooler == "preset" or m.head == "token-logits"
    pooler = None if preset else m.pooler.split(",") if "," in m.pooler else m.pooler
    head = reranker_head() if m.head == "token-logits" else None if m.head == "preset" else m.head
    model = from_pretrained(
        path,
        pooler=pooler,
        head=head,
        id2label=id2label,
        num_labels=num_labels,
        problem_type=problem_type,
        dtype=plan.precision.dtype,
        plan=plan,
        seed=spec.seed,
        ignore_mismatched_sizes=True,
        base_dtype=base_dtype(spec, plan),
        remat=m.remat,
        quantize=m.quantize,
        mesh=_param_mesh(spec),
        head_options={"hidden_dims": tuple(m.head_hidden)} if m.head_hidden else None,
    )
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
        logging.getLogger("flaxheads.run").warning(
            f"--max-length {requested} is more than the {limit} positions of {path}; using --max-length {limit}"
        )
        return limit
    return requested


def checked_run_folder(spec: RunSpec, model_path: str) -> Path:
    """The run folder, checked before any model loads (a folder, writable, room for ``keep`` checkpoints)."""
    out = spec.run_folder()
    c = spec.checkpoints
    check_run_folder(
        out,
        model_path,
        trains_backbone=not spec.base_frozen,
        # checkpoint_every=0 still saves the last step: room for that one
        keep=c.keep if c.checkpoint_every != 0 else 1,
        keep_best=c.keep_best_by != "none" and c.checkpoint_every != 0,
        checkpoints=True,
    )
    return out


def _require_validation(spec: RunSpec, has_validation: bool) -> None:
    needs = [
        flag
        for flag, on in (
            ("--eval-every", spec.optim.eval_every is not None),
            ("--sweep K>1 (picks the best head)", spec.optim.sweep > 1),
            (f"--keep-best-by {spec.checkpoints.keep_best_by}", spec.checkpoints.keep_best_by not in ("auto", "none")),
        )
        if on
    ]
    if needs and not has_validation:
        how = (
            "--validation-file (validation=)"
            if spec.data.train_file
            else "a validation fraction in --split (e.g. 0.8,0.1,0.1)"
        )
        raise UsageError(f"{needs[0]} needs a validation split, and this run has none: give {how}")


def prepare(spec: RunSpec) -> Job:
    """The job of a checked spec: its folder checked, then data, task, model, tokenizer and settings."""
    report_to = resolve_report_to(spec.checkpoints.report_to)
    path = resolve_model_source(spec.model.model, what="--model")
    out = checked_run_folder(spec, path)
    init_distributed(spec)  # before anything starts JAX's backend (reading a checkpoint's meta does)
    check_resume_model(out, path, spec.checkpoints.resume)
    check_same_data(out, spec)
    with phase("reading the data"):
        data = load_data(spec)
    _require_validation(spec, data.has_validation)
    task = data.task(spec.task)
    best = task.best_metric(spec.checkpoints.keep_best_by, has_validation=data.has_validation)
    assert spec.model.precision is not None, "a checked spec has its precision settled"
    plan = ComputePlan.for_host(precision=spec.model.precision)  # the one plan of this run
    with phase(f"loading the model {path}"):
        model = build_model(spec, path, data.space, plan)
        tok = load_tokenizer(path)
    max_length = usable_max_length(spec.data.max_length, tok, model, path)
    with phase("tokenising"):
        splits = data.tokenize(pair_tokenizer(tok, model), max_length)  # a reranker's pairs in its prompt
    buckets = make_buckets(max_length, min(spec.data.bucket_step, max_length))
    tcfg = train_config(spec)
    pack, share = (
        resolve_pack(spec.data.pack, model, splits["train"], tcfg, buckets, spec.cached)
        if task.packs
        else (False, None)
    )
    tcfg = dataclasses.replace(tcfg, pack=pack)
    steps = (
        head_steps(spec, model, splits["train"], buckets)
        if spec.cached
        else loop.total_steps(len(splits["train"]), tcfg)
    )
    return Job(
        spec,
        path,
        model,
        task,
        data,
        splits,
        buckets,
        max_length,
        tok.pad_token_id if tok.pad_token_id is not None else 0,
        out,
        tcfg,
        optim_config(spec, steps),
        steps,
        best,
        plan.precision,
        report_to,
        share if pack else None,
    )


def resolve_pack(
    want: bool | None,
    model: SequenceModel,
    train: Split,
    tcfg: loop.TrainConfig,
    buckets: tuple[int, ...],
    cached: bool,
) -> tuple[bool, float | None]:
    """Whether the run packs, and the packed share of the padded token slots
    (``training.packing.packed_slot_share``; None where nothing would pack).

    ``pack`` True / False as given; None: packed when the backbone keeps packed texts apart, the
    backbone is not cached, the training split is in memory and the share is at most
    ``AUTO_PACK_SHARE``. Packing changes no batch and no loss, only the token slots a step computes."""
    if isinstance(train, StreamSplit):  # packed only when asked: the share needs every text tokenized
        return bool(want), None
    packable = not cached and "packing" in getattr(model.backbone, "features", ())
    if want is False or (want is None and not packable):
        return False, None
    share = packed_slot_share(train, tcfg.batch_size, buckets, seed=tcfg.seed)
    return (share <= AUTO_PACK_SHARE if want is None else want), share


def train(
    spec: RunSpec | None = None,
    *,
    callbacks: Sequence[loop.Callback] = (),
    progress: bool = True,
    argv: Sequence[str] | None = None,
    started: float | None = None,
    compile_cache=None,
    verbosity: str | int | None = None,
    **settings: Any,
) -> Run:
    """Run ``spec`` (or ``RunSpec.from_kwargs(**settings)``; both: the spec with those settings
    changed): the run folder with ``config.json``, ``metrics.jsonl`` and TensorBoard events
    (``report_to``), checkpoints (resumed when the folder has them), the final metrics,
    ``summary.json`` (with the throughput), the plots, ``report.html`` and, with ``profile_steps``, a
    ``jax.profiler`` trace.

    ``data=`` (or ``train=``, ``validation=``, ``test=``) is a path or the data itself: a pandas
    ``DataFrame``, a ``datasets`` ``Dataset`` / ``DatasetDict`` (its splits) / ``IterableDataset``
    (streamed), a dict of columns or a ``(texts, labels)`` tuple (:mod:`flaxheads.data.objects`); a run
    folder trained on such data resumes only on the same data.

    ``callbacks`` are :class:`~flaxheads.training.loop.Callback` objects given to ``fit``. A
    SIGTERM or Ctrl-C saves the step reached and raises
    :class:`~flaxheads.training.preemption.Interrupted`; calling again resumes. ``argv``,
    ``started`` (``time.perf_counter()`` at the program's start) and ``compile_cache`` are what the
    command records of itself. ``verbosity`` (``"warning"``, ``"summary"``, ``"info"``, ``"debug"``)
    sets how much this call tells, as :func:`flaxheads.set_verbosity` does for every call."""
    with verbosity_of(verbosity):
        job = prepare(check_spec((spec or RunSpec()).replace(**settings)))
        if job.spec.cached:
            return run_cached(job, argv=argv)
        return fine_tune(
            job, list(callbacks), progress=progress, argv=argv, started=started, compile_cache=compile_cache
        )
