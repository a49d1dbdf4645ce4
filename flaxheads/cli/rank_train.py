"""``flaxheads train --objective pairwise|hinge|listwise|listnet|pointwise``: a reranker or reward
model (one score per (query, candidate) text pair) trained on groups, with the run folder,
checkpoints, resume, devices and LoRA of classification (:mod:`flaxheads.cli.fit_program`).

Data: ``--data bbc_news`` (the packaged corpus as a relevance set: each headline with a passage of
its class and ``--negatives`` passages of other classes, see
:func:`flaxheads.ranking.data.bbc_news_groups`), or a preference / ranking table (see
:mod:`flaxheads.ranking.data`) as ``--data`` split by ``--split``, or as ``--train-file`` /
``--validation-file`` / ``--test-file``. ``--batch-size`` and ``--eval-batch-size`` count groups.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np

from .. import __version__
from ..batching import make_buckets
from ..errors import UsageError
from ..host import ComputePlan
from ..model import SequenceModel, from_pretrained
from ..interop.tokenizers import load_tokenizer
from ..parallel import Parallel
from ..ranking.data import (GroupedSplit, GroupTable, check_unit_relevance, collate_groups, load_groups, split_groups,
                            tokenize_groups)
from ..ranking.metrics import headline, metric_names, ranking_metrics
from ..ranking.objectives import MARGIN_OBJECTIVES, OBJECTIVES
from ..ranking.train import RankingTrainer
from ..tables import DataError
from ..training import loop
from ..training.data import SPLITS
from ..training.memory import memory_report
from ..training.optim import OptimConfig, count_params
from .fit_program import (checked_run_folder, fit_until_signal, init_distributed, optim_config, resolve_model,
                          train_config, usable_max_length)
from .lora_flags import with_lora_flags
from .plots import plot_curve
from .resume import open_checkpoints
from .run_folder import RunFolder

RANKING_OBJECTIVES = OBJECTIVES


def add_ranking_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of ranking objectives (``--objective`` itself is a training flag)."""
    g = ap.add_argument_group("ranking objectives (--objective other than classification)")
    g.add_argument("--query-column", default=None,
                   help="query / prompt column of a ranking or preference table (default: prompt, else query)")
    g.add_argument("--negatives", type=int, default=3,
                   help="--data bbc_news: passages of other classes per headline (default 3)")
    g.add_argument("--margin", type=float, default=None,
                   help="pairwise: s_chosen - s_rejected must exceed it (default 0); hinge: the margin (default 1)")
    g.add_argument("--scale", type=float, default=None,
                   help="listwise / listnet: scores are multiplied by it before the softmax (default 1)")


def check_ranking_flags(args: argparse.Namespace) -> None:
    """Refuse classification-only flags with a ranking objective."""
    bad = [flag for flag, on in (("--cache-features", args.cache_features), ("--sweep", args.sweep),
                                 ("--pack", args.pack), ("--label-smoothing", args.label_smoothing),
                                 ("--text-pair-column", args.text_pair_column),
                                 ("--problem-type", args.problem_type)) if on]
    if bad:
        raise UsageError(f"{bad[0]} does not apply to --objective {args.objective} (a one-score ranker trained on "
                         "groups): drop it")
    if args.negatives < 1:
        raise UsageError(f"--negatives must be at least 1, got {args.negatives}")
    if args.margin is not None and args.objective not in ("pairwise", "hinge"):
        raise UsageError(f"--margin applies to --objective pairwise or hinge, not {args.objective}")
    if args.scale is not None and args.objective not in ("listwise", "listnet"):
        raise UsageError(f"--scale applies to --objective listwise or listnet, not {args.objective}")


def objective_options(args: argparse.Namespace) -> dict:
    if args.objective in ("pairwise", "hinge") and args.margin is not None:
        return {"margin": args.margin}
    if args.objective in ("listwise", "listnet") and args.scale is not None:
        return {"scale": args.scale}
    return {}


def load_group_splits(args: argparse.Namespace) -> dict[str, GroupTable]:
    opts = dict(query_column=args.query_column, negatives=args.negatives, seed=args.seed, limit=args.limit)
    if args.train_file:
        tables = {"train": load_groups(args.train_file, **opts)}
        for name, f in (("validation", args.validation_file), ("test", args.test_file)):
            if f:
                tables[name] = load_groups(f, **opts)
        return tables
    full = load_groups(args.data, **opts)
    if args.limit and args.data != "bbc_news" and args.limit < len(full):
        full = full.take(np.sort(np.random.default_rng(args.seed + 1).permutation(len(full))[:args.limit]))
    tables = split_groups(full, args.split, args.seed)
    if "train" not in tables:
        raise DataError(f"{args.data}: the split {args.split} of {len(full)} groups leaves no training groups")
    return tables


def best_metric(args: argparse.Namespace, metric: str, has_validation: bool) -> str | None:
    """``--keep-best-by``: ``auto`` (the validation ``metric``, if there is a validation split),
    ``none``, or ``validation/<metric>`` of the ranking metrics."""
    flag = args.keep_best_by
    if flag == "none" or (flag == "auto" and not has_validation):
        return None
    if flag == "auto":
        return f"validation/{metric}"
    split, _, name = flag.partition("/")
    if split != "validation" or name not in metric_names():
        raise UsageError(f"--keep-best-by {flag!r}: a ranking run evaluates validation/<metric> with metric one of "
                         f"{', '.join(metric_names())} (or use `auto` / `none`)")
    return flag


@dataclasses.dataclass
class RankJob:
    """What the flags of one ranking run resolve to (the fields checkpoints and the run folder read)."""

    model_path: str
    model: SequenceModel
    splits: dict[str, GroupedSplit]
    group_size: int
    buckets: tuple[int, ...]
    max_length: int
    pad_id: int
    out: Path
    train: loop.TrainConfig
    optim: OptimConfig
    best_metric: str | None
    headline: str
    data: dict


def prepare_ranking(args: argparse.Namespace) -> RankJob:
    check_ranking_flags(args)
    path = resolve_model(args.model)
    out = checked_run_folder(args, path, trains_backbone=not (args.freeze_backbone or args.lora_rank),
                             suffix=f"-{args.objective}")
    init_distributed(args)
    tables = load_group_splits(args)
    if args.objective == "pointwise":
        for t in tables.values():
            check_unit_relevance(t, args.objective)
    with_margins = [t.source for t in tables.values() if t.margins is not None]
    if with_margins and args.objective not in MARGIN_OBJECTIVES:
        raise UsageError(f"{with_margins[0]} has a margin column, which the {' and '.join(MARGIN_OBJECTIVES)} "
                         f"objectives use, not --objective {args.objective}: drop the column or change the objective")
    has_val = "validation" in tables
    if args.eval_every is not None and not has_val:
        raise UsageError("--eval-every needs a validation split, and this run has none")
    best = best_metric(args, headline(tables["train"].kind), has_val)
    plan = ComputePlan.for_host(precision=args.precision)
    pooler = None if args.pooler == "preset" else args.pooler.split(",") if "," in args.pooler else args.pooler
    model = with_lora_flags(args, from_pretrained(
        path, pooler=pooler, head=None if args.head == "preset" else args.head, num_labels=1, problem_type="regression",
        dtype=plan.precision.dtype, plan=plan, seed=args.seed, ignore_mismatched_sizes=True,
        head_options={"hidden_dims": tuple(args.head_hidden)} if args.head_hidden else None))
    tok = load_tokenizer(path)
    max_length = usable_max_length(args.max_length, tok, model, path)
    splits = {n: tokenize_groups(t, tok, max_length, n) for n, t in tables.items()}
    tcfg = dataclasses.replace(train_config(args), pack=False, loss_options={})
    data = {"data": args.data, "train_file": args.train_file, "validation_file": args.validation_file,
            "test_file": args.test_file, "split": list(args.split), "seed": args.seed, "limit": args.limit,
            "kind": tables["train"].kind, "negatives": args.negatives if args.data == "bbc_news" else None}
    return RankJob(path, model, splits, max(t.max_group for t in tables.values()),
                   make_buckets(max_length, min(args.bucket_step, max_length)), max_length,
                   tok.pad_token_id if tok.pad_token_id is not None else 0, out, tcfg,
                   optim_config(args, len(splits["train"]), tcfg, frozen=args.freeze_backbone), best,
                   headline(tables["train"].kind), data)


def ranking_config(job: RankJob, args: argparse.Namespace, trainer: RankingTrainer) -> dict:
    """Every resolved setting of the run (its ``config.json``; the keys resume compares)."""
    model = job.model
    return {"model": job.model_path, "objective": args.objective, "objective_options": objective_options(args),
            "pooler": args.pooler, "head": args.head, "head_config": model.head_config(),
            "problem_type": model.problem_type, "labels": None, "num_labels": 1, "group_size": job.group_size,
            "bf16": model.plan.precision.name == "bfloat16", "max_length": job.max_length, "buckets": list(job.buckets),
            "data": job.data, "sizes": {n: len(s) for n, s in job.splits.items()},
            "rows": {n: int(s.offsets[-1]) for n, s in job.splits.items()},
            "train": dataclasses.asdict(job.train), "optimizer": dataclasses.asdict(job.optim),
            "checkpoints": {"keep": args.keep, "best_metric": job.best_metric, "every": args.checkpoint_every},
            "devices": {"parallel": job.train.parallel, "count": jax.device_count(), "width": trainer.parallel.width,
                        "processes": jax.process_count()},
            "lora": None if model.lora is None else model.lora.to_dict(),
            "params": {k: count_params(v) for k, v in model.params.items()},
            "argv": sys.argv[1:], "flaxheads_version": __version__}


def run_ranking(args: argparse.Namespace) -> dict:
    """Train a ranking objective; write the run folder; return the summary."""
    job = prepare_ranking(args)
    trainer = RankingTrainer.build(job.model, job.optim, job.train, Parallel.from_config(job.train.parallel,
                                                                                          job.train.mesh),
                                   objective=args.objective, group_size=job.group_size,
                                   objective_options=objective_options(args))
    if job.train.batch_size % trainer.parallel.width:
        raise UsageError(f"--batch-size {job.train.batch_size} (groups) must be a multiple of the "
                         f"{trainer.parallel.width} data-parallel devices, so that every group stays on one device")
    config = ranking_config(job, args, trainer)
    lead = jax.process_index() == 0
    ckpt, state0 = open_checkpoints(args, job, trainer, config, lead)
    folder = RunFolder(job.out, lead)
    total = loop.total_steps(len(job.splits["train"]), job.train)
    sizes = " / ".join(f"{len(job.splits[n]) if n in job.splits else 0} {n}" for n in SPLITS)
    kind = "backbone frozen" if job.optim.freeze_backbone else (
        f"LoRA rank {job.model.lora.rank}" if job.model.lora is not None else "full fine-tune")
    folder.start(config, f"{sizes} groups of up to {job.group_size} candidates, objective {args.objective}, "
                         f"{total} steps of {job.train.batch_size} groups, {kind}, {trainer.parallel.width} device(s)")
    if job.train.mesh:  # every process compiles the same program; the first one reports
        report = memory_report(trainer, _largest_batch(job))
        if lead:
            print("\n".join(report.lines()), flush=True)
    log = folder.logger(job.optim, total, job.train.log_every, job.model.problem_type)
    log.metric = job.headline
    evals = {"validation": job.splits["validation"]} if "validation" in job.splits else {}
    res = fit_until_signal(trainer, job.splits["train"], ckpt, [log], evals=evals, buckets=job.buckets,
                           pad_id=job.pad_id, progress=lead and not args.no_progress, state=state0)
    final, predictions = _final_results(trainer, res, job)
    summary = {"objective": args.objective, "steps": res.step,
               "resumed_from": None if state0 is None else int(state0.step),
               "checkpoints": None if ckpt is None else ckpt.ckr.root, "seconds": round(res.seconds, 1),
               "train_compiles": res.train_compiles, "eval_compiles": res.eval_compiles,
               "metrics": {n: {k: v for k, v in r.items() if isinstance(v, (int, float))} for n, r in final.items()},
               "run_folder": str(job.out)}
    _finish(folder, summary, final, predictions, res, job)
    return summary


def _largest_batch(job: RankJob) -> dict:
    """The first groups of a training batch padded to the longest bucket (a step's most activation memory)."""
    train = job.splits["train"]
    groups = np.arange(min(job.train.batch_size, len(train)))
    return collate_groups(train, groups, job.train.batch_size, job.group_size, job.buckets[-1:], job.pad_id)


def _final_results(trainer: RankingTrainer, res: loop.FitResult, job: RankJob) -> tuple[dict, dict]:
    final, predictions = {}, {}
    if "test" in job.splits:
        s, y, g = trainer.scores(res.state.params, trainer.batches(job.splits["test"], buckets=job.buckets,
                                                                   pad_id=job.pad_id))
        predictions["test"] = {"scores": s, "labels": y, "groups": g}
        final["test"] = ranking_metrics(s, y, g, ks=trainer.ks)
    last = next((e["eval"] for e in reversed(res.history) if "eval" in e), {})
    return {**last, **final}, predictions


def _finish(folder: RunFolder, summary: dict, final: dict, predictions: dict, res: loop.FitResult,
            job: RankJob) -> None:
    if folder.log is not None and folder.log.file is not None:
        folder.log.write({"step": summary["steps"], "final": summary["metrics"]})
        folder.log.file.close()
    text = folder.write_results(summary, final, None, predictions)
    if not folder.lead:
        return
    plot_curve(folder.path / "curve.png", res.history, job.headline)
    print(f"\n{text}\n\n{res.step} steps in {res.seconds:.0f} s; run folder: {folder.path}", flush=True)


__all__ = ["RANKING_OBJECTIVES", "add_ranking_flags", "run_ranking"]
