"""Shared fixtures for the training tests: a tiny random BERT folder with a fast tokenizer,
and synthetic tokenised splits."""

from __future__ import annotations

import os

import numpy as np

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega red green blue cyan magenta yellow black white stock market bank share "
    "profit goal match team player score film music actor award song vote party minister election "
    "phone computer software internet game"
).split()


#: ``tiny_model("bert", **TINY_BERT)`` (conftest.py) is :func:`tiny_bert_folder`'s default model: seed 0, no
#: dropout, a word-level tokenizer. conftest's ``tiny_bert`` is its folder, shared by the run, checkpoint
#: and export tests.
TINY_BERT = dict(seed=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tokenizer=True)


def tiny_bert_folder(path, num_labels: int = 3, dropout: float = 0.0, seed: int = 0, layers: int = 1) -> str:
    """Random tiny BERT (hf_tiny sizes, one layer unless told) + a word-level fast tokenizer, saved as an
    HF folder. One layer: the tests of runs, checkpoints and exports need no second, and each layer
    adds about as much to every train step's compile as the rest of the model. (The default one is
    conftest's session fixture ``tiny_bert``: ask ``tiny_model`` for a variant other files share.)"""
    from hf_tiny import tiny_torch_model

    path = os.fspath(path)
    model = tiny_torch_model(
        "bert",
        num_labels=num_labels,
        seed=seed,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        layers=layers,
    )
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path)
    return path


def save_word_tokenizer(path) -> None:
    """A BERT word-level fast tokenizer of hf_tiny's vocabulary size (:data:`WORDS`, then ``w<i>``) into
    the folder ``path``, texts up to 64 tokens."""
    from hf_tiny import V
    from transformers import BertTokenizerFast

    path = os.fspath(path)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(WORDS)
    vocab += [f"w{i}" for i in range(V - len(vocab))]
    assert len(vocab) == V
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "vocab.txt"), "w") as f:
        f.write("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(os.path.join(path, "vocab.txt"), do_lower_case=True)
    tok.model_max_length = 64
    tok.save_pretrained(path)


def random_split(n: int, num_labels: int = 3, lengths=(5, 20), seed: int = 0, vocab: int = 99, name="train"):
    """A tokenised Split of random token ids with [CLS] ... [SEP] and random labels."""
    from flaxheads.data.splits import Split

    rng = np.random.default_rng(seed)
    ids = []
    for _ in range(n):
        k = int(rng.integers(lengths[0], lengths[1] + 1))
        ids.append(np.concatenate([[2], rng.integers(5, vocab, size=k - 2), [3]]).astype(np.int32))
    return Split(name, ids, rng.integers(0, num_labels, size=n).astype(np.int32))


def event_scalars(folder) -> set[tuple[str, int, float]]:
    """Every (tag, step, value) TensorBoard's own reader finds in a folder's event files (after its
    purge of the steps a resumed run logs again)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {(tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
