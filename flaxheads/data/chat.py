"""How a model reads a text pair when it is not the tokenizer's own pair encoding.

Chat-template pairs: a (prompt, response) rendered with a tokenizer's ``chat_template``, as reward models
(Skywork-Reward-V2 and the like) read their inputs.

The text equals what transformers' ``tokenizer.apply_chat_template(messages, tokenize=False)`` gives: the
same Jinja settings (a sandboxed environment, ``trim_blocks`` and ``lstrip_blocks``, loop controls, a
``tojson`` that keeps non-ASCII text, ``raise_exception``, ``strftime_now``, the ``{% generation %}``
tag), and the tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as variables. The
template is read from the folder's ``chat_template.jinja`` or its ``tokenizer_config.json``. Tokenise the
result without adding special tokens: the template writes them.

Prompt-template pairs: an LLM reranker's (a :class:`~flaxheads.heads.heads.TokenLogits` head's) (query,
document) written in its prompt template (:mod:`flaxheads.heads.templates`) as one text,
:func:`prompt_pairs`; training (:func:`pair_tokenizer`), prediction and serving all write them there, so a
reranker trains on the text it is later asked about.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from flaxheads.errors import FlaxheadsError
from flaxheads.heads.templates import PairTemplate, fit_pairs, render_pairs

#: the special tokens transformers passes to a chat template (its ``special_tokens_map``)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(FlaxheadsError):
    """No chat template where one is needed, or one that cannot render these messages."""


def _token_text(v) -> str | None:
    if isinstance(v, Mapping):  # an AddedToken as tokenizer_config.json stores it
        v = v.get("content")
    return None if v is None else str(v)


def read_chat_template(folder: str | os.PathLike) -> tuple[str | None, dict[str, str]]:
    """``(template, special tokens)`` of a tokenizer folder: the template is None when it has none."""
    folder = os.fspath(folder)
    config: dict[str, Any] = {}
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
    return template, special


def has_chat_template(folder: str | os.PathLike) -> bool:
    """Whether the folder's tokenizer has a chat template."""
    return read_chat_template(folder)[0] is not None


@lru_cache(maxsize=16)
def _compiled(template: str):
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("rendering a chat template needs jinja2: pip install 'jinja2>=3.1.6'") from None

    class Generation(jinja2.ext.Extension):  # {% generation %} ... {% endgeneration %}: the body, as rendered
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    template: str,
    special_tokens: Mapping[str, str] | None = None,
    *,
    add_generation_prompt: bool = False,
) -> str:
    """``messages`` (``{"role": ..., "content": ...}`` dicts) rendered with the Jinja ``template``."""
    import jinja2

    try:
        return _compiled(template).render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **dict(special_tokens or {}),
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from None


def chat_pairs(
    folder: str | os.PathLike,
    pairs: Iterable[tuple[str, str]],
    *,
    system: str | None = None,
    chat: tuple[str | None, Mapping[str, str]] | None = None,
) -> list[str]:
    """Each ``(prompt, response)`` as the conversation ``[system?, user: prompt, assistant: response]`` written
    with the chat template of the tokenizer in ``folder``: a reward model's input texts. ``chat``: the folder's
    :func:`read_chat_template`, when the caller has read it already."""
    template, special = read_chat_template(folder) if chat is None else chat
    if template is None:
        raise ChatTemplateError(
            f"{os.fspath(folder)}: the tokenizer has no chat_template (tokenizer_config.json or "
            "chat_template.jinja); pass the texts already formatted, or turn chat templates off"
        )
    head = [{"role": "system", "content": system}] if system is not None else []
    return [
        render_chat(head + [{"role": "user", "content": p}, {"role": "assistant", "content": r}], template, special)
        for p, r in pairs
    ]


# ---- an LLM reranker's prompt template -------------------------------------------------------------------
def prompt_pairs(
    tokenizer,
    template: str | PairTemplate,
    queries: Sequence[str],
    documents: Sequence[str],
    max_length: int,
    *,
    truncate: bool = True,
) -> tuple[list[str], list[int]]:
    """Each (query, document) written in ``template`` as one text, and the indices of the pairs whose document
    was cut: with ``truncate``, a document too long for ``max_length`` tokens (``tokenizer`` called as
    transformers' are) is cut at its end, so the prompt keeps its end, where the answer token is read."""
    pairs = list(zip(queries, documents))
    if not truncate:
        return render_pairs(template, pairs), []

    def count(texts: list[str]) -> list[int]:
        out = tokenizer(texts, None, truncation=True, max_length=max_length + 1, padding=False)
        return [len(x) for x in out["input_ids"]]

    return fit_pairs(template, pairs, count, max_length)


class PromptPairTokenizer:
    """``tokenizer`` (called as transformers' are) that writes each text pair in an LLM reranker's prompt
    ``template`` (:func:`prompt_pairs`) and tokenises it as one text; single texts and every other attribute
    are the tokenizer's own. What a run tokenises a token-logit reranker's (query, document) tables with."""

    def __init__(self, tokenizer, template: str | PairTemplate):
        self.tokenizer, self.template = tokenizer, template

    def __call__(self, texts, pairs=None, *, max_length: int | None = None, **options):
        if pairs is not None:
            if max_length is None:
                texts = render_pairs(self.template, zip(texts, pairs))
            else:
                texts, cut = prompt_pairs(self.tokenizer, self.template, texts, pairs, max_length)
                if cut:
                    warnings.warn(
                        f"{len(cut)} of {len(texts)} documents were cut at their end to fit the reranker's "
                        f"prompt in {max_length} tokens",
                        stacklevel=2,
                    )
            pairs = None
        return self.tokenizer(texts, pairs, max_length=max_length, **options)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def pair_tokenizer(tokenizer, model):
    """``tokenizer`` as ``model`` reads text pairs: in its head's prompt template (a TokenLogits head that has
    one: :class:`PromptPairTokenizer`), else the tokenizer itself."""
    template = getattr(model.head.head, "template", None)
    return tokenizer if template is None else PromptPairTokenizer(tokenizer, template)
