"""Fixtures of the CLI tests (pytest finds them here: the test modules do not import them)."""

from __future__ import annotations

import pytest
from train_helpers import tiny_bert_folder


@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory) -> str:
    """A tiny random BERT (64 positions) with a word-level fast tokenizer."""
    return tiny_bert_folder(tmp_path_factory.mktemp("cli_bert"), num_labels=2)
