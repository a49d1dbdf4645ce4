"""The input pipeline at scale: ``flaxheads train`` on 10^5 .. 10^7 short rows, streamed.

    python bench/input_pipeline.py                               # 10^5, 10^6, 10^7 rows (long)
    python bench/input_pipeline.py --sizes 100000,1000000 --steps 30

Data: sentences (20-200 characters) of the packaged BBC News corpus with their article's class,
repeated in a fixed stride order up to each size, written as CSV to ``--workdir`` (kept between
runs). Recipe: all-MiniLM-L6-v2, mean pooler + linear head, ``--max-length 64 --batch-size 32``,
``--split 0.998,0.001,0.001 --eval-limit 200``, ``--max-steps`` steps, no checkpoints.

Measured, each run a fresh ``flaxheads train`` process:

* peak RSS of the process (``wait4``'s ``ru_maxrss``) and the seconds from its start to the end of
  its first step (its summary's ``seconds_to_first_step``; no compile cache, so the compile is in
  it), for every size streamed and, as the reference, the smallest size read into memory
  (``--no-stream``, the path small tables take);
* steady step time in the run: the median over its log windows (``--log-every 5``) after the first
  two, of the batch size over the logged examples/s.

The pipeline alone, a fresh process per size with no model: RSS after the imports, and its peak
over the scan, ``--batches`` training batches and a pass over the whole test split (the growth is
what the pipeline holds; a training run's peak also holds the compiles, which vary by ~1 GB from
run to run on this machine). And the scan's seconds.

Then in this process, on the smallest size:

* steps fed by the live pipeline (reading and tokenizing in its background thread) against the same
  steps on the same batches made beforehand (pre-tokenized, in memory), interleaved in segments of
  ``--segment`` steps; ratio > 1 means the pipeline slows the steps;
* tokenisation: texts/s of the pipeline's tokenizing of windows (Arrow columns to token ids and
  label ids, as training does) against the ``tokenizers`` library's own ``encode_batch`` on the same
  texts with the same truncation.
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import common  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = [
    "--max-length",
    "64",
    "--batch-size",
    "32",
    "--split",
    "0.998,0.001,0.001",
    "--eval-limit",
    "200",
    "--checkpoint-every",
    "0",
    "--log-every",
    "5",
    "--no-progress",
]


def sentences() -> list[tuple[str, str]]:
    """(sentence, class) of BBC News, 20-200 characters, in corpus order."""
    from flaxheads.data.tables import bbc_news_path

    root, out = bbc_news_path(), []
    for c in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for f in sorted((root / c).iterdir()):
            text = f.read_bytes().decode("utf-8", "replace")
            for s in re.split(r"(?<=[.!?])\s+", text):
                s = " ".join(s.split())
                if 20 <= len(s) <= 200:
                    out.append((s, c))
    return out


def make_rows(n: int, folder: Path) -> Path:
    """``rows<n>.csv`` in ``folder``: ``n`` rows of sentences in a stride order (classes mixed)."""
    path = folder / f"rows{n}.csv"
    if path.exists():
        return path
    rows = sentences()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(n):
            w.writerow(rows[(i * 7919) % len(rows)])
    tmp.rename(path)
    return path


def run_train(data: Path, steps: int, out: Path, *extra: str) -> dict:
    """One ``flaxheads train`` process: peak RSS (MB), seconds to the first step, steady ms/step, wall s."""
    cmd = [
        sys.executable,
        "-m",
        "flaxheads",
        "train",
        "--data",
        str(data),
        *RECIPE,
        "--max-steps",
        str(steps),
        "--output-dir",
        str(out),
        *extra,
    ]
    # no compile cache: every run compiles, as a first run does
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "FLAXHEADS_COMPILE_CACHE": "0",
    }
    t = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{log[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    windows = [json.loads(x) for x in open(out / "metrics.jsonl") if '"examples_per_s"' in x]
    steady = [32e3 / e["examples_per_s"] for e in windows[2:]] or [float("nan")]
    return {
        "rss_mb": usage.ru_maxrss / 1024,
        "first_step_s": summary.get("seconds_to_first_step"),
        "step_ms": statistics.median(steady),
        "wall_s": wall,
    }


def pipeline_alone(data: str, batches: int) -> dict:
    """In this process (no model): the scan, ``batches`` training batches and the whole test split
    through the pipeline; RSS after the imports, its peak, and the seconds of the scan."""
    import datasets  # noqa: F401  (imported before the baseline: a fixed cost, not the pipeline's)
    import pyarrow  # noqa: F401

    from flaxheads.data import streaming as S
    from flaxheads.data.splits import DataConfig
    from flaxheads.interop.tokenizers import load_tokenizer

    tok = load_tokenizer(common.minilm_path())
    with common.PeakRSS(interval=0.005) as mem:
        t = time.perf_counter()
        sd = S.open_stream(DataConfig(data=data, stream=True, split=(0.998, 0.001, 0.001), eval_limit=200))
        scan = time.perf_counter() - t
        splits = sd.splits(tok, 64)
        for i, _ in enumerate(S.stream_batches(splits["train"], 32, (32, 64))):
            if i + 1 == batches:
                break
        tested = sum(1 for _ in S.ordered_batches(splits["test"], 64, (32, 64)))
    return {
        "base_mb": mem.base / 2**20,
        "peak_mb": (mem.base + mem.peak) / 2**20,
        "scan_s": scan,
        "test_batches": tested,
    }


def run_pipeline_alone(data: Path, batches: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, __file__, "--pipeline-alone", str(data), "--batches", str(batches)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def pipeline_against_pretokenized(data: Path, segment: int, rounds: int) -> dict:
    """Median step ms fed by the live pipeline and by the same batches made beforehand."""
    import jax

    from flaxheads.cli.train import build_parser, spec_from_args
    from flaxheads.run.checks import check_spec
    from flaxheads.run.program import prepare
    from flaxheads.training import loop

    args = build_parser().parse_args(["--data", str(data), "--stream", *RECIPE, "--max-steps", "1000"])
    job = prepare(check_spec(spec_from_args(args)))
    trainer = loop.Trainer.build(job.model, job.optim, job.train)
    train = job.splits["train"]
    batches = loop.train_batches(trainer, train)
    n = segment * rounds

    def stream(start=0):
        return batches(train, 32, job.buckets, seed=0, epoch=0, start=start, pad_id=job.pad_id)

    made = [b for _, b in zip(range(n), stream())]
    state = trainer.parallel.put_state(trainer.init_state())
    for b in {b["input_ids"].shape: b for b in made}.values():  # compile every shape first
        state, _ = trainer.step(state, b)
    live_ms, made_ms = [], []
    live = stream()
    for r in range(rounds):
        for _ in range(segment):  # the live pipeline: waiting for the batch counts
            t = time.perf_counter()
            b = next(live)
            state, _ = trainer.step(state, b)
            live_ms.append((time.perf_counter() - t) * 1e3)
        for b in made[r * segment : (r + 1) * segment]:  # the same batches, made beforehand
            t = time.perf_counter()
            state, _ = trainer.step(state, b)
            made_ms.append((time.perf_counter() - t) * 1e3)
    jax.block_until_ready(state)
    return {"live_ms": statistics.median(live_ms), "made_ms": statistics.median(made_ms), "job": job}


def tokenize_throughput(job, texts_wanted: int, repeats: int = 3) -> dict:
    """texts/s: the pipeline's window tokenizing against ``tokenizers``' encode_batch, same texts."""
    import numpy as np

    train = job.splits["train"]
    windows = []
    for where, chunk in train.windows(8192):
        windows.append((where, chunk))
        if sum(c.num_rows for _, c in windows) >= texts_wanted:
            break
    texts = [t for _, c in windows for t in c.column("text").to_pylist()]
    backend = train.tokenizer.backend if hasattr(train.tokenizer, "backend") else None
    from tokenizers import Tokenizer

    raw = (
        Tokenizer.from_str(backend.to_str())
        if backend is not None
        else Tokenizer.from_file(str(Path(job.model_path) / "tokenizer.json"))
    )
    raw.enable_truncation(job.max_length)
    raw.no_padding()
    ours, theirs = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        for where, chunk in windows:
            train.tokenized(where, chunk, np.arange(chunk.num_rows))
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        raw.encode_batch(texts)
        theirs.append(time.perf_counter() - t)
    return {"texts": len(texts), "ours": len(texts) / min(ours), "tokenizers": len(texts) / min(theirs)}


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--sizes", default="100000,1000000,10000000")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--segment", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "flaxheads-input-pipeline"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--pipeline-alone", default=None, help=argparse_hidden())
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument(
        "--parts",
        default="runs,alone,steps",
        help="what to measure: runs (training processes), alone (the pipeline without a model), steps "
        "(live pipeline against pre-tokenized batches, and tokenisation)",
    )
    args = ap.parse_args()
    if args.pipeline_alone:
        print(json.dumps(pipeline_alone(args.pipeline_alone, args.batches)))
        return
    common.configure_xla(args.xla_flags)
    sizes = [int(x) for x in args.sizes.split(",")]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print(f"# {common.environment()}", flush=True)
    files = {}
    for n in sizes:
        t = time.perf_counter()
        files[n] = make_rows(n, work)
        print(
            f"# {files[n].name}: {files[n].stat().st_size / 2**20:.0f} MiB ({time.perf_counter() - t:.0f} s to "
            "write or find)",
            flush=True,
        )
    parts = set(args.parts.split(","))
    small = sizes[0]
    runs, alone, p, t = {}, {}, {}, {}
    if "runs" in parts:
        runs = training_runs(files, sizes, args.steps, work)
    if "alone" in parts:
        alone = pipeline_alone_table(files, sizes, args.batches)
    if "steps" in parts:
        p, t = live_against_made(files[small], args)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "runs": {f"{n} {h}": r for (n, h), r in runs.items()},
                    "alone": alone,
                    "pipeline": {k: v for k, v in p.items() if k != "job"},
                    "tokenize": t,
                },
                indent=1,
            )
        )


def training_runs(files: dict, sizes: list[int], steps: int, work: Path) -> dict:
    runs = {}
    small = sizes[0]
    runs[(small, "in memory")] = run_train(files[small], steps, work / "run-mem", "--no-stream")
    for n in sizes:
        runs[(n, "streamed")] = run_train(files[n], steps, work / f"run-{n}", "--stream")
        print(f"# {n} rows streamed: {runs[(n, 'streamed')]}", flush=True)
    ref = runs[(small, "in memory")]
    print("\n| rows | data | peak RSS MB | vs in memory | first step s | vs in memory | steady ms/step | whole run s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (n, how), r in runs.items():
        print(
            f"| {n:,} | {how} | {r['rss_mb']:.0f} | {r['rss_mb'] / ref['rss_mb']:.2f}x | {r['first_step_s']} | "
            f"{r['first_step_s'] / ref['first_step_s']:.2f}x | {r['step_ms']:.0f} | {r['wall_s']:.0f} |"
        )
    streamed = [r["rss_mb"] for (n, how), r in runs.items() if how == "streamed"]
    print(f"\npeak RSS streamed: largest / smallest size {max(streamed) / min(streamed):.2f}x")
    return runs


def pipeline_alone_table(files: dict, sizes: list[int], batches: int) -> dict:
    small = sizes[0]
    alone = {n: run_pipeline_alone(files[n], batches) for n in sizes}
    print(
        f"\nthe pipeline alone (no model; a process that scans, makes {batches} training batches and reads "
        "the whole test split):\n"
    )
    print("| rows | scan s | RSS after imports MB | peak RSS MB | growth MB | growth vs smallest |")
    print("| --- | --- | --- | --- | --- | --- |")
    g0 = alone[small]["peak_mb"] - alone[small]["base_mb"]
    for n, a in alone.items():
        g = a["peak_mb"] - a["base_mb"]
        print(f"| {n:,} | {a['scan_s']:.1f} | {a['base_mb']:.0f} | {a['peak_mb']:.0f} | {g:.0f} | {g / g0:.2f}x |")
    return alone


def live_against_made(data: Path, args) -> tuple[dict, dict]:
    p = pipeline_against_pretokenized(data, args.segment, args.rounds)
    print(
        f"\nsteps fed by the live pipeline: {p['live_ms']:.1f} ms median; on the same batches pre-tokenized: "
        f"{p['made_ms']:.1f} ms; ratio {p['live_ms'] / p['made_ms']:.3f} ({args.rounds} x {args.segment} steps each, "
        "interleaved)"
    )
    t = tokenize_throughput(p["job"], 40000)
    print(
        f"tokenisation of {t['texts']:,} texts (64 tokens max): pipeline {t['ours']:,.0f} texts/s, tokenizers "
        f"encode_batch {t['tokenizers']:,.0f} texts/s; ratio {t['ours'] / t['tokenizers']:.2f}"
    )
    return p, t


if __name__ == "__main__":
    main()
