"""A word-level fast tokenizer with a chat template, for the tests of chat-template rendering and scoring."""

from __future__ import annotations


def word_tokenizer(words: list[str], chat_template: str, **special_tokens):
    """A transformers fast tokenizer of ``words`` (ids in order, whitespace split, ``<unk>`` for the rest)
    with ``chat_template`` and ``special_tokens`` (``bos_token="<s>"``...); no token types, as Qwen's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", model_input_names=["input_ids", "attention_mask"], **special_tokens
    )
    fast.chat_template = chat_template
    return fast
