"""Runs with ``cache_features`` / ``sweep=K``: encode every split once, train K heads (K=1
without a sweep) on the cached features with the library's :func:`flaxheads.training.sweep.sweep`,
keep the best on validation as a normal head checkpoint in ``<run folder>/checkpoints``, and
write ``sweep.md`` and the run folder every run writes (the log through the run's writer, the
task's metrics, ``eval.txt``, ``summary.json``, the plots and the report)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from flaxheads.checkpoint import save_head
from flaxheads.run.folder import RunFolder, scalars
from flaxheads.run.job import Job, Run, run_config, split_counts
from flaxheads.run.report_data import worst_of
from flaxheads.run.spec import RunSpec
from flaxheads.runtime.logs import get_logger, use_default_handler
from flaxheads.training.feature_cache import FeatureCache, bucket_sizes, choose_level, reduction
from flaxheads.training.features import cache_features, make_encoder, predict_cached
from flaxheads.training.sweep import SweepResult, steps_per_epoch, sweep, sweep_variants

logger = get_logger("flaxheads.run")


def head_steps(spec: RunSpec, model, train, buckets) -> int:
    """The steps of heads trained on ``train``'s cached features: ``max_steps``, else whole epochs
    (at least one) of the cache's batches, counted before encoding."""
    spe = steps_per_epoch(
        bucket_sizes(model.head.pooler, [len(x) for x in train.input_ids], buckets), spec.optim.batch_size
    )
    return spec.optim.max_steps or spe * max(round(spec.optim.epochs), 1)


def encode_splits(job: Job, batch_size: int) -> tuple[dict[str, FeatureCache], float]:
    """Every split's backbone features, encoded once (one compile per bucket); and the seconds it took."""
    t0 = time.perf_counter()
    model = job.model
    level = choose_level(model.head.pooler)
    pooled = reduction(model.head.pooler) if level == "pooled" else None  # "pooled": the pooler has one
    enc = make_encoder(model, level, (pooled,) if pooled is not None else ())
    caches = {
        n: cache_features(
            model,
            model.params["backbone"],
            s,
            batch_size=batch_size,
            buckets=job.buckets,
            directory=job.out / "feature_cache" / n,
            encoder=enc,
        )
        for n, s in job.splits.items()
    }
    return caches, time.perf_counter() - t0


def train_heads(job: Job, caches: dict[str, FeatureCache]) -> SweepResult:
    """The sweep's heads around the run's learning rate, for the job's steps."""
    t = job.train
    variants = sweep_variants(max(job.spec.optim.sweep, 1), job.optim.learning_rate, job.optim.weight_decay, t.seed)
    epochs = -(-job.steps // steps_per_epoch(caches["train"], t.batch_size))
    return sweep(
        job.model,
        caches["train"],
        variants,
        optim=job.optim,
        epochs=epochs,
        batch_size=t.batch_size,
        val=caches.get("validation"),
        seed=t.seed,
        loss_options=t.loss_options,
        max_steps=job.steps,
    )


def run_cached(job: Job, argv=None) -> Run:
    """The cached-features program; returns the run."""
    use_default_handler()
    folder, t = RunFolder(job.out), job.train
    folder.start(
        run_config(job, argv=argv),
        job.task.describe(split_counts(job.splits), job.steps, t.batch_size)
        + f", heads on cached features ({max(job.spec.optim.sweep, 1)} at once)",
    )
    log = folder.logger(job.optim, job.steps, t.log_every, job.task.headline, report_to=job.report_to)
    caches, encode_s = encode_splits(job, t.eval_batch_size)
    res = train_heads(job, caches)
    k = len(res.variants)
    best = res.best_model(job.model)
    ckpt = save_head(
        job.out / "checkpoints",
        best,
        step=res.steps,
        extra_meta={"sweep": {"variant": dataclasses.asdict(res.variants[res.best]), "k": k}},
    )
    arrays: dict[str, dict] = {
        n: {"logits": predict_cached(best, best.params["head"], caches[n]), "labels": caches[n].labels}
        for n in ("validation", "test")
        if n in caches
    }
    final = {n: job.task.metrics(a["logits"], a["labels"]) for n, a in arrays.items()}
    (job.out / "sweep.md").write_text(res.table() + "\n")
    epochs, h = len(res.losses), job.task.headline
    logger.info(
        f"encoded {sum(len(c) for c in caches.values())} examples once in {encode_s:.1f} s; trained {k} head(s) "
        f"x {epochs} epochs in {res.seconds:.1f} s\n{res.table()}"
    )
    history = _log(log, res, steps_per_epoch(caches["train"], t.batch_size), final)
    mode = "cached-features" + (f" sweep K={k}" if k > 1 else "")
    summary: dict[str, Any] = {
        **job.task.summary_keys(),
        "mode": mode,
        "encode_seconds": round(encode_s, 1),
        "head_seconds": round(res.seconds, 2),
        "steps": res.steps,
        "epochs": epochs,
        "best": dataclasses.asdict(res.variants[res.best]),
        "checkpoint": str(ckpt),
        "cache_bytes": {n: c.nbytes for n, c in caches.items()},
        "metrics": {n: scalars(r) for n, r in final.items()},
        "run_folder": str(job.out),
    }
    predictions = {"test": arrays["test"]} if "test" in arrays else {}  # as fit's runs keep them
    folder.finish(
        summary,
        final,
        predictions,
        best.id2label,
        history=history,
        metric=h,
        worst=worst_of(job, arrays),
        tail=f"best head ({res.variants[res.best].label()}, validation {h} "
        f"{final.get('validation', {}).get(h, float('nan')):.4f}) saved to {ckpt}",
    )
    return Run(job.spec, summary, best, job.out)


def _log(log, res: SweepResult, spe: int, final: dict) -> list[dict]:
    """The best head's training loss per epoch and its validation metrics, written by the run's
    log as fit's are; returns them as fit's history."""
    history: list[dict[str, Any]] = []
    for e, losses in enumerate(res.losses):
        step = min((e + 1) * spe, res.steps)
        history.append({"step": step, "epoch": step / spe, "loss": float(losses[res.best])})
        log.write(history[-1])
    if "validation" in final:
        history.append({"step": res.steps, "eval": {"validation": final["validation"]}})
        log.on_evaluate(None, res.steps, history[-1]["eval"])
    return history
