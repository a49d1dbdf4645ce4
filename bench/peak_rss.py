"""Whole-process peak RSS of `flaxheads train` on a streamed table of N rows, per heap setting.

Each run is a fresh `python -m flaxheads train` process; its peak resident set is the kernel's
(``wait4`` rusage ``ru_maxrss``), the whole process over its whole life (imports, the stream's scan,
compiles, steps, evaluation, checkpoints), not a sampled delta. Heap settings compared, interleaved
run by run: flaxheads' own (``FLAXHEADS_MALLOC=1``: one arena, no mmap, no trim; flaxheads/runtime/malloc.py)
and glibc's defaults (``FLAXHEADS_MALLOC=0``).

    python bench/peak_rss.py --rows 10000000 --runs 5 --steps 30

The table (``text,label``, short texts of 4 classes, about 30 bytes a row) is written once to
``--table`` and reused. Prints one line per run and the max per setting, with the CPU named.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench import common  # noqa: E402

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()


def write_table(path: str, rows: int) -> None:
    """``rows`` rows, written in blocks (no row list in memory)."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        f.write("text,label\n")
        for start in range(0, rows, 100_000):
            f.write(
                "".join(
                    f"{' '.join(rng.choices(WORDS, k=4))},c{(start + i) % 4}\n"
                    for i in range(min(100_000, rows - start))
                )
            )


def peak_rss(argv: list[str], env: dict) -> tuple[int, float, int]:
    """(peak RSS bytes, seconds, exit code) of one child process."""
    t = time.perf_counter()
    p = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.stderr.write(p.stderr.read()[-2000:])
    return usage.ru_maxrss * 1024, time.perf_counter() - t, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-limit", type=int, default=512, help="rows of each evaluation split scored")
    ap.add_argument("--model", default="all-MiniLM-L6-v2")
    ap.add_argument("--table", default=None, help="where the CSV goes (default: a temp folder)")
    ap.add_argument("--settings", default="flaxheads,glibc")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="peak_rss-")
    table = args.table or os.path.join(work, f"rows{args.rows}.csv")
    if not os.path.exists(table):
        t = time.perf_counter()
        write_table(table, args.rows)
        print(
            f"wrote {table} ({os.path.getsize(table) / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s", flush=True
        )
    print(
        f"CPU: {common.cpu_name()}, {os.cpu_count()} cores; {args.rows:,} rows streamed, {args.steps} steps, "
        f"model {args.model}",
        flush=True,
    )
    peaks: dict[str, list[int]] = {}
    for run in range(args.runs):
        for setting in args.settings.split(","):
            env = {**os.environ, "PYTHONPATH": REPO, "FLAXHEADS_MALLOC": "1" if setting == "flaxheads" else "0"}
            out = os.path.join(work, f"run-{setting}-{run}")
            argv = [
                sys.executable,
                "-m",
                "flaxheads",
                "train",
                "--model",
                args.model,
                "--data",
                table,
                "--stream",
                "--max-steps",
                str(args.steps),
                "--batch-size",
                "32",
                "--max-length",
                "32",
                "--no-progress",
                "--checkpoint-every",
                "0",
                "--eval-limit",
                str(args.eval_limit),
                "--split",
                "0.998,0.001,0.001",
                "--output-dir",
                out,
            ]  # a 10^4-row test split at 10^7 rows
            rss, secs, code = peak_rss(argv, env)
            peaks.setdefault(setting, []).append(rss)
            print(
                f"run {run} heap={setting:<9} peak RSS {rss / 2**30:.2f} GiB in {secs:.0f} s (exit {code})", flush=True
            )
    for setting, values in peaks.items():
        print(
            f"heap={setting:<9} max peak {max(values) / 2**30:.2f} GiB over {len(values)} runs "
            f"(min {min(values) / 2**30:.2f})"
        )


if __name__ == "__main__":
    main()
