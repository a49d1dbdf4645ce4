"""What the routes take: text-embeddings-inference's (TEI's) request bodies read field by field,
and its errors.

Errors are TEI's ``ErrorResponse``: ``{"error": "<field>: what was wrong; what to send",
"error_type": ...}`` with ``error_type`` one of TEI's ``ErrorType`` values as TEI writes them
(``"Validation"``, ``"Tokenizer"``, ``"Backend"``, ``"Overloaded"``, ``"Unhealthy"``). Statuses:
422 a malformed body (the field named), 413 too many texts or bytes or a text past the maximum
length without ``truncate``, 424 a route the model's kind cannot serve, 429 a full queue.

Inputs (``PredictInput`` of ``/predict``): a text, a pair ``[text, text]``, or a batch
``[[text], [text, text], ...]``; a list of one text is that text (as TEI reads them), and a flat
list of three or more texts, or of texts and pairs mixed, is a batch too (flaxheads reads those
where TEI refuses them). ``Input`` of the embedding routes: a text, a list of token ids, or a list
of either.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

#: TEI's ``ErrorType`` (docs/openapi.json, and the serialisation of its router): what went wrong.
VALIDATION, TOKENIZER, BACKEND, OVERLOADED, UNHEALTHY = "Validation", "Tokenizer", "Backend", "Overloaded", "Unhealthy"

#: One input: a text, a pair of texts, or token ids (int32, used as given).
Text = str | tuple[str, str] | np.ndarray


class PayloadError(Exception):
    """A request the server refuses: an HTTP ``status``, a message that says what to send, and
    TEI's ``error_type``."""

    def __init__(self, status: int, message: str, error_type: str = VALIDATION):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type

    def body(self) -> dict:
        """TEI's ``ErrorResponse``."""
        return {"error": self.message, "error_type": self.error_type}

    def openai_body(self) -> dict:
        """TEI's ``OpenAICompatErrorResponse`` (``/v1/embeddings``): ``message``, ``code`` and the
        error type, as ``type`` (what TEI's router writes and OpenAI's clients read) and as
        ``error_type`` (what TEI's published schema names)."""
        return {"message": self.message, "code": self.status, "type": self.error_type, "error_type": self.error_type}


def json_object(raw: bytes) -> dict:
    """The request body as a JSON object, else a 422."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PayloadError(
            422,
            f"body: not valid JSON ({e}); send a JSON object such as "
            '{"inputs": "some text"} with Content-Type: application/json',
        ) from None
    if not isinstance(body, dict):
        raise PayloadError(422, f'body: expected a JSON object, got {_kind(body)}; send {{"inputs": ...}}')
    return body


def text_value(value: Any, where: str) -> str:
    """``value`` if it is a non-empty text, else a 422 naming ``where``."""
    if not isinstance(value, str):
        raise PayloadError(422, f"{where}: expected a text (a JSON string), got {_kind(value)}")
    if not value.strip():
        raise PayloadError(422, f"{where}: the text is empty; every input needs a non-empty text")
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        "dict": "an object",
        "list": "an array",
        "str": "a string",
        "bool": "a boolean",
        "int": "a number",
        "float": "a number",
    }.get(type(value).__name__, type(value).__name__)


def _present(body: dict, name: str, example: str) -> Any:
    if name not in body or body[name] is None:
        raise PayloadError(422, f'{name}: missing; send {{"{name}": {example}}}')
    return body[name]


def _too_many(name: str, n: int, most: int | None) -> None:
    if most is not None and n > most:
        raise PayloadError(
            413,
            f"{name}: {n} inputs in one request, the most is {most} (the server's "
            "--max-client-batch-size); split it into several requests",
        )


def _empty(name: str) -> PayloadError:
    return PayloadError(422, f"{name}: the list is empty; send at least one input")


# ---- inputs ----------------------------------------------------------------------------------
def predict_inputs(body: dict, name: str = "inputs", *, max_texts: int | None = None) -> tuple[list[Text], bool]:
    """``body[name]`` as TEI's ``PredictInput``: a list of texts and ``(text, text)`` pairs, and
    whether it was one input (answered unwrapped)."""
    value = _present(body, name, '"a text"')
    if isinstance(value, str):
        return [text_value(value, name)], True
    if not isinstance(value, list):
        raise PayloadError(
            422,
            f"{name}: expected a text, a pair [text, text] or a batch [[text], [text, text], ...], got {_kind(value)}",
        )
    if not value:
        raise _empty(name)
    if len(value) <= 2 and all(isinstance(v, str) for v in value):
        texts = [text_value(v, f"{name}[{i}]") for i, v in enumerate(value)]
        return [texts[0] if len(texts) == 1 else (texts[0], texts[1])], True
    _too_many(name, len(value), max_texts)
    out: list[Text] = []
    for i, v in enumerate(value):
        if isinstance(v, list):
            if len(v) not in (1, 2):
                raise PayloadError(
                    422, f"{name}[{i}]: a batch item is [text] or a pair [text, text], got {len(v)} items"
                )
            texts = [text_value(t, f"{name}[{i}][{j}]") for j, t in enumerate(v)]
            out.append(texts[0] if len(texts) == 1 else (texts[0], texts[1]))
        else:
            out.append(text_value(v, f"{name}[{i}]"))
    return out, False


def _ids(value: list, where: str) -> np.ndarray:
    if not value:
        raise PayloadError(422, f"{where}: the list of token ids is empty; send at least one id")
    for j, x in enumerate(value):
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < 2**31:
            raise PayloadError(422, f"{where}[{j}]: expected a token id (a whole number from 0), got {json.dumps(x)}")
    return np.asarray(value, np.int32)


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    )


def embed_inputs(body: dict, name: str = "inputs", *, max_texts: int | None = None) -> tuple[list[Text], bool]:
    """``body[name]`` as TEI's ``Input``: texts and token-id arrays, and whether it was one input."""
    value = _present(body, name, '"a text"')
    if isinstance(value, str):
        return [text_value(value, name)], True
    if _is_ids(value):
        return [_ids(value, name)], True
    if not isinstance(value, list):
        raise PayloadError(422, f"{name}: expected a text, a list of token ids, or a list of those, got {_kind(value)}")
    if not value:
        raise _empty(name)
    _too_many(name, len(value), max_texts)
    out: list[Text] = []
    for i, v in enumerate(value):
        if isinstance(v, list):
            out.append(_ids(v, f"{name}[{i}]"))
        elif isinstance(v, str):
            out.append(text_value(v, f"{name}[{i}]"))
        else:
            raise PayloadError(422, f"{name}[{i}]: expected a text or a list of token ids, got {_kind(v)}")
    return out, False


def texts_field(body: dict, name: str, *, max_texts: int | None = None) -> list[str]:
    """``body[name]``: a non-empty list of texts (``/rerank``'s ``texts``)."""
    value = _present(body, name, '["a text", ...]')
    if not isinstance(value, list):
        raise PayloadError(422, f"{name}: expected a list of texts, got {_kind(value)}")
    if not value:
        raise _empty(name)
    _too_many(name, len(value), max_texts)
    return [text_value(v, f"{name}[{i}]") for i, v in enumerate(value)]


def tokenize_inputs(body: dict, *, max_texts: int | None = None) -> list[str]:
    """``/tokenize``'s ``inputs``: a text or a list of texts."""
    value = _present(body, "inputs", '"a text"')
    if isinstance(value, str):
        return [text_value(value, "inputs")]
    return texts_field(body, "inputs", max_texts=max_texts)


def ids_field(body: dict, *, max_texts: int | None = None) -> list[np.ndarray]:
    """``/decode``'s ``ids``: a list of token ids or a list of such lists."""
    value = _present(body, "ids", "[101, 7592, 102]")
    if _is_ids(value):
        return [_ids(value, "ids")]
    if not isinstance(value, list) or not all(isinstance(v, list) for v in value):
        raise PayloadError(
            422,
            "ids: expected a list of token ids or a list of such lists, got "
            f"{_kind(value) if not isinstance(value, list) else 'a list of other values'}",
        )
    if not value:
        raise _empty("ids")
    _too_many("ids", len(value), max_texts)
    return [_ids(v, f"ids[{i}]") for i, v in enumerate(value)]


def similarity_inputs(value: Any, *, max_texts: int | None = None) -> tuple[str, list[str]]:
    """``/similarity``'s ``inputs``: ``{"source_sentence": text, "sentences": [text, ...]}``."""
    if not isinstance(value, dict):
        raise PayloadError(
            422, f'inputs: expected {{"source_sentence": "a text", "sentences": ["a text", ...]}}, got {_kind(value)}'
        )
    source = text_value(value.get("source_sentence"), "inputs.source_sentence")
    sentences = value.get("sentences")
    if not isinstance(sentences, list):
        raise PayloadError(422, f"inputs.sentences: expected a list of texts, got {_kind(sentences)}")
    if not sentences:
        raise _empty("inputs.sentences")
    _too_many("inputs.sentences", len(sentences) + 1, max_texts)  # the source sentence counts, as in TEI
    return source, [text_value(v, f"inputs.sentences[{i}]") for i, v in enumerate(sentences)]


# ---- options ---------------------------------------------------------------------------------
def object_field(body: dict, name: str) -> dict:
    """``body[name]`` when it is an object (``{}`` when absent or null), else a 422."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PayloadError(422, f"{name}: expected an object, got {_kind(value)}")
    return value


def bool_field(body: dict, name: str, default: bool, where: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PayloadError(422, f"{where}{name}: expected true or false, got {json.dumps(value)}")
    return value


def truncation_side(body: dict, where: str = "") -> str:
    """TEI's ``truncation_direction`` (``"Right"``, the default, or ``"Left"``; either case) as
    ``"right"`` / ``"left"``: which end of a text ``truncate`` cuts."""
    value = body.get("truncation_direction")
    if value is None:
        return "right"
    if not isinstance(value, str) or value.lower() not in ("left", "right"):
        raise PayloadError(422, f'{where}truncation_direction: expected "Left" or "Right", got {json.dumps(value)}')
    return value.lower()


def prompt_name_field(body: dict, where: str = "") -> str | None:
    """``prompt_name`` as given (None: absent)."""
    name = body.get("prompt_name")
    if name is not None and not isinstance(name, str):
        raise PayloadError(422, f"{where}prompt_name: expected a prompt's name (a JSON string), got {_kind(name)}")
    return name


def prompt_text(name: str | None, prompts, where: str = "") -> str:
    """The text put before every input: the model's prompt ``name`` (else its default prompt, as
    sentence-transformers' ``encode`` does; else none). ``prompts``: a
    :class:`~flaxheads.interop.sentence_transformers.Prompts`."""
    if name is None:
        return prompts.prompts.get(prompts.default_prompt_name, "") if prompts.default_prompt_name else ""
    if name not in prompts.prompts:
        have = ", ".join(sorted(prompts.prompts)) or "none"
        raise PayloadError(
            422,
            f"{where}prompt_name: {json.dumps(name)} is not one of the model's prompts ({have}; "
            'config_sentence_transformers.json\'s "prompts")',
        )
    if not prompts.include_prompt:
        raise PayloadError(
            422,
            f"{where}prompt_name: this model's pooling leaves the prompt's tokens out "
            "(include_prompt: false), which this server does not compute; leave it out",
        )
    return prompts.prompts[name]


def prompt_field(body: dict, prompts, where: str = "") -> str:
    """:func:`prompt_text` of ``body["prompt_name"]``."""
    return prompt_text(prompt_name_field(body, where), prompts, where)


def dimensions_field(body: dict, width: int) -> int | None:
    """``dimensions``: how many leading values of each embedding to keep (Matryoshka), at most ``width``."""
    value = body.get("dimensions")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= width:
        raise PayloadError(
            422, f"dimensions: expected a whole number from 1 to the model's {width}, got {json.dumps(value)}"
        )
    return value


ENCODINGS = ("float", "base64")


def encoding_field(body: dict) -> str:
    """``encoding_format``: ``"float"`` (JSON numbers, the default) or ``"base64"``."""
    value = body.get("encoding_format")
    if value is None:
        return "float"
    if value not in ENCODINGS:
        raise PayloadError(422, f'encoding_format: expected "float" or "base64", got {json.dumps(value)}')
    return value


FUNCTIONS = ("softmax", "sigmoid", "none")


def classification_parameters(body: dict, num_labels: int) -> tuple[int | None, str | None]:
    """The Inference API's text-classification ``parameters``: ``top_k`` (a positive whole number;
    more than the labels gives them all) and ``function_to_apply`` (``softmax``, ``sigmoid`` or ``none``)."""
    params = object_field(body, "parameters")
    top_k, fn = params.get("top_k"), params.get("function_to_apply")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise PayloadError(
            422,
            f"parameters.top_k: expected a whole number from 1 (the model has {num_labels} "
            f"labels), got {json.dumps(top_k)}",
        )
    if fn is not None and (not isinstance(fn, str) or fn.lower() not in FUNCTIONS):
        raise PayloadError(
            422, f"parameters.function_to_apply: expected one of {', '.join(FUNCTIONS)}, got {json.dumps(fn)}"
        )
    return top_k, None if fn is None else fn.lower()
