"""Shared pieces of the run tests: the topics their tables are drawn from, a news table, and a run's
logged rows without the wall-clock timings."""

from __future__ import annotations

import csv
import json
import os

from train_helpers import WORDS

from flaxheads.training.loop import TIMED

#: Four topics of words; a news row's words are drawn from its class's topic.
TOPICS = [WORDS[32:38], WORDS[38:43], WORDS[43:48], WORDS[48:53]]


def write_news(path, rng) -> None:
    """A news table of 40 rows (text, label c0 to c2, each text 3 to 8 words of its class's topic)
    into the CSV file ``path``, drawn from ``rng`` (a NumPy generator, which goes on from there)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i in range(40):
            t = i % 3
            w.writerow([" ".join(rng.choice(TOPICS[t], int(rng.integers(3, 9)))), f"c{t}"])


def metrics_rows(folder) -> list[dict]:
    """The run folder's metrics.jsonl without the wall-clock throughput."""
    out = []
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            for k in TIMED:
                e.pop(k, None)
            out.append(e)
    return out
