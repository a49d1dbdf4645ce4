"""The ``flaxheads train`` program: flags -> data, tokenizer and model (:func:`prepare`) -> the
library's ``fit`` with the run folder's log and checkpoints (:func:`run_fine_tune`). The
cached-features / sweep path is :mod:`flaxheads.cli.sweep`."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

from .. import __version__
from ..errors import UsageError
from ..hub import PACKAGED_MODEL, resolve_model_source
from ..interop.peft import load_peft
from ..interop.tokenizers import load_tokenizer, model_max_positions
from ..batching import make_buckets
from ..model import SequenceModel, from_pretrained
from ..parallel import Parallel
from ..preflight import check_run_folder
from ..host import ComputePlan
from ..host.precision import Precision
from ..tables import LabelSpace
from ..training import loop
from ..training.data import SPLITS, DataConfig, Split, load_splits, tokenize
from ..training.streaming import StreamSplit, open_stream, ordered_batches, streams
from ..training.metrics import compute_metrics
from ..training.optim import OptimConfig, count_params
from ..training.packing import AUTO_PACK_SHARE, packed_slot_share
from ..training.preemption import SignalWatch, StopOnSignal
from ..training.memory import memory_report
from .lora_flags import LORA_LR, trains_adapters, with_lora_flags
from .resume import best_metric, open_checkpoints
from .run_folder import RunFolder

DEFAULT_MODEL = PACKAGED_MODEL
# all-MiniLM-L6-v2 on BBC News on a 2-core CPU: see the README for what these measured.
DEFAULTS = dict(max_length=128, epochs=2.0, batch_size=16, lr=1e-4, head_lr=1e-3, probe_lr=5e-3)


@dataclasses.dataclass
class Job:
    """What the flags of one run resolve to: data, model, and the settings the library takes."""

    model_path: str
    model: SequenceModel
    space: LabelSpace
    data: DataConfig
    splits: dict[str, Split]
    buckets: tuple[int, ...]
    max_length: int
    pad_id: int
    out: Path
    train: loop.TrainConfig
    optim: OptimConfig
    best_metric: str | None
    cached: bool  # --cache-features / --sweep: heads on features encoded once
    precision: Precision
    pack_share: float | None = None  # packed token slots over padded ones, where the run packs


def resolve_model(name: str) -> str:
    """The model folder: a local Hugging Face folder, the packaged all-MiniLM-L6-v2, or a hub id
    (downloaded, or found in the local hub cache offline)."""
    return resolve_model_source(name, what="--model")


def init_distributed(args: argparse.Namespace) -> None:
    """Join a multi-process run (``jax.distributed``) when ``--coordinator-address`` is given."""
    if args.coordinator_address is None:
        return
    # CPU devices need a collectives backend across processes (gloo); GPU/TPU ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator_address == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=args.num_processes, process_id=args.process_id)


def data_config(args: argparse.Namespace) -> DataConfig:
    return DataConfig(data=args.data, train_file=args.train_file, validation_file=args.validation_file,
                      test_file=args.test_file, text_column=args.text_column, text_pair_column=args.text_pair_column,
                      label_column=args.label_column, problem_type=args.problem_type, split=tuple(args.split),
                      seed=args.seed, limit=args.limit, label_ids=args.label_ids,
                      labels=getattr(args, "labels", None), eval_limit=getattr(args, "eval_limit", None),
                      stream=getattr(args, "stream", None))


def train_config(args: argparse.Namespace) -> loop.TrainConfig:
    mesh = getattr(args, "mesh", None)
    parallel = "mesh" if args.coordinator_address is not None or mesh else args.parallel
    return loop.TrainConfig(epochs=args.epochs, batch_size=args.batch_size, eval_batch_size=args.eval_batch_size,
                            max_steps=args.max_steps, eval_every=args.eval_every, log_every=args.log_every,
                            seed=args.seed, parallel=parallel, mesh=mesh, threshold=args.threshold, pack=bool(args.pack),
                            loss_options={"label_smoothing": args.label_smoothing} if args.label_smoothing else {})


def optim_config(args: argparse.Namespace, n_train: int, tcfg: loop.TrainConfig, frozen: bool) -> OptimConfig:
    """AdamW settings; the schedule counts optimizer steps (micro-steps / accumulation steps)."""
    default_lr = LORA_LR if trains_adapters(args) else DEFAULTS["probe_lr" if frozen else "lr"]
    lr = args.lr if args.lr is not None else default_lr
    head_lr = args.head_lr if args.head_lr is not None else (lr if frozen else DEFAULTS["head_lr"])
    opt_steps = max(loop.total_steps(n_train, tcfg) // args.accumulation_steps, 1)
    return OptimConfig(learning_rate=lr, head_learning_rate=head_lr, weight_decay=args.weight_decay,
                       schedule=args.schedule, warmup_steps=int(args.warmup_ratio * opt_steps), total_steps=opt_steps,
                       max_grad_norm=args.max_grad_norm or None, accumulation_steps=args.accumulation_steps,
                       freeze_backbone=frozen)


def build_model(args: argparse.Namespace, path: str, space: LabelSpace, plan: ComputePlan) -> SequenceModel:
    if args.lora_from is not None:
        return adapter_model(args, path, space, plan)
    pooler = None if args.pooler == "preset" else args.pooler.split(",") if "," in args.pooler else args.pooler
    model = from_pretrained(path, pooler=pooler, head=None if args.head == "preset" else args.head,
                            id2label=space.id2label if space.names else None, num_labels=space.num_labels,
                            problem_type=space.problem_type, dtype=plan.precision.dtype, plan=plan,
                            seed=args.seed, ignore_mismatched_sizes=True,
                            head_options={"hidden_dims": tuple(args.head_hidden)} if args.head_hidden else None)
    return with_lora_flags(args, model)


def adapter_model(args: argparse.Namespace, path: str, space: LabelSpace, plan: ComputePlan) -> SequenceModel:
    """``--lora-from``: the PEFT adapter folder's adapters and head on the base ``--model``."""
    model = load_peft(args.lora_from, backbone=path, id2label=space.id2label if space.names else None,
                      problem_type=space.problem_type, dtype=plan.precision.dtype, plan=plan)
    if model.num_labels != space.num_labels:
        raise UsageError(f"--lora-from {args.lora_from}: the adapter's classifier has {model.num_labels} outputs but "
                         f"the data has {space.num_labels} labels; continue it on data with the same labels")
    return model


def model_positions(tok, model: SequenceModel) -> int | None:
    """The most tokens the model takes (:func:`~flaxheads.interop.tokenizers.model_max_positions`)."""
    return model_max_positions(tok, model.backbone.config)


def usable_max_length(requested: int, tok, model: SequenceModel, path: str) -> int:
    """``--max-length``, or the model's positions with a warning when it asks for more."""
    limit = model_positions(tok, model)
    if limit is not None and requested > limit:
        print(f"warning: --max-length {requested} is more than the {limit} positions of {path}; "
              f"using --max-length {limit}", file=sys.stderr, flush=True)
        return limit
    return requested


def _require_validation(args: argparse.Namespace, has_validation: bool) -> None:
    needs = [flag for flag, on in (("--eval-every", args.eval_every is not None),
                                    ("--sweep K>1 (picks the best head)", args.sweep > 1),
                                    (f"--keep-best-by {args.keep_best_by}", args.keep_best_by not in ("auto", "none")))
             if on]
    if needs and not has_validation:
        how = "--validation-file" if args.train_file else "a validation fraction in --split (e.g. 0.8,0.1,0.1)"
        raise UsageError(f"{needs[0]} needs a validation split, and this run has none: give {how}")


def run_folder_path(args: argparse.Namespace, suffix: str = "") -> Path:
    """``--output-dir``, or ``runs/<time>-<data name><suffix>``."""
    stem = Path(str(args.train_file or args.data)).stem
    return Path(args.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{stem}{suffix}")


def checked_run_folder(args: argparse.Namespace, model_path: str, *, trains_backbone: bool, suffix: str = "") -> Path:
    """The run folder, checked before any model loads (a folder, writable, room for ``--keep`` checkpoints)."""
    out = run_folder_path(args, suffix)
    check_run_folder(out, model_path, trains_backbone=trains_backbone, keep=args.keep,
                     keep_best=args.keep_best_by != "none", checkpoints=args.checkpoint_every != 0)
    return out


def fit_until_signal(trainer: loop.Trainer, train, ckpt, callbacks: list, **fit_kwargs) -> loop.FitResult:
    """:func:`loop.fit` with the run's checkpoints; SIGTERM / SIGINT end it at a step boundary with that
    step saved (:class:`~flaxheads.training.preemption.Interrupted`, which the command turns into one line)."""
    with SignalWatch(checkpoints=None if ckpt is None else ckpt.ckr.root) as watch:  # SIGTERM/SIGINT: save, stop
        res = loop.fit(trainer, train, callbacks=callbacks + ([ckpt] if ckpt is not None else [])
                       + [StopOnSignal(watch, ckpt)], **fit_kwargs)
        if ckpt is not None:
            ckpt.ckr.close()  # wait for the last asynchronous save
    watch.raise_if_signalled(res.step, None if ckpt is None else res.step)
    return res


def prepare(args: argparse.Namespace) -> Job:
    """Data, tokenizer and model for the flags (the flags are already checked)."""
    path = resolve_model(args.model)
    out = checked_run_folder(args, path, trains_backbone=not (args.freeze_backbone or args.cache_features
                                                                or args.sweep or args.lora_rank))
    init_distributed(args)
    data = data_config(args)
    cached = bool(args.cache_features or args.sweep)
    stream = _open_stream(data, cached)
    tables, space, labels = load_splits(data) if stream is None else (stream.sources, stream.space, None)
    _require_validation(args, "validation" in tables)
    best = best_metric(args.keep_best_by, space, has_validation="validation" in tables)
    plan = ComputePlan.for_host(precision=args.precision)  # the one plan of this run; precision settled by check_flags
    model = build_model(args, path, space, plan)
    tok = load_tokenizer(path)
    max_length = usable_max_length(args.max_length, tok, model, path)
    splits = ({n: tokenize(t, labels[n], tok, max_length, n) for n, t in tables.items()} if stream is None
              else stream.splits(tok, max_length))
    buckets = make_buckets(max_length, min(args.bucket_step, max_length))
    tcfg = train_config(args)
    pack, share = resolve_pack(args.pack, model, splits["train"], tcfg, buckets, cached)
    tcfg = dataclasses.replace(tcfg, pack=pack)
    return Job(path, model, space, data, splits, buckets,
               max_length, tok.pad_token_id if tok.pad_token_id is not None else 0, out, tcfg,
               optim_config(args, len(splits["train"]), tcfg, frozen=args.freeze_backbone or cached), best, cached,
               plan.precision, share if pack else None)


def _open_stream(data: DataConfig, cached: bool):
    """The streamed data's scan (``training.streaming.open_stream``), or None for data read into memory."""
    if not streams(data.train_file or data.data, data.stream):
        return None
    if cached:
        raise UsageError("--cache-features/--sweep encode the whole training split once, in memory; streamed data "
                         "cannot: train the head with --freeze-backbone, or use --no-stream for a table that fits")
    return open_stream(data)


def resolve_pack(want: bool | None, model: SequenceModel, train: Split, tcfg: loop.TrainConfig,
                 buckets: tuple[int, ...], cached: bool) -> tuple[bool, float | None]:
    """Whether the run packs, and the packed share of the padded token slots
    (``training.packing.packed_slot_share``; None where nothing would pack).

    ``--pack`` / ``--no-pack`` as given; neither: packed when the backbone keeps packed texts
    apart, the backbone is not cached, and the share is at most ``AUTO_PACK_SHARE``. Packing
    changes no batch and no loss, only the token slots a step computes."""
    if isinstance(train, StreamSplit):
        if want:
            raise UsageError("--pack needs the training split in memory; streamed data trains unpacked (drop "
                             "--pack, or --no-stream for a table that fits in memory)")
        return False, None
    packable = not cached and "packing" in getattr(model.backbone, "features", ())
    if want is False or (want is None and not packable):
        return False, None
    share = packed_slot_share(train, tcfg.batch_size, buckets, seed=tcfg.seed)
    return (share <= AUTO_PACK_SHARE if want is None else want), share


def split_counts(splits: dict) -> str:
    """``"36 train / 6 validation / 0 test"``: every split, 0 for one the run does not have."""
    return " / ".join(f"{len(splits[n]) if n in splits else 0} {n}" for n in SPLITS)


def run_config(job: Job, args: argparse.Namespace, trainer: loop.Trainer | None = None) -> dict:
    """Every resolved setting of the run (its ``config.json``); ``trainer`` None: heads on cached
    features, one device."""
    model = job.model
    width, mesh = (1, None) if trainer is None else (trainer.parallel.width, trainer.parallel.mesh)
    return {"model": job.model_path, "pooler": args.pooler, "head": args.head, "head_config": model.head_config(),
            "problem_type": model.problem_type, "labels": job.space.names, "num_labels": model.num_labels,
            "bf16": job.precision.name == "bfloat16", "precision": dataclasses.asdict(job.precision),
            "compute_plan": job.model.plan.describe(),
            "max_length": job.max_length, "buckets": list(job.buckets),
            "data": dataclasses.asdict(job.data), "sizes": {n: len(s) for n, s in job.splits.items()},
            "train": dataclasses.asdict(job.train), "optimizer": dataclasses.asdict(job.optim),
            "checkpoints": {"keep": args.keep, "best_metric": job.best_metric, "every": args.checkpoint_every},
            "devices": {"parallel": job.train.parallel, "count": jax.device_count(), "width": width,
                        "processes": jax.process_count(), "platform": jax.devices()[0].platform,
                        **({"mesh": dict(mesh.shape)} if mesh is not None else {})},
            "lora": None if model.lora is None else model.lora.to_dict(),
            "params": {k: count_params(v) for k, v in model.params.items()},
            "argv": sys.argv[1:], "flaxheads_version": __version__}


def _final_results(trainer: loop.Trainer, res: loop.FitResult, job: Job) -> tuple[dict, dict]:
    """Metrics of the last validation and of the test split, and the test predictions."""
    final, predictions = {}, {}
    if "test" in job.splits:
        batches = ordered_batches(job.splits["test"], job.train.eval_batch_size, job.buckets, pad_id=job.pad_id)
        logits, labels = trainer.predict(res.state.params, batches)
        predictions["test"] = {"logits": np.asarray(logits), "labels": np.asarray(labels)}
        final["test"] = compute_metrics(job.model.problem_type, logits, labels, job.model.num_labels,
                                        threshold=job.train.threshold)
    last = next((e["eval"] for e in reversed(res.history) if "eval" in e), {})
    return {**last, **final}, predictions


def _stream_note(job: Job) -> str:
    if not isinstance(job.splits["train"], StreamSplit):
        return ""
    sample = job.splits.get("validation")
    return (", read from disk as it trains (streamed)"
            + (f", evaluating on a sample of {len(sample)} validation examples" if isinstance(sample, Split)
               and job.data.eval_limit else ""))


def _packing_note(job: Job) -> str:
    if not job.train.pack or job.pack_share is None:
        return ""
    return f", short texts packed ({job.pack_share:.0%} of the padded token slots; --no-pack to turn off)"


def run_fine_tune(job: Job, args: argparse.Namespace) -> dict:
    """Train with the library's ``fit``; write the run folder; return the summary."""
    trainer = loop.Trainer.build(job.model, job.optim, job.train, Parallel.from_config(job.train.parallel, job.train.mesh))
    config = run_config(job, args, trainer)
    lead = jax.process_index() == 0
    ckpt, state0 = open_checkpoints(args, job, trainer, config, lead)
    folder = RunFolder(job.out, lead)
    total = loop.total_steps(len(job.splits["train"]), job.train)
    folder.start(config, f"{split_counts(job.splits)} examples, {job.model.num_labels} labels, {total} steps of "
                         f"{job.train.batch_size}, {_training_kind(job)}"
                         f", {trainer.parallel.width} device(s) ({job.train.parallel}), "
                         f"{job.precision.name} ({job.precision.reason})" + _packing_note(job) + _stream_note(job))
    if lead:
        print(job.model.plan.describe(), flush=True)
    if job.train.mesh:  # every process compiles the same program; the first one reports
        report = memory_report(trainer, _largest_batch(job))
        if lead:
            print("\n".join(report.lines()), flush=True)
    callbacks = [folder.logger(job.optim, total, job.train.log_every, job.model.problem_type)]
    evals = {"validation": job.splits["validation"]} if "validation" in job.splits else {}
    fit_called = time.perf_counter()
    res = fit_until_signal(trainer, job.splits["train"], ckpt, callbacks, evals=evals, buckets=job.buckets,
                           pad_id=job.pad_id, progress=lead and not args.no_progress, state=state0)
    final, predictions = _final_results(trainer, res, job)
    summary = {"steps": res.step, "resumed_from": None if state0 is None else int(state0.step),
               "checkpoints": None if ckpt is None else ckpt.ckr.root, "seconds": round(res.seconds, 1),
               "eval_seconds": round(res.eval_seconds, 1), **_startup(args, res, fit_called),
               "train_compiles": res.train_compiles, "eval_compiles": res.eval_compiles,
               "buckets": list(job.buckets), "metrics": {n: _scalars(r) for n, r in final.items()},
               "run_folder": str(job.out)}
    cache = getattr(args, "compile_cache", None)
    if cache is not None:
        summary["compile_cache"] = {"folder": str(cache.folder), "loaded": cache.hits, "compiled": cache.compiled,
                                    "stored": cache.stored}
    folder.finish(summary, final, predictions, job.model, history=res.history,
                  tail=f"{res.step} steps in {res.seconds:.0f} s"
                       + (f" (first step done {summary['seconds_to_first_step']:.0f} s after the start)"
                          if "seconds_to_first_step" in summary else "")
                       + f"; compiles: {res.train_compiles} train, "
                       f"{res.eval_compiles} eval (buckets {list(job.buckets)})"
                       + (f"; {cache.summary()}" if cache is not None else ""))
    return summary


def _startup(args: argparse.Namespace, res: loop.FitResult, fit_called: float) -> dict:
    """How long the first step took (its compile included) and, for the command, how long from its
    start (data, tokenizer, model, compile) to that step's end: what the compile cache shortens."""
    if res.first_step_seconds is None:
        return {}
    out = {"first_step_seconds": round(res.first_step_seconds, 1)}
    started = getattr(args, "started", None)
    if started is not None:
        out["seconds_to_first_step"] = round(fit_called - started + res.first_step_seconds, 1)
    return out


def _largest_batch(job: Job) -> dict:
    """A training batch padded to the longest bucket (the most activation memory a step takes)."""
    return next(iter(ordered_batches(job.splits["train"], job.train.batch_size, job.buckets[-1:], pad_id=job.pad_id)))


def _scalars(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, (int, float))}


def _training_kind(job: Job) -> str:
    if job.model.lora is not None:
        return f"LoRA rank {job.model.lora.rank} on {', '.join(job.model.lora.targets)} (base frozen)"
    return "backbone frozen" if job.optim.freeze_backbone else "full fine-tune"
