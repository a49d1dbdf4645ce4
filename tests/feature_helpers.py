"""Shared fixtures for the cached-feature, sweep and multitask tests: a tiny random BERT and a
small variable-length dataset whose labels a linear probe can learn."""

from __future__ import annotations

import types

import numpy as np

from tests.hf_tiny import V, tiny_torch_model


def tiny_bert_dir(tmp_path_factory, num_labels: int = 3) -> str:
    d = tmp_path_factory.mktemp("tinybert")
    tiny_torch_model("bert", num_labels=num_labels, seed=3).save_pretrained(d, safe_serialization=True)
    return str(d)


def toy_split(n: int = 40, num_labels: int = 3, seed: int = 0, max_len: int = 14):
    """Texts of 2..max_len tokens starting with [CLS]=2; the label is which third of the vocabulary
    most tokens come from (learnable from mean-pooled features)."""
    rng = np.random.default_rng(seed)
    ids, labels = [], []
    for _ in range(n):
        y = int(rng.integers(num_labels))
        k = int(rng.integers(2, max_len + 1))
        lo = 3 + y * (V - 3) // num_labels
        hi = 3 + (y + 1) * (V - 3) // num_labels
        row = rng.integers(lo, hi, size=k)
        row[0] = 2
        ids.append(row.astype(np.int32))
        labels.append(y)
    return types.SimpleNamespace(input_ids=ids, labels=np.asarray(labels, np.int32), token_type_ids=None)


def padded(split, rows, t):
    ids = np.zeros((len(rows), t), np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for r, i in enumerate(rows):
        x = split.input_ids[i][:t]
        ids[r, : len(x)], mask[r, : len(x)] = x, 1
    return ids, mask
