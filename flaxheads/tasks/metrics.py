"""Evaluation metrics computed from *all* predictions of an eval pass (numpy, not per batch).

Averaging per-batch accuracies or F1s is wrong whenever batches differ in size or class mix;
these functions take the concatenated predictions of every example exactly once.
"""

from __future__ import annotations

import numpy as np

from flaxheads.losses import MULTI_LABEL, REGRESSION, SINGLE_LABEL


def confusion_matrix(y_true, y_pred, num_labels: int) -> np.ndarray:
    """``cm[i, j]`` = number of examples of true class i predicted as j."""
    cm = np.zeros((num_labels, num_labels), np.int64)
    np.add.at(cm, (np.asarray(y_true, np.int64), np.asarray(y_pred, np.int64)), 1)
    return cm


def _safe_div(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.divide(a, b, out=np.zeros_like(a), where=b != 0)


def per_class_prf(cm: np.ndarray) -> dict[str, np.ndarray]:
    """Per-class precision, recall, F1 and support from a confusion matrix (0 where undefined,
    scikit-learn's ``zero_division=0``)."""
    tp = np.diag(cm).astype(np.float64)
    pred, true = cm.sum(0), cm.sum(1)
    p, r = _safe_div(tp, pred), _safe_div(tp, true)
    f = _safe_div(2 * p * r, p + r)
    return {"precision": p, "recall": r, "f1": f, "support": true}


def matthews_corrcoef(cm: np.ndarray) -> float:
    """Multi-class MCC (Gorodkin's R_K, as scikit-learn), from a confusion matrix."""
    cm = cm.astype(np.float64)
    t, p = cm.sum(1), cm.sum(0)
    c, s = np.trace(cm), cm.sum()
    num = c * s - t @ p
    den = np.sqrt(s * s - p @ p) * np.sqrt(s * s - t @ t)
    return float(num / den) if den else 0.0


def single_label_metrics(logits, labels, num_labels: int) -> dict:
    """accuracy, macro-F1, MCC and the per-class table. Macro-F1 averages the classes that occur in
    the split or in its predictions (as scikit-learn's ``f1_score(average="macro")``): a class with
    neither scores no 0 into the mean; ``absent`` lists the classes with no example in the split."""
    y = np.asarray(labels, np.int64)
    pred = np.asarray(logits).argmax(-1)
    cm = confusion_matrix(y, pred, num_labels)
    prf = per_class_prf(cm)
    seen = (cm.sum(0) + cm.sum(1)) > 0
    return {
        "accuracy": float((pred == y).mean()) if y.size else 0.0,
        "macro_f1": float(prf["f1"][seen].mean()) if seen.any() else 0.0,
        "mcc": matthews_corrcoef(cm),
        "per_class": {k: v.tolist() for k, v in prf.items()},
        "confusion_matrix": cm.tolist(),
        "absent": np.flatnonzero(cm.sum(1) == 0).tolist(),
    }


def _f1(tp, fp, fn):
    return _safe_div(2 * tp, 2 * tp + fp + fn)


def multi_label_metrics(logits, labels, threshold: float = 0.5) -> dict:
    """Micro/macro-F1 and per-label F1 with probability ``sigmoid(logit) >= threshold``."""
    y = np.asarray(labels) >= 0.5
    prob = 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))
    pred = prob >= threshold
    tp, fp, fn = (pred & y).sum(0), (pred & ~y).sum(0), (~pred & y).sum(0)
    per = _f1(tp, fp, fn)
    return {
        "micro_f1": float(_f1(tp.sum(), fp.sum(), fn.sum())),
        "macro_f1": float(per.mean()),
        "per_label_f1": per.tolist(),
        "subset_accuracy": float((pred == y).all(1).mean()) if y.size else 0.0,
        "threshold": threshold,
    }


def _rank(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank), like ``scipy.stats.rankdata``."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(len(x), np.float64)
    start = 0
    for i in range(1, len(x) + 1):
        if i == len(x) or xs[i] != xs[start]:
            ranks[order[start:i]] = (start + i - 1) / 2.0 + 1
            start = i
    return ranks


def _pearson(a, b) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den else 0.0


def regression_metrics(preds, labels) -> dict:
    """MSE, Pearson and Spearman (over all outputs flattened; per-output for several targets)."""
    p = np.asarray(preds, np.float64).reshape(len(preds), -1)
    y = np.asarray(labels, np.float64).reshape(len(labels), -1)
    out = {"mse": float(np.mean((p - y) ** 2))}
    pear = [_pearson(p[:, j], y[:, j]) for j in range(p.shape[1])]
    spear = [_pearson(_rank(p[:, j]), _rank(y[:, j])) for j in range(p.shape[1])]
    out["pearson"], out["spearman"] = float(np.mean(pear)), float(np.mean(spear))
    return out


def compute_metrics(problem_type: str, logits, labels, num_labels: int, *, threshold: float = 0.5) -> dict:
    """The metrics for a problem type from all eval logits [N, K] and labels."""
    if problem_type == SINGLE_LABEL:
        return single_label_metrics(logits, labels, num_labels)
    if problem_type == MULTI_LABEL:
        return multi_label_metrics(logits, labels, threshold)
    if problem_type == REGRESSION:
        return regression_metrics(logits, labels)
    raise ValueError(f"unknown problem_type {problem_type!r}")


def headline(problem_type: str) -> str:
    """The metric that names a run's score (higher is better)."""
    return {SINGLE_LABEL: "accuracy", MULTI_LABEL: "micro_f1", REGRESSION: "spearman"}[problem_type]


def format_table(metrics: dict, id2label: dict[int, str] | None = None) -> str:
    """A plain-text per-class precision/recall/F1 table (single-label) or per-label F1 (multi-label)."""
    lines = []
    if "per_class" in metrics:
        pc = metrics["per_class"]
        n = len(pc["f1"])
        names = [str((id2label or {}).get(i, i)) for i in range(n)]
        w = max([len(s) for s in names] + [9])
        lines.append(f"{'class':<{w}}  precision  recall     f1  support")
        for i, name in enumerate(names):
            lines.append(
                f"{name:<{w}}  {pc['precision'][i]:9.4f}  {pc['recall'][i]:6.4f}  {pc['f1'][i]:5.4f}  "
                f"{int(pc['support'][i]):7d}"
            )
        lines.append(
            f"{'accuracy':<{w}}  {metrics['accuracy']:.4f}   macro-F1 {metrics['macro_f1']:.4f}   "
            f"MCC {metrics['mcc']:.4f}   n={int(sum(pc['support']))}"
        )
        if metrics.get("absent"):
            lines.append(
                "no examples of "
                + ", ".join(names[i] for i in metrics["absent"])
                + " in this split (left out of macro-F1 unless predicted)"
            )
    elif "per_label_f1" in metrics:
        f1 = metrics["per_label_f1"]
        names = [str((id2label or {}).get(i, i)) for i in range(len(f1))]
        w = max([len(s) for s in names] + [5])
        lines.append(f"{'label':<{w}}  f1")
        lines += [f"{nm:<{w}}  {v:.4f}" for nm, v in zip(names, f1)]
        lines.append(
            f"micro-F1 {metrics['micro_f1']:.4f}  macro-F1 {metrics['macro_f1']:.4f}  "
            f"(threshold {metrics['threshold']})"
        )
    else:
        lines.append("  ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float)))
    return "\n".join(lines)
