"""What the report page shows that a run knows while it runs: the label counts of its splits, its
worst-classified validation (else test) examples (with their text), the page rewritten at each evaluation, and the
throughput line of the run's last printed line."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from flaxheads.data.splits import Split
from flaxheads.losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL
from flaxheads.run.report import write_report
from flaxheads.runtime.logs import get_logger
from flaxheads.training import loop

#: Rows of the worst-classified table.
WORST = 10
logger = get_logger("flaxheads.run")


class ReportPage(loop.Callback):
    """Rewrites ``<run>/report.html`` after each evaluation (the run folder's other files are the
    ones the page reads; the final page is written when the run ends)."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.failed = False

    def on_evaluate(self, state, step: int, results: dict) -> None:
        # the page is a view of files the run keeps (`flaxheads report` rebuilds it): a disk that
        # refuses it mid-run is said once and training goes on to its checkpoint, which reports the disk
        if self.failed:
            return
        try:
            write_report(self.run_dir, live=results)
        except OSError as e:
            self.failed = True
            logger.warning(
                f"could not write {self.run_dir / 'report.html'}: {e.strerror or e}; training goes on "
                "(`flaxheads report` writes it again)"
            )


def label_counts(data) -> dict[str, dict[str, int]] | None:
    """``{split: {label: rows}}`` of in-memory classification rows (None: ranking, regression, streamed)."""
    space, labels = data.space, data.labels
    if space is None or labels is None or space.problem_type == REGRESSION:
        return None
    names = space.names or [str(i) for i in range(space.num_labels)]
    out = {}
    for split, y in labels.items():
        y = np.asarray(y)
        counts = y.sum(0) if y.ndim == 2 else np.bincount(y.astype(np.int64), minlength=len(names))
        out[split] = {str(names[i]): int(c) for i, c in enumerate(counts)}
    return out


def _texts(job, split: str) -> list[str] | None:
    table = job.data.tables.get(split)
    texts = getattr(table, "texts", None)
    if texts is None:
        return None
    pairs = getattr(table, "pairs", None)
    return [t if pairs is None else f"{t} | {p}" for t, p in zip(texts, pairs if pairs is not None else texts)]


def worst_of(job, arrays: Mapping[str, dict | None]) -> dict | None:
    """:func:`worst_examples` of the validation split where its rows are in memory with their texts,
    else of the test split; ``arrays``: the trained model's predictions of each split."""
    val = job.splits.get("validation")
    split = "validation" if isinstance(val, Split) and _texts(job, "validation") is not None else "test"
    return worst_examples(job, split, arrays.get(split))


def worst_examples(job, split: str, arrays: dict | None, k: int = WORST) -> dict | None:
    """The ``k`` examples of ``split`` the trained model gets most wrong (by their loss), with their
    text: ``{"split", "note", "columns", "rows"}``; None for ranking (no logits), or a split without
    predictions or texts."""
    if arrays is None or "logits" not in arrays:
        return None
    texts = _texts(job, split)
    if texts is None or len(texts) != len(arrays["logits"]):
        return None
    logits, y = np.asarray(arrays["logits"], np.float64), np.asarray(arrays["labels"])
    names = (job.data.space.names if job.data.space is not None else None) or None
    name = lambda i: str(names[int(i)]) if names else str(int(i))
    pt = job.model.problem_type
    if pt == SINGLE_LABEL:
        z = logits - logits.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        loss = -logp[np.arange(len(y)), y.astype(np.int64)]
        order = np.argsort(-loss, kind="stable")[:k]
        rows = [
            {
                "row": int(i),
                "text": texts[i],
                "true": name(y[i]),
                "predicted": name(logits[i].argmax()),
                "p(true)": float(np.exp(-loss[i])),
                "loss": float(loss[i]),
            }
            for i in order
        ]
        cols = ["row", "text", "true", "predicted", "p(true)", "loss"]
    elif pt == MULTI_LABEL:
        p = 1 / (1 + np.exp(-logits))
        loss = -(y * np.log(np.clip(p, 1e-12, 1)) + (1 - y) * np.log(np.clip(1 - p, 1e-12, 1))).sum(1)
        thr = job.spec.task.threshold
        order = np.argsort(-loss, kind="stable")[:k]
        rows = [
            {
                "row": int(i),
                "text": texts[i],
                "true": ", ".join(name(j) for j in np.flatnonzero(y[i] >= 0.5)),
                "predicted": ", ".join(name(j) for j in np.flatnonzero(p[i] >= thr)),
                "loss": float(loss[i]),
            }
            for i in order
        ]
        cols = ["row", "text", "true", "predicted", "loss"]
    else:
        pred = logits[:, 0]
        err = np.abs(pred - np.asarray(y, np.float64).reshape(-1))
        order = np.argsort(-err, kind="stable")[:k]
        rows = [
            {
                "row": int(i),
                "text": texts[i],
                "true": float(np.asarray(y).reshape(-1)[i]),
                "predicted": float(pred[i]),
                "abs error": float(err[i]),
            }
            for i in order
        ]
        cols = ["row", "text", "true", "predicted", "abs error"]
    return {
        "split": split,
        "note": f"the {len(rows)} {split} examples with the largest loss (row: the {split} split's row)",
        "columns": cols,
        "rows": rows,
    }


def throughput_note(t: dict) -> str:
    """``"; 812 ex/s, 26,000 tok/s, 3.1 model TFLOP/s (MFU 41.0%)"`` of a run's throughput summary."""
    if not t:
        return ""
    out = f"; {t['examples_per_s']:.1f} ex/s, {t['tokens_per_s']:,.0f} tok/s"
    if "model_tflops_per_s" in t:
        out += f", {t['model_tflops_per_s']:.3g} model TFLOP/s"
    if "mfu" in t:
        out += f" (MFU {t['mfu']:.1%})"
    return out
