"""A :class:`~flaxheads.heads.heads.TokenLogits` head's kernel from a causal LM's folder.

The language-model head ``W [vocab, H]`` (``lm_head.weight``, or the token embeddings when
``tie_word_embeddings``) maps the last hidden state ``h`` to ``logits = W h``. The head keeps the
rows of its tokens: ``W[t]`` for each token, or, two-way, ``W[pos] - W[neg]``, so that
``sigmoid(h . (W[pos] - W[neg])) = softmax(logit[neg], logit[pos])[pos]`` (vLLM's ``from_2_way_softmax``).
Tokens are read as vocabulary entries of the folder's ``tokenizer.json`` (``convert_tokens_to_ids``),
else as text that encodes to exactly one token; ints are ids.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from flaxheads.backbones.families.decoder_config import HF_CLASSES as DECODER_HF_CLASSES
from flaxheads.errors import FlaxheadsError
from flaxheads.heads.heads import TokenLogits
from flaxheads.heads.templates import get_template

LM_HEAD = "lm_head.weight"
#: the template ``flaxheads train --head token-logits`` writes pairs in (its answer tokens are the head's)
RERANKER_TEMPLATE = "qwen3-reranker"


class TokenLogitsError(FlaxheadsError):
    """A TokenLogits head that cannot be made from this folder: no LM head, a token that is not one token."""


def token_ids(folder: str, tokens: Sequence[str | int], vocab_size: int) -> list[int]:
    """The vocabulary ids of ``tokens`` in ``folder``'s tokenizer (ints are taken as ids)."""
    tok = None
    if any(isinstance(t, str) for t in tokens):
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenLogitsError(
                f"{folder}: no tokenizer.json to find the ids of the tokens {list(tokens)}; "
                "copy the model's tokenizer files there, or pass token ids (tokens=(id_no, id_yes))"
            )
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
    ids = []
    for t in tokens:
        if isinstance(t, str):
            assert tok is not None
            i = tok.token_to_id(t)
            if i is None:
                pieces = tok.encode(t, add_special_tokens=False)
                if len(pieces.ids) != 1:
                    raise TokenLogitsError(
                        f"{folder}: {t!r} is not one token in this tokenizer: it is not a vocabulary entry and "
                        f"encodes to {len(pieces.ids)} tokens {pieces.tokens}; pass a vocabulary entry (e.g. "
                        f"{pieces.tokens[0]!r} if that is the answer) or its id"
                    )
                i = pieces.ids[0]
                unk = getattr(tok.model, "unk_token", None)
                if unk is not None and pieces.tokens[0] == unk:
                    raise TokenLogitsError(
                        f"{folder}: {t!r} is not in this tokenizer's vocabulary (it reads as the "
                        f"unknown token {unk!r}); pass a vocabulary entry or its id"
                    )
        else:
            i = int(t)
        if not 0 <= i < vocab_size:
            raise TokenLogitsError(f"{folder}: token {t!r} has id {i}, outside the LM head's {vocab_size} rows")
        ids.append(i)
    return ids


def lm_head(hf_config, state: Mapping[str, np.ndarray], embedding, source: str) -> np.ndarray:
    """The LM head ``[vocab, H]`` of a causal LM: ``lm_head.weight``, or the tied ``embedding``."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in DECODER_HF_CLASSES:
        raise TokenLogitsError(
            f"{source}: a TokenLogits head reads a causal LM's language-model head, and "
            f"{model_type!r} is not a decoder LM flaxheads runs ({sorted(DECODER_HF_CLASSES)}); "
            "use a linear head (head='linear') on this backbone"
        )
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise TokenLogitsError(
            f"{source}: this {model_type} is a bidirectional encoder (use_bidirectional_attention), "
            "not a causal LM with next-token logits; use a linear head"
        )
    if getattr(hf_config, "final_logit_softcapping", None):
        raise TokenLogitsError(
            f"{source}: this {model_type} caps its logits (final_logit_softcapping), so a token's "
            "logit is not linear in the last hidden state and no linear head equals it"
        )
    if LM_HEAD in state:
        return np.asarray(state[LM_HEAD])
    if "score.weight" in state:
        raise TokenLogitsError(
            f"{source}: this folder is a sequence classifier (score.weight), not a causal LM: it "
            "has no language-model head; load it without head=TokenLogits(...)"
        )
    if getattr(hf_config, "tie_word_embeddings", False) and embedding is not None:
        return np.asarray(embedding)
    raise TokenLogitsError(
        f"{source}: no language-model head: the weights have no {LM_HEAD} and the config does not "
        "tie it to the embeddings (tie_word_embeddings). Point at the XForCausalLM folder "
        "(the base model saved with AutoModel has no LM head)"
    )


def kernel(head: TokenLogits, hf_config, state: Mapping[str, np.ndarray], embedding, folder: str) -> np.ndarray:
    """The head's ``classifier`` kernel ``[H, num_labels]`` (float32) from the folder's LM head."""
    w = lm_head(hf_config, state, embedding, folder)
    ids = token_ids(folder, head.tokens, w.shape[0])
    rows = w[np.asarray(ids)].astype(np.float32)
    if head.two_way:
        rows = rows[1:2] - rows[0:1]
    return rows.T.copy()


def describe(head: TokenLogits) -> str:
    """What a load report calls the kernel's source."""
    if head.two_way:
        return f"lm_head[{head.tokens[1]!r}] - lm_head[{head.tokens[0]!r}]"
    return "lm_head[" + ", ".join(map(repr, head.tokens)) + "]"


def reranker_head(template: str = RERANKER_TEMPLATE) -> TokenLogits:
    """The TokenLogits head of an LLM reranker trained on ``template``'s prompts: its answer tokens, two-way
    (``flaxheads train --head token-logits``: the Qwen3-Reranker form)."""
    t = get_template(template)
    return TokenLogits(tokens=t.tokens or ("no", "yes"), template=t.name)
