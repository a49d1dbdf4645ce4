"""The run folder's pictures: the training curve and the confusion matrix. Drawn on
``matplotlib.figure.Figure`` objects, not pyplot: saving needs no display and changes no global
matplotlib state (backend, open figures) of the process that calls them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure


def plot_curve(path: Path, history: list[dict], metric: str) -> None:
    """Training loss (mean since the last log line) and the validation ``metric`` against steps."""
    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval" in h and "validation" in h["eval"]]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    ax.plot(
        [h["step"] for h in train],
        [h["loss"] for h in train],
        label="train loss (mean since last log)",
        color="tab:blue",
    )
    ax.set_xlabel("step"), ax.set_ylabel("loss")
    if evals:
        ax2 = ax.twinx()
        ax2.plot(
            [h["step"] for h in evals],
            [h["eval"]["validation"][metric] for h in evals],
            "o-",
            color="tab:orange",
            label=f"validation {metric}",
        )
        ax2.set_ylabel(f"validation {metric}")
    fig.legend(loc="center right", bbox_to_anchor=(0.85, 0.6))
    ax.set_title("training curve")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_confusion_matrix(path: Path, matrix, id2label: dict | None, split: str) -> None:
    """Counts of true (rows) against predicted (columns) classes, labelled with the class names."""
    cm = np.asarray(matrix)
    names = [str((id2label or {}).get(i, i)) for i in range(len(cm))]
    fig = Figure(figsize=(1.2 + 0.7 * len(cm), 1 + 0.6 * len(cm)))
    ax = fig.subplots()
    ax.imshow(cm, cmap="Blues")
    ax.set_xticks(range(len(cm)), names, rotation=45, ha="right"), ax.set_yticks(range(len(cm)), names)
    for i in range(len(cm)):
        for j in range(len(cm)):
            ax.text(
                j,
                i,
                str(int(cm[i, j])),
                ha="center",
                va="center",
                color="white" if cm[i, j] > cm.max() / 2 else "black",
            )
    ax.set_xlabel("predicted"), ax.set_ylabel("true"), ax.set_title(f"confusion matrix ({split})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
