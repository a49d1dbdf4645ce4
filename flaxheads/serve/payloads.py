"""Request and response bodies of text-embeddings-inference (TEI), the server whose API the
routes speak: what ``/predict``, ``/rerank`` and ``/embed`` take, the token ids they become, and
the JSON they answer.

Inputs follow TEI: ``"inputs"`` is one text, a pair ``[text, text]`` (a list of exactly two
texts is one pair, as TEI reads it), or a list of texts and pairs. Errors are
``{"error": ..., "error_type": ...}`` as TEI's: 422 for a malformed body (naming the field),
413 for too many texts, too many bytes or a text over the maximum length without ``truncate``.
"""
from __future__ import annotations

import base64
import json
from typing import Any, Sequence, Union

import numpy as np

from flaxheads.losses import MULTI_LABEL
from flaxheads.predict import Classifier, Predictions

Text = Union[str, tuple[str, str]]


class PayloadError(Exception):
    """A request the server refuses: an HTTP ``status`` and a message that says what to send."""

    def __init__(self, status: int, message: str, error_type: str = "validation"):
        super().__init__(message)
        self.status, self.message, self.error_type = status, message, error_type

    def body(self) -> dict:
        return {"error": self.message, "error_type": self.error_type}


def json_object(raw: bytes) -> dict:
    """The request body as a JSON object, else a 422."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PayloadError(422, f"body: not valid JSON ({e}); send a JSON object such as "
                                '{"inputs": "some text"} with Content-Type: application/json') from None
    if not isinstance(body, dict):
        raise PayloadError(422, f"body: expected a JSON object, got {type(body).__name__}; send "
                                '{"inputs": ...}')
    return body


def text_value(value: Any, where: str) -> str:
    """``value`` if it is a non-empty text, else a 422 naming ``where``."""
    if not isinstance(value, str):
        raise PayloadError(422, f"{where}: expected a text (a JSON string), got {_kind(value)}")
    if not value.strip():
        raise PayloadError(422, f"{where}: the text is empty; every input needs a non-empty text")
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__.replace("dict", "object").replace("list", "array")


def texts_field(body: dict, name: str = "inputs", *, pairs: bool = True,
                max_texts: int | None = None) -> tuple[list[Text], bool]:
    """``body[name]`` as a list of texts / ``(text, text)`` pairs and whether it was one input
    (a lone text or pair, answered unwrapped as TEI does)."""
    if name not in body:
        raise PayloadError(422, f"{name}: missing; send {{\"{name}\": \"a text\"}} or a list of texts")
    value = body[name]
    if isinstance(value, str):
        return [text_value(value, name)], True
    if not isinstance(value, list):
        raise PayloadError(422, f"{name}: expected a text or a list of texts, got {_kind(value)}")
    if pairs and len(value) == 2 and all(isinstance(v, str) for v in value):
        return [(text_value(value[0], f"{name}[0]"), text_value(value[1], f"{name}[1]"))], True
    if not value:
        raise PayloadError(422, f"{name}: the list is empty; send at least one text")
    if max_texts is not None and len(value) > max_texts:
        raise PayloadError(413, f"{name}: {len(value)} texts in one request, the most is {max_texts}; "
                                "split it into several requests")
    out: list[Text] = []
    for i, v in enumerate(value):
        if pairs and isinstance(v, list):
            if len(v) != 2:
                raise PayloadError(422, f"{name}[{i}]: a pair is two texts [text, text], got {len(v)} items")
            out.append((text_value(v[0], f"{name}[{i}][0]"), text_value(v[1], f"{name}[{i}][1]")))
        else:
            out.append(text_value(v, f"{name}[{i}]"))
    return out, False


def bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise PayloadError(422, f"{name}: expected true or false, got {json.dumps(value)}")
    return value


def truncation_side(body: dict) -> str:
    """TEI's ``truncation_direction`` (``"Right"``, the default, or ``"Left"``; either case) as
    ``"right"`` / ``"left"``: which end of a text ``truncate`` cuts."""
    value = body.get("truncation_direction")
    if value is None:
        return "right"
    if not isinstance(value, str) or value.lower() not in ("left", "right"):
        raise PayloadError(422, f"truncation_direction: expected \"Left\" or \"Right\", got {json.dumps(value)}")
    return value.lower()


def prompt_field(body: dict, prompts) -> str:
    """The text put before every input: the model's prompt named by ``prompt_name`` (else its
    default prompt, as sentence-transformers' ``encode`` does; else none). ``prompts``: a
    :class:`~flaxheads.interop.sentence_transformers.Prompts`."""
    name = body.get("prompt_name")
    if name is None:
        return prompts.prompts.get(prompts.default_prompt_name, "") if prompts.default_prompt_name else ""
    if not isinstance(name, str):
        raise PayloadError(422, f"prompt_name: expected a prompt's name (a JSON string), got {_kind(name)}")
    if name not in prompts.prompts:
        have = ", ".join(sorted(prompts.prompts)) or "none"
        raise PayloadError(422, f"prompt_name: {json.dumps(name)} is not one of the model's prompts ({have}; "
                                "config_sentence_transformers.json's \"prompts\")")
    if not prompts.include_prompt:
        raise PayloadError(422, "prompt_name: this model's pooling leaves the prompt's tokens out "
                                "(include_prompt: false), which this server does not compute; leave it out")
    return prompts.prompts[name]


def dimensions_field(body: dict, width: int) -> int | None:
    """TEI's ``dimensions``: how many leading values of each embedding to keep (Matryoshka), at most ``width``."""
    value = body.get("dimensions")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= width:
        raise PayloadError(422, f"dimensions: expected a whole number from 1 to the model's {width}, "
                                f"got {json.dumps(value)}")
    return value


ENCODINGS = ("float", "base64")


def encoding_field(body: dict) -> str:
    """TEI's / OpenAI's ``encoding_format``: ``"float"`` (JSON numbers, the default) or ``"base64"``."""
    value = body.get("encoding_format")
    if value is None:
        return "float"
    if value not in ENCODINGS:
        raise PayloadError(422, f"encoding_format: expected \"float\" or \"base64\", got {json.dumps(value)}")
    return value


# ---- texts -> token ids ----------------------------------------------------------------------
def tokenize(clf: Classifier, inputs: Sequence[Text], *, truncate: bool, token_types: bool,
             name: str = "inputs", side: str = "right") -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Token ids (and token types) per input, cut at ``side`` to the classifier's maximum length
    when ``truncate`` (special tokens kept, as transformers' ``truncation_side``), else a 413
    naming the first input past it."""
    n = clf.max_length
    ids: list[Any] = [None] * len(inputs)
    types: list[Any] | None = [None] * len(inputs) if token_types else None
    groups = ([i for i, x in enumerate(inputs) if isinstance(x, str)],
              [i for i, x in enumerate(inputs) if not isinstance(x, str)])
    for paired, idx in enumerate(groups):
        if not idx:
            continue
        first = [inputs[i][0] if paired else inputs[i] for i in idx]
        second = [inputs[i][1] for i in idx] if paired else None
        out = clf.tokenizer(first, second, truncation=True, max_length=n + 1, padding=False)
        over = [j for j, x in enumerate(out["input_ids"]) if len(x) > n]
        if over and not truncate:
            where = f"{name}[{idx[over[0]]}]" if len(inputs) > 1 else name
            raise PayloadError(413, f"{where}: longer than the model's maximum of {n} tokens ({len(over)} "
                                    "input(s) are); shorten it, or send \"truncate\": true to cut it")
        if over:
            cut = clf.tokenizer([first[j] for j in over], None if second is None else [second[j] for j in over],
                                truncation=True, max_length=n, padding=False, truncation_side=side)
            for k, j in enumerate(over):
                for key in out:
                    out[key][j] = cut[key][k]
        for j, i in enumerate(idx):
            ids[i] = np.asarray(out["input_ids"][j], np.int32)
            if types is not None:
                types[i] = np.asarray(out["token_type_ids"][j], np.int32)
    return ids, types


# ---- outputs -> JSON -------------------------------------------------------------------------
def predict_body(clf: Classifier, logits: np.ndarray, *, raw_scores: bool, single: bool) -> list:
    """TEI's ``/predict`` answer: per input, every label with its score, best first. Scores are
    :attr:`Predictions.scores <flaxheads.predict.Predictions.scores>` (softmax, sigmoid for
    multi-label, the value for regression), or the logits with ``raw_scores``."""
    pred = Predictions(np.asarray(logits, np.float32), clf.problem_type, clf.id2label, clf.threshold)
    scores = np.asarray(pred.logits if raw_scores else pred.scores, np.float64)
    names = pred.label_names
    rows = []
    for s in scores:
        order = np.argsort(-s, kind="stable")
        rows.append([{"score": float(s[j]), "label": names[j]} for j in order])
    return rows[0] if single else rows


def rerank_body(scores: np.ndarray, texts: Sequence[str], *, raw_scores: bool, return_text: bool) -> list:
    """TEI's ``/rerank`` answer: ``{"index", "score"(, "text")}`` best first; the score is the
    sigmoid of the model's output, as TEI's, or the output itself with ``raw_scores``."""
    s = np.asarray(scores, np.float64)
    if not raw_scores:
        s = 1.0 / (1.0 + np.exp(-s))
    out = []
    for i in np.argsort(-s, kind="stable"):
        row = {"index": int(i), "score": float(s[i])}
        if return_text:
            row["text"] = texts[i]
        out.append(row)
    return out


def embed_body(emb: np.ndarray, *, normalize: bool, dimensions: int | None = None, model_normalizes: bool = False,
               encoding: str = "float") -> list:
    """TEI's ``/embed`` answer: one vector per input, its first ``dimensions`` values (Matryoshka
    truncation), L2-normalised with ``normalize`` (TEI's default) or, once truncated, when the model's
    own output is normalised (sentence-transformers' ``truncate_dim`` with ``normalize_embeddings``).
    ``encoding="base64"``: each vector as base64 of its little-endian float32 bytes (OpenAI's, TEI's)."""
    e = np.asarray(emb, np.float32)
    if dimensions is not None:
        e = e[:, :dimensions]
    if normalize or (dimensions is not None and model_normalizes):
        e = e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
    if encoding == "base64":
        return [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in e]
    return e.tolist()


def kind_of(clf: Classifier) -> str:
    """What TEI would call the model: ``"embedding"``, ``"reranker"`` (one output, which TEI
    takes for a relevance score) or ``"classifier"``."""
    if clf.is_embedding:
        return "embedding"
    return "reranker" if clf.model.num_labels == 1 and clf.problem_type != MULTI_LABEL else "classifier"
