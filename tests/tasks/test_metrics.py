"""Metrics from all predictions, checked against scikit-learn and scipy."""

import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from flaxheads.tasks.metrics import compute_metrics, format_table, multi_label_metrics, regression_metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_label_against_sklearn(seed):
    rng = np.random.default_rng(seed)
    k = 5
    y = rng.integers(0, k, 200)
    logits = rng.normal(size=(200, k)) + 1.5 * np.eye(k)[y] * (rng.random(200) < 0.6)[:, None]
    if seed == 2:
        logits[:, 4] = -10  # class 4 never predicted: zero-division conventions
    pred = logits.argmax(-1)
    m = compute_metrics("single_label_classification", logits, y, k)
    assert m["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert m["macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro", zero_division=0))
    assert m["mcc"] == pytest.approx(skm.matthews_corrcoef(y, pred))
    p, r, f, s = skm.precision_recall_fscore_support(y, pred, labels=range(k), zero_division=0)
    np.testing.assert_allclose(m["per_class"]["precision"], p)
    np.testing.assert_allclose(m["per_class"]["recall"], r)
    np.testing.assert_allclose(m["per_class"]["f1"], f)
    np.testing.assert_array_equal(m["per_class"]["support"], s)
    np.testing.assert_array_equal(m["confusion_matrix"], skm.confusion_matrix(y, pred, labels=range(k)))
    table = format_table(m, {i: f"class{i}" for i in range(k)})
    assert "class3" in table and f"{m['accuracy']:.4f}" in table


def test_multi_label_against_sklearn():
    rng = np.random.default_rng(3)
    y = (rng.random((150, 6)) < 0.3).astype(np.float32)
    logits = rng.normal(size=(150, 6)) + 2 * (y - 0.5)
    for thr in (0.5, 0.3):
        m = multi_label_metrics(logits, y, threshold=thr)
        pred = (1 / (1 + np.exp(-logits)) >= thr).astype(int)
        assert m["micro_f1"] == pytest.approx(skm.f1_score(y, pred, average="micro", zero_division=0))
        assert m["macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro", zero_division=0))
        np.testing.assert_allclose(m["per_label_f1"], skm.f1_score(y, pred, average=None, zero_division=0))
        assert m["subset_accuracy"] == pytest.approx(skm.accuracy_score(y, pred))


def test_regression_against_scipy():
    rng = np.random.default_rng(4)
    y = rng.normal(size=100)
    p = y + rng.normal(scale=0.5, size=100)
    p[:10] = np.round(p[:10])  # ties for Spearman
    y[5:15] = 1.0
    m = regression_metrics(p[:, None], y)
    assert m["mse"] == pytest.approx(skm.mean_squared_error(y, p))
    assert m["pearson"] == pytest.approx(stats.pearsonr(p, y)[0])
    assert m["spearman"] == pytest.approx(stats.spearmanr(p, y)[0])


def test_metrics_use_all_predictions_not_batch_means():
    """Two batches of different sizes: the batch-mean accuracy differs, ours is the global one."""
    y = np.array([0, 1, 1, 0, 0, 1, 1, 1, 1, 1])
    pred = np.array([0, 1, 1, 0, 0, 1, 0, 0, 0, 0])
    logits = np.eye(2)[pred]
    m = compute_metrics("single_label_classification", logits, y, 2)
    assert m["accuracy"] == pytest.approx(0.6)
    assert np.mean([np.mean(pred[:2] == y[:2]), np.mean(pred[2:] == y[2:])]) != pytest.approx(0.6)


def test_classes_absent_from_a_split_do_not_drag_macro_f1_down():
    """Two of six classes in the split, every prediction right: macro-F1 1.0 as scikit-learn has it
    (averaging the six gave 0.33), and the table names the absent classes."""
    import sklearn.metrics as skm

    from flaxheads.tasks.metrics import format_table, single_label_metrics

    y = np.array([1, 1, 3, 3, 3])
    m = single_label_metrics(np.eye(6)[y], y, 6)
    assert m["accuracy"] == 1.0 and m["macro_f1"] == 1.0 == skm.f1_score(y, y, average="macro")
    assert m["absent"] == [0, 2, 4, 5]
    assert "no examples of c0, c2, c4, c5 in this split" in format_table(m, {i: f"c{i}" for i in range(6)})
    pred = np.array([1, 2, 3, 3, 1])  # a wrong guess of an absent class counts, as in scikit-learn
    m = single_label_metrics(np.eye(6)[pred], y, 6)
    assert m["macro_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro", zero_division=0))
