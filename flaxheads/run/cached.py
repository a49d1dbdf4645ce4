"""Runs with ``cache_features`` / ``sweep=K``: encode every split once, train K heads (K=1
without a sweep) on the cached features with the library's :func:`flaxheads.training.sweep.sweep`,
keep the best on validation as a normal head checkpoint in ``<run folder>/checkpoints``, and
write ``sweep.md``, ``eval.txt`` and ``summary.json``."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from flaxheads.checkpoint import save_head
from flaxheads.training.features import FeatureCache, cache_features, choose_level, make_encoder, predict_cached, reduction
from flaxheads.tasks.metrics import compute_metrics, headline
from flaxheads.training.sweep import SweepResult, steps_per_epoch, sweep, sweep_variants
from flaxheads.run.folder import RunFolder, scalars
from flaxheads.run.report import write_report
from flaxheads.run.reporters import Reporters, resolve_report_to

if TYPE_CHECKING:  # annotation only: the program imports this module
    from flaxheads.run.program import Job, Run


def encode_splits(job: Job, batch_size: int) -> tuple[dict[str, FeatureCache], float]:
    """Every split's backbone features, encoded once (one compile per bucket); and the seconds it took."""
    t0 = time.perf_counter()
    model = job.model
    level = choose_level(model.head.pooler)
    enc = make_encoder(model, level, (reduction(model.head.pooler),) if level == "pooled" else ())
    caches = {n: cache_features(model, model.params["backbone"], s, batch_size=batch_size, buckets=job.buckets,
                                directory=job.out / "feature_cache" / n, encoder=enc)
              for n, s in job.splits.items()}
    return caches, time.perf_counter() - t0


def train_heads(job: Job, caches: dict[str, FeatureCache]) -> tuple[SweepResult, int]:
    """The sweep's heads around the run's learning rate; returns the result and the epochs trained."""
    o, seed = job.spec.optim, job.spec.seed
    variants = sweep_variants(max(o.sweep, 1), job.optim.learning_rate, job.optim.weight_decay, seed)
    spe = steps_per_epoch(caches["train"], o.batch_size)
    # max_steps wins over epochs, as in every other run
    epochs = -(-o.max_steps // spe) if o.max_steps else max(int(round(o.epochs)), 1)
    total = min(spe * epochs, o.max_steps or spe * epochs)
    ocfg = dataclasses.replace(job.optim, warmup_steps=int(o.warmup_ratio * total), total_steps=total,
                               head_learning_rate=None, accumulation_steps=1, freeze_backbone=True)
    res = sweep(job.model, caches["train"], variants, optim=ocfg, epochs=epochs, batch_size=o.batch_size,
                val=caches.get("validation"), seed=seed, loss_options=job.train.loss_options, max_steps=o.max_steps)
    return res, epochs


def _log(folder: RunFolder, res: SweepResult, spe: int, final: dict, report_to) -> None:
    """``metrics.jsonl`` and the event files as other runs write them: the best head's training loss
    per epoch, its validation, and the final metrics."""
    (folder.path / "metrics.jsonl").unlink(missing_ok=True)
    sinks = Reporters(folder.path, report_to)
    for e, losses in enumerate(res.losses):
        step = min((e + 1) * spe, res.steps)
        sinks.write({"step": step, "epoch": step / spe, "loss": float(losses[res.best])})
    if "validation" in final:
        sinks.write({"step": res.steps, "eval": {"validation": scalars(final["validation"])}})
    sinks.write({"step": res.steps, "final": {n: scalars(r) for n, r in final.items()}})
    sinks.close()


def run_cached(job: Job, argv=None) -> Run:
    """The cached-features program; returns the run."""
    from flaxheads.run.program import Run, run_config, split_counts

    folder = RunFolder(job.out)
    o = job.spec.optim
    folder.start(run_config(job, argv=argv), f"{split_counts(job.splits)} examples, {job.model.num_labels} labels, "
                                             f"heads on cached features ({max(o.sweep, 1)} at once)")
    caches, encode_s = encode_splits(job, o.eval_batch_size)
    res, epochs = train_heads(job, caches)
    k = len(res.variants)
    best = res.best_model(job.model)
    ckpt = save_head(job.out / "checkpoints", best, step=res.steps,
                     extra_meta={"sweep": {"variant": dataclasses.asdict(res.variants[res.best]), "k": k}})
    final = {name: compute_metrics(best.problem_type, predict_cached(best, best.params["head"], caches[name]),
                                   caches[name].labels, best.num_labels, threshold=job.train.threshold)
             for name in ("validation", "test") if name in caches}
    (job.out / "sweep.md").write_text(res.table() + "\n")
    _log(folder, res, steps_per_epoch(caches["train"], o.batch_size), final,
         resolve_report_to(job.spec.checkpoints.report_to))
    summary = {"mode": "cached-features" + (f" sweep K={k}" if k > 1 else ""), "encode_seconds": round(encode_s, 1),
               "head_seconds": round(res.seconds, 2), "steps": res.steps, "epochs": epochs,
               "best": dataclasses.asdict(res.variants[res.best]), "checkpoint": str(ckpt),
               "cache_bytes": {n: c.nbytes for n, c in caches.items()},
               "metrics": {n: scalars(r) for n, r in final.items()}, "run_folder": str(job.out)}
    text = folder.write_results(summary, final, best.id2label)
    write_report(folder.path)
    h = headline(best.problem_type)
    print(f"encoded {sum(len(c) for c in caches.values())} examples once in {encode_s:.1f} s; trained {k} head(s) "
          f"x {epochs} epochs in {res.seconds:.1f} s\n{res.table()}\n\n{text}\n\nbest head "
          f"({res.variants[res.best].label()}, validation {h} "
          f"{final.get('validation', {}).get(h, float('nan')):.4f}) saved to {ckpt}", flush=True)
    return Run(job.spec, summary, best, job.out)
