"""Prompt templates of LLM rerankers: how a (query, document) pair becomes the one text a
:class:`~flaxheads.heads.heads.TokenLogits` head scores at its last token.

A template is plain text with ``{instruction}``, ``{query}`` and ``{document}`` fields; only those
three are filled (a brace elsewhere in it, or in the texts, is kept as it is). ``qwen3-reranker`` is
the Qwen3-Reranker model card's prompt: a system turn asking for "yes" or "no", the pair as
``<Instruct>`` / ``<Query>`` / ``<Document>`` lines in the user turn, and the assistant turn opened
with an empty think block, so the next token is the answer. ``mxbai-rerank-v2`` is mixedbread's
mxbai-rerank-v2 prompt (its ``mxbai_rerank`` package): Qwen's default system turn, then ``query: ...`` and
``document: ...`` lines and the relevance question in the user turn, answered "1" or "0". That code tokenises
the parts apart and joins the ids; written as one text they tokenise the same except where a part's end
merges with the newline after it (a document ending in punctuation, under Qwen's pre-tokenizer). Its
optional ``instruction:`` line is not written (the template has no instruction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from flaxheads.errors import ConfigError

FIELDS = ("instruction", "query", "document")


@dataclasses.dataclass(frozen=True)
class PairTemplate:
    """``text`` with ``{instruction}``, ``{query}``, ``{document}``; ``instruction``: its default."""

    name: str
    text: str
    instruction: str = ""
    tokens: tuple[str, str] | None = None  # the (negative, positive) answer tokens the model was trained on

    def render(self, query: str, document: str, instruction: str | None = None) -> str:
        """The text of one pair (``instruction`` None: the template's default)."""
        values = {
            "instruction": self.instruction if instruction is None else instruction,
            "query": query,
            "document": document,
        }
        out, rest = [], self.text
        while rest:  # one pass over the template, so a field's value is never read as a field
            at = [(rest.find("{" + f + "}"), f) for f in FIELDS if "{" + f + "}" in rest]
            if not at:
                out.append(rest)
                break
            i, f = min(at)
            out += [rest[:i], values[f]]
            rest = rest[i + len(f) + 2 :]
        return "".join(out)


_QWEN3_SYSTEM = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
)

_MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search queries. For each "
    "query-document pair, carefully analyze the semantic relationship between them, then provide your binary "
    "relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"
)

TEMPLATES: dict[str, PairTemplate] = {
    "qwen3-reranker": PairTemplate(
        "qwen3-reranker",
        _QWEN3_SYSTEM + "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        instruction="Given a web search query, retrieve relevant passages that answer the query",
        tokens=("no", "yes"),
    ),
    "mxbai-rerank-v2": PairTemplate(
        "mxbai-rerank-v2",
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nquery: {query}\ndocument: {document}\n"
        + _MXBAI_TASK
        + "<|im_end|>\n<|im_start|>assistant\n",
        tokens=("0", "1"),
    ),
}


def get_template(name: str | PairTemplate) -> PairTemplate:
    """The template called ``name`` (or ``name`` itself when it is one)."""
    if isinstance(name, PairTemplate):
        return name
    if name not in TEMPLATES:
        raise ConfigError(
            f"unknown prompt template {name!r}; templates: {sorted(TEMPLATES)} (or pass a "
            "flaxheads.heads.templates.PairTemplate)"
        )
    return TEMPLATES[name]


def render_pairs(
    template: str | PairTemplate, pairs: Iterable[tuple[str, str]], instruction: str | None = None
) -> list[str]:
    """Each ``(query, document)`` of ``pairs`` written in ``template``: the texts to tokenise as single
    sequences (no pair encoding, no special tokens added by the tokenizer)."""
    t = get_template(template)
    return [t.render(q, d, instruction) for q, d in pairs]


def fit_pairs(
    template: str | PairTemplate,
    pairs: Iterable[tuple[str, str]],
    count: Callable[[list[str]], list[int]],
    max_length: int,
    instruction: str | None = None,
) -> tuple[list[str], list[int]]:
    """:func:`render_pairs`, each document cut at its end until the prompt is at most ``max_length`` tokens
    (``count``: the token counts of texts; at least ``max_length + 1`` for a longer one), so the prompt keeps
    its end, where the answer token is read (plain truncation would cut that). Returns the texts and the
    indices of the pairs whose documents were cut; a prompt too long even with an empty document is left
    whole (the caller's truncation then applies)."""
    t = get_template(template)
    pairs = list(pairs)
    texts = [t.render(q, d, instruction) for q, d in pairs]
    cut = []
    for i, n in enumerate(count(texts)):
        if n <= max_length:
            continue
        q, d = pairs[i]
        if count([t.render(q, "", instruction)])[0] > max_length:
            continue
        lo, hi = 0, len(d)  # the longest document prefix that fits: lo fits, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if count([t.render(q, d[:mid], instruction)])[0] <= max_length:
                lo = mid
            else:
                hi = mid
        texts[i] = t.render(q, d[:lo], instruction)
        cut.append(i)
    return texts, cut
