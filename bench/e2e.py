"""End to end: the ``flaxheads train`` command against Hugging Face ``transformers.Trainer``
(PyTorch) on the same split of the same data with the same recipe, each in float32 and bfloat16.

    python bench/e2e.py                                 # BBC News, the `make train` job (long)
    python bench/e2e.py --data lexicon                  # ~7,500 single words: training throughput
    python bench/e2e.py --limit 200 --epochs 1 --precisions float32 --json out.json   # a quick look

Data (``--data``):

* ``bbc_news``: the packaged corpus (2225 articles, 5 classes), split by flaxheads' own
  ``load_splits`` (stratified, seeded); the recipe is ``make train``'s.
* ``lexicon``: the VADER sentiment lexicon (``pip install vaderSentiment``): each token with a mean
  rating > 0 is ``positive``, < 0 ``negative`` (a token listed twice keeps its last rating, as
  VADER's own dictionary does). Written to a CSV that ``flaxheads train --data`` reads and splits.
  flaxheads runs with ``--no-pack`` (system ``flaxheads``) and ``--pack`` (system ``flaxheads_pack``).

Recipe: all-MiniLM-L6-v2, mean pooler + linear head, max length 128, batch 16, ``--epochs`` (2),
every other setting at ``flaxheads train``'s defaults. The Trainer side (bench/hf_trainer.py)
gets the optimizer (AdamW, both learning rates, weight decay and its mask, warmup steps, linear
decay, clipping), the head's dropout and init, the length grouping of training batches, the
evaluation cadence and the checkpoint policy as flaxheads' own code resolves them for that
command line, and the exact train / validation / test examples and label ids.

Each run is a fresh process (environment as ``make`` sets it, plus the heap settings that
``flaxheads`` applies to itself, ``flaxheads.runtime.malloc.malloc_env``, so the Trainer gets the same
heap), one at a time; flaxheads gets an
empty compile cache per run, so each run compiles as a first run does. Per run: wall time of the
whole process (timed from outside: imports, data, tokenisation, compile, training, evaluation,
test, files); train time (flaxheads' summary ``seconds`` / the Trainer's ``train_runtime``: the
training loop including its evaluations and checkpoint saves); training examples/s over the
training loop without the intervals that held an evaluation or a save (``train ex/s``, compile and
warm-up included) and also without the first 10 steps (``steady ex/s``); test accuracy and
macro-F1 (both sides scored by flaxheads' metrics); steps. Best precision of a system: the fastest
wall time among its runs with test accuracy >= ``--min-accuracy`` (0.975 on bbc_news, 0 on the
lexicon). Ratios > 1 mean flaxheads is faster.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: The environment `make train` runs in (Makefile): malloc settings that JAX on CPU wants, offline hub.
MAKE_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
}
SYSTEMS = ("flaxheads", "flaxheads_pack", "hf_trainer")
DEFAULT_SYSTEMS = {"bbc_news": "flaxheads,hf_trainer", "lexicon": "flaxheads,flaxheads_pack,hf_trainer"}
MIN_ACCURACY = {"bbc_news": 0.975, "lexicon": 0.0}
WARM_STEPS = 10  # left out of "steady ex/s": compile (flaxheads) and the first allocations (both)


def parse_args(argv: list[str] | None = None):
    ap = common.parser(__doc__)
    ap.add_argument("--data", choices=("bbc_news", "lexicon"), default="bbc_news")
    ap.add_argument(
        "--systems",
        default=None,
        help=f"comma-separated, from {', '.join(SYSTEMS)} (default: "
        "flaxheads,hf_trainer; the lexicon adds flaxheads_pack)",
    )
    ap.add_argument(
        "--precisions",
        default=None,
        help="comma-separated (default: float32,bfloat16 where the CPU multiplies bfloat16 natively, "
        "else float32: there PyTorch's bf16 autocast runs ~100x slower and flaxheads' bf16 dots "
        "run converted)",
    )
    ap.add_argument("--limit", type=int, default=None, help="a stratified subset of N examples (quick runs)")
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the recipe's seed (data split, initialisation, batch order), both systems alike",
    )
    ap.add_argument(
        "--checkpoints",
        choices=("default", "off"),
        default="default",
        help="default: flaxheads' policy (a save at each evaluation, the 3 most recent and the best by "
        "validation accuracy kept), the Trainer the same; off: no saves on either side",
    )
    ap.add_argument("--min-accuracy", type=float, default=None, help="test accuracy a run needs to count as best")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run folders (under runs/e2e-<time>/)")
    a = ap.parse_args(argv)
    a.systems = [s for s in (a.systems or DEFAULT_SYSTEMS[a.data]).split(",") if s]
    if a.precisions is None:
        a.precisions = "float32,bfloat16" if common.bf16_hardware() else "float32"
    a.precisions = [p for p in a.precisions.split(",") if p]
    bad = [s for s in a.systems if s not in SYSTEMS] + [p for p in a.precisions if p not in ("float32", "bfloat16")]
    if bad:
        ap.error(f"unknown system or precision {bad[0]!r}")
    if a.seed < 0:
        ap.error(f"--seed must be >= 0 (flaxheads train takes non-negative seeds), got {a.seed}")
    if a.min_accuracy is None:
        a.min_accuracy = MIN_ACCURACY[a.data]
    return a


# ---- data and recipe -----------------------------------------------------------------------
def lexicon_csv(folder: Path) -> Path:
    """The VADER lexicon as ``text,label`` rows (zeros dropped), written to ``folder``."""
    try:
        import vaderSentiment
    except ImportError:
        sys.exit("bench/e2e.py --data lexicon needs the VADER lexicon: pip install vaderSentiment")
    rating: dict[str, float] = {}
    lex = Path(vaderSentiment.__file__).parent / "vader_lexicon.txt"
    for line in lex.read_text(encoding="utf-8").splitlines():
        parts = line.strip("\r\n").split("\t")
        if len(parts) >= 2 and parts[0]:
            rating[parts[0]] = float(parts[1])  # a repeated token: the last rating wins, as in VADER
    path = folder / "vader_lexicon.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows([t, "positive" if r > 0 else "negative"] for t, r in rating.items() if r != 0)
    return path


def recipe_argv(a, source: str) -> list[str]:
    """The ``flaxheads train`` flags every run of this bench shares (the `make train` job)."""
    argv = [
        "--model",
        "all-MiniLM-L6-v2",
        "--data",
        source,
        "--text-column",
        "text",
        "--label-column",
        "label",
        "--max-length",
        "128",
        "--batch-size",
        "16",
        "--epochs",
        f"{a.epochs:g}",
        "--seed",
        str(a.seed),
        "--no-progress",
    ]
    argv += ["--limit", str(a.limit)] if a.limit else []
    return argv + (["--checkpoint-every", "0"] if a.checkpoints == "off" else [])


def resolve(argv: list[str], workdir: Path) -> dict:
    """What ``flaxheads train argv`` resolves to, by flaxheads' own code: the split (written to a
    file for the Trainer side), the optimizer, the head, the checkpoint policy, the batch order."""
    from flaxheads.cli.train import build_parser, spec_from_args
    from flaxheads.data.splits import load_splits
    from flaxheads.heads.heads import make_head
    from flaxheads.model.hub import resolve_model_source
    from flaxheads.run.data import data_config
    from flaxheads.run.program import optim_config, train_config
    from flaxheads.training import loop

    args = build_parser().parse_args(argv)
    spec = spec_from_args(args)
    tables, space, labels = load_splits(data_config(spec))
    tcfg = train_config(spec)
    optim = optim_config(spec, loop.total_steps(len(tables["train"]), tcfg))
    head = make_head(args.head, num_labels=space.num_labels)
    data_file = workdir / "splits.json"
    data_file.write_text(
        json.dumps({n: {"texts": list(t.texts), "labels": labels[n].tolist()} for n, t in tables.items()})
    )
    return {
        "model": resolve_model_source(args.model),
        "data_file": str(data_file),
        "num_labels": space.num_labels,
        "sizes": {n: len(t) for n, t in tables.items()},
        "max_length": args.max_length,
        "batch_size": tcfg.batch_size,
        "eval_batch_size": tcfg.eval_batch_size,
        "epochs": tcfg.epochs,
        "seed": tcfg.seed,
        "log_every": tcfg.log_every,
        "optim": dataclasses.asdict(optim),
        "dropout": head.dropout,
        "init_std": head.init_std,
        # fit's default (the CLI does not change it): batches of similar lengths within windows
        "group_by_length": inspect.signature(loop.fit).parameters["group_by_length"].default,
        "checkpoints": {"save": args.checkpoint_every != 0, "keep": args.keep, "best": args.keep_best_by},
    }


# ---- runs ----------------------------------------------------------------------------------
def apply_make_env(xla_flags: str | None) -> None:
    """Make's settings in this process's environment, which every run inherits (the malloc ones as
    make's ``?=``: a value already set is kept), flaxheads' heap settings for every system alike,
    plus ``--xla-flags``."""
    from flaxheads.runtime.malloc import malloc_env

    for k, v in {**malloc_env(), **MAKE_ENV}.items():
        if k.startswith("MALLOC_"):
            os.environ.setdefault(k, v)
        else:
            os.environ[k] = v
    if xla_flags:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags).strip()


def timed(cmd: list[str], env: dict, log: Path) -> tuple[float, int]:
    """Wall seconds and exit code of ``cmd`` (output to ``log``)."""
    with open(log, "w") as f:
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
        return time.perf_counter() - t0, rc


def step_examples(spec: dict, total: int) -> list[int]:
    """Real examples in each of flaxheads' training steps (its batch plan; a short batch per epoch)."""
    import numpy as np

    from flaxheads.data.splits import batch_plan
    from flaxheads.training.loop import steps_per_epoch

    n, bs = spec["sizes"]["train"], spec["batch_size"]
    spe = steps_per_epoch(n, bs)
    plans = {}
    out = []
    for s in range(total):
        e = s // spe
        if e not in plans:  # sizes do not depend on the lengths: equal lengths give the same cuts
            plans[e] = batch_plan(
                np.ones(n, np.int64), bs, seed=spec["seed"], epoch=e, group_by_length=spec["group_by_length"]
            )
        out.append(len(plans[e][s % spe]))
    return out


def flaxheads_intervals(run: Path, spec: dict, total: int) -> list[dict]:
    """Timed windows from metrics.jsonl: each log line gives the examples/s since the previous one;
    a window is marked when an evaluation (and its save) ran inside it."""
    entries = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = [e["step"] for e in entries if "eval" in e]
    counts = step_examples(spec, total)
    out, prev = [], 0
    for e in entries:
        if "examples_per_s" not in e:
            continue
        step = e["step"]
        seen = sum(counts[prev:step])
        out.append(
            {
                "first_step": prev + 1,
                "last_step": step,
                "examples": seen,
                "seconds": seen / max(e["examples_per_s"], 1e-9),
                "eval": any(prev <= v < step for v in evals),
            }
        )
        prev = step
    return out


def throughput(intervals: list[dict], skip: int = 0) -> float | None:
    """Examples/s over the intervals that held no evaluation, from step ``skip + 1`` on."""
    use = [iv for iv in intervals if not iv["eval"] and iv["first_step"] > skip]
    secs = sum(iv["seconds"] for iv in use)
    return sum(iv["examples"] for iv in use) / secs if use and secs > 0 else None


def run_flaxheads(spec: dict, argv: list[str], precision: str, pack: bool, folder: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "flaxheads",
        "train",
        *argv,
        "--precision",
        precision,
        "--pack" if pack else "--no-pack",
        "--output-dir",
        str(folder / "run"),
    ]
    folder.mkdir(parents=True)
    wall, rc = timed(cmd, {**os.environ, "FLAXHEADS_COMPILE_CACHE": str(folder / "compile-cache")}, folder / "log.txt")
    row = {"wall_s": wall, "command": "python -m flaxheads train " + " ".join(cmd[4:])}
    if rc != 0:
        return {**row, "error": f"exit {rc}: " + _tail(folder / "log.txt")}
    s = json.loads((folder / "run" / "summary.json").read_text())
    test = s["metrics"].get("test", {})
    iv = flaxheads_intervals(folder / "run", spec, s["steps"])
    cache = s.get("compile_cache") or {}
    val = s["metrics"].get("validation", {})
    return {
        **row,
        "train_s": s["seconds"],
        "steps": s["steps"],
        "test_accuracy": test.get("accuracy"),
        "test_macro_f1": test.get("macro_f1"),
        "validation_accuracy": val.get("accuracy"),
        "train_eps": throughput(iv),
        "steady_eps": throughput(iv, WARM_STEPS),
        "intervals": iv,
        "compile_cache": cache,
        "note": f"compiles: {s['train_compiles']} train, {s['eval_compiles']} eval",
    }


def run_hf(spec: dict, precision: str, folder: Path) -> dict:
    import numpy as np

    from flaxheads.losses import SINGLE_LABEL
    from flaxheads.tasks.metrics import compute_metrics

    folder.mkdir(parents=True)
    job = {**spec, "precision": precision, "output_dir": str(folder / "run"), "result": str(folder / "result.json")}
    (folder / "spec.json").write_text(json.dumps(job))
    cmd = [sys.executable, str(ROOT / "bench" / "hf_trainer.py"), str(folder / "spec.json")]
    wall, rc = timed(cmd, dict(os.environ), folder / "log.txt")
    row = {"wall_s": wall, "command": f"python bench/hf_trainer.py {folder / 'spec.json'}"}
    if rc != 0:
        return {**row, "error": f"exit {rc}: " + _tail(folder / "log.txt")}
    r = json.loads((folder / "result.json").read_text())
    m = (
        compute_metrics(SINGLE_LABEL, np.asarray(r["test_logits"]), np.asarray(r["test_labels"]), spec["num_labels"])
        if r["test_logits"] is not None
        else {}
    )
    return {
        **row,
        "train_s": r["train_runtime"],
        "steps": r["steps"],
        "test_accuracy": m.get("accuracy"),
        "test_macro_f1": m.get("macro_f1"),
        "validation_accuracy": r["validation_accuracy"],
        "train_eps": throughput(r["intervals"]),
        "steady_eps": throughput(r["intervals"], WARM_STEPS),
        "intervals": r["intervals"],
        "note": f"{r['attn_implementation']} attention, {r['torch_threads']} threads, imports "
        f"{r['timings']['imports']:.1f} s",
    }


def _tail(log: Path) -> str:
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1][:200] if lines else "no output"


# ---- report --------------------------------------------------------------------------------
def cpu_info() -> dict:
    """The CPU's model name and whether it multiplies bfloat16 natively (AVX512-BF16, AMX)."""
    from flaxheads.runtime.cpu import CpuInfo

    cpu = CpuInfo.read()
    return {
        "model": cpu.model or "unknown",
        "avx512_bf16": "avx512_bf16" in cpu.flags,
        "amx_bf16": cpu.amx,
        "cores": os.cpu_count(),
    }


def versions() -> dict:
    out = {}
    for p in ("jax", "jaxlib", "flax", "torch", "transformers", "accelerate", "flaxheads"):
        try:
            out[p] = importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return {"python": sys.version.split()[0], **out}


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    out = [
        "| system | precision | wall s | train s | train ex/s | steady ex/s | test acc | test macro-F1 | "
        "steps | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['system']} | {r['precision']} | {r['wall_s']:.1f} | failed: {r['error']} | | | | | | |")
            continue
        out.append(
            f"| {r['system']} | {r['precision']} | {r['wall_s']:.1f} | {r['train_s']:.1f} | "
            f"{_f(r['train_eps'], '.1f')} | {_f(r['steady_eps'], '.1f')} | {_f(r['test_accuracy'], '.4f')} | "
            f"{_f(r['test_macro_f1'], '.4f')} | {r['steps']} | {r['note']} |"
        )
    return "\n".join(out)


def best_runs(rows: list[dict], min_accuracy: float) -> dict[str, dict | None]:
    """Per system: its fastest run (wall time) among those reaching ``min_accuracy``."""
    out: dict[str, dict | None] = {}
    for r in rows:
        out.setdefault(r["system"], None)
        ok = "error" not in r and (r["test_accuracy"] or 0.0) >= min_accuracy
        if ok and (out[r["system"]] is None or r["wall_s"] < out[r["system"]]["wall_s"]):
            out[r["system"]] = r
    return out


def best_lines(best: dict[str, dict | None], min_accuracy: float) -> list[str]:
    lines = []
    for s, r in best.items():
        lines.append(
            f"best precision of {s}: "
            + (
                f"none reached test accuracy {min_accuracy:g}"
                if r is None
                else f"{r['precision']} (wall {r['wall_s']:.1f} s, train ex/s {_f(r['train_eps'], '.1f')}, "
                f"test accuracy {_f(r['test_accuracy'], '.4f')})"
            )
        )
    hf = best.get("hf_trainer")
    for s in ("flaxheads", "flaxheads_pack"):
        fx = best.get(s)
        if hf and fx:
            eps = f"{fx['train_eps'] / hf['train_eps']:.2f}x" if fx["train_eps"] and hf["train_eps"] else "-"
            lines.append(
                f"hf_trainer best / {s} best: wall {hf['wall_s'] / fx['wall_s']:.2f}x; train ex/s "
                f"{s} / hf_trainer {eps} (> 1: flaxheads faster)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    apply_make_env(a.xla_flags)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    work = Path(tempfile.mkdtemp(prefix="flaxheads-e2e-"))
    runs = ROOT / "runs" / f"e2e-{stamp}" if a.keep_runs else work / "runs"
    try:
        source = str(lexicon_csv(work)) if a.data == "lexicon" else "bbc_news"
        argv_fh = recipe_argv(a, source)
        spec = resolve(argv_fh, work)
        o = spec["optim"]
        keep = spec["checkpoints"]["keep"]
        ck = (
            "off on both sides (flaxheads --checkpoint-every 0, Trainer save_strategy=no)"
            if a.checkpoints == "off"
            else f"flaxheads' default: a save at each evaluation (each epoch), the {keep} most recent + the best "
            f"by validation accuracy kept; Trainer save_strategy=epoch, save_total_limit={keep}, "
            "metric_for_best_model=accuracy"
        )
        head = [
            f"# e2e: {a.data}, split {' / '.join(f'{v} {k}' for k, v in spec['sizes'].items())}; all-MiniLM-L6-v2, "
            f"mean pooler + linear head (dropout {spec['dropout']}), max length {spec['max_length']}, batch "
            f"{spec['batch_size']}, {spec['epochs']:g} epochs = {o['total_steps']} steps",
            f"# AdamW lr {o['learning_rate']:g} backbone / {o['head_learning_rate']:g} head, weight decay "
            f"{o['weight_decay']:g} (not on biases / LayerNorm), {o['schedule']} schedule, {o['warmup_steps']} "
            f"warmup steps, clip {o['max_grad_norm']}, length-grouped batches: {spec['group_by_length']}; "
            f"validation each epoch, eval batch {spec['eval_batch_size']}",
            f"# checkpoints: {ck}",
            f"# flaxheads: python -m flaxheads train {' '.join(argv_fh)} "
            + "--precision P; fresh compile cache per run",
        ]
        print("\n".join(head), flush=True)
        rows = []
        cpu = cpu_info()
        if "hf_trainer" in a.systems and "bfloat16" in a.precisions and not common.bf16_hardware():
            print(
                "# note: this CPU has neither AVX512-BF16 nor AMX: PyTorch's bfloat16 autocast runs its matmuls "
                "converted, and the hf_trainer bfloat16 run takes many times its float32 run",
                flush=True,
            )
        for i, precision in enumerate(a.precisions):
            order = a.systems[i % len(a.systems) :] + a.systems[: i % len(a.systems)]  # no system always first
            for system in order:
                folder = runs / f"{system}-{precision}"
                r = (
                    run_hf(spec, precision, folder)
                    if system == "hf_trainer"
                    else run_flaxheads(spec, argv_fh, precision, system == "flaxheads_pack", folder)
                )
                rows.append({"system": system, "precision": precision, **r})
                print(
                    f"# done: {system} {precision}: wall {r['wall_s']:.1f} s"
                    + (
                        f", test accuracy {_f(r.get('test_accuracy'), '.4f')}"
                        if "error" not in r
                        else f", {r['error']}"
                    ),
                    flush=True,
                )
                time.sleep(2)  # let the last process's threads and page cache settle
        best = best_runs(rows, a.min_accuracy)
        env = common.environment() if "torch" in sys.modules or _has("torch") else ""
        tail = [
            f"# CPU: {cpu['model']}, {cpu['cores']} cores, avx512_bf16: {cpu['avx512_bf16']}, amx_bf16: "
            f"{cpu['amx_bf16']}; versions: " + ", ".join(f"{k} {v}" for k, v in versions().items() if v),
            f"# {env}",
            "# train s: the training loop with its evaluations and saves (flaxheads summary seconds / "
            "Trainer train_runtime); ex/s without the intervals holding an evaluation or a save",
        ]
        print("\n" + table(rows) + "\n\n" + "\n".join(best_lines(best, a.min_accuracy) + tail))
        if a.json:
            Path(a.json).write_text(
                json.dumps(
                    {
                        "data": a.data,
                        "limit": a.limit,
                        "sizes": spec["sizes"],
                        "recipe": {
                            k: spec[k]
                            for k in (
                                "max_length",
                                "batch_size",
                                "eval_batch_size",
                                "epochs",
                                "seed",
                                "optim",
                                "dropout",
                                "init_std",
                                "group_by_length",
                                "checkpoints",
                            )
                        },
                        "flaxheads_argv": argv_fh,
                        "runs": rows,
                        "best": {s: (None if r is None else r["precision"]) for s, r in best.items()},
                        "min_accuracy": a.min_accuracy,
                        "cpu": cpu,
                        "versions": versions(),
                        "environment": env,
                    },
                    indent=1,
                )
            )
        if a.keep_runs:
            print(f"# run folders: {runs}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    sys.exit(main())
