"""What the routes answer: model outputs as text-embeddings-inference's (TEI's) response bodies,
OpenAI's embeddings list, and the Inference API's text-classification lists."""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np

from flaxheads.predict import Predictions
from flaxheads.predict.results import sigmoid, softmax


def predict_body(clf, logits: np.ndarray, *, raw_scores: bool) -> list[list[dict]]:
    """TEI's ``/predict`` answer, per input: every label with its score, best first. Scores are
    :attr:`Predictions.scores <flaxheads.predict.Predictions.scores>` (softmax, sigmoid for
    multi-label, the value for regression), or the logits with ``raw_scores``."""
    pred = Predictions(np.asarray(logits, np.float32), clf.problem_type, clf.id2label, clf.threshold)
    return _ranked(np.asarray(pred.logits if raw_scores else pred.scores, np.float64), pred.label_names)


def classification_body(
    clf, logits: np.ndarray, *, top_k: int | None, function: str | None, raw_scores: bool = False
) -> list[list[dict]]:
    """The Inference API's text-classification answer: per input, ``[{"label", "score"}]`` best
    first, the ``top_k`` best (default: every label). ``function``: ``softmax``, ``sigmoid`` or
    ``none`` on the logits (default: as :func:`predict_body`)."""
    if function is None:
        rows = predict_body(clf, logits, raw_scores=raw_scores)
    else:
        x = np.asarray(logits, np.float64)
        scores = softmax(x) if function == "softmax" else sigmoid(x) if function == "sigmoid" else x
        rows = _ranked(np.asarray(scores, np.float64), [clf.id2label[i] for i in range(x.shape[-1])])
    return [r[:top_k] for r in rows] if top_k else rows


def _ranked(scores: np.ndarray, names: Sequence[str]) -> list[list[dict]]:
    rows = []
    for s in scores:
        order = np.argsort(-s, kind="stable")
        rows.append([{"score": float(s[j]), "label": names[j]} for j in order])
    return rows


def rerank_body(scores: np.ndarray, texts: Sequence[str], *, raw_scores: bool, return_text: bool) -> list[dict]:
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


def embeddings(
    emb: np.ndarray, *, normalize: bool, dimensions: int | None = None, model_normalizes: bool = False
) -> np.ndarray:
    """Embeddings ``[N, D]`` float32 as asked: their first ``dimensions`` values (Matryoshka
    truncation), L2-normalised with ``normalize`` (TEI's default) or, once truncated, when the
    model's own output is normalised (sentence-transformers' ``truncate_dim`` with ``normalize_embeddings``)."""
    e = np.asarray(emb, np.float32)
    if dimensions is not None:
        e = e[:, :dimensions]
    if normalize or (dimensions is not None and model_normalizes):
        e = e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), 1e-12)
    return e


def encode_vectors(e: np.ndarray, encoding: str = "float") -> list:
    """Vectors as JSON: lists of numbers, or (``"base64"``) each one base64 of its little-endian
    float32 bytes (OpenAI's, TEI's)."""
    if encoding == "base64":
        return [base64.b64encode(np.asarray(row, "<f4").tobytes()).decode("ascii") for row in e]
    return np.asarray(e, np.float32).tolist()


def embed_body(
    emb: np.ndarray,
    *,
    normalize: bool,
    dimensions: int | None = None,
    model_normalizes: bool = False,
    encoding: str = "float",
) -> list:
    """TEI's ``/embed`` answer: one vector per input (see :func:`embeddings`, :func:`encode_vectors`)."""
    return encode_vectors(
        embeddings(emb, normalize=normalize, dimensions=dimensions, model_normalizes=model_normalizes), encoding
    )


def openai_body(vectors: list, *, model: str, tokens: int) -> dict:
    """OpenAI's ``/v1/embeddings`` answer (TEI's ``OpenAICompatResponse``)."""
    data = [{"object": "embedding", "embedding": v, "index": i} for i, v in enumerate(vectors)]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": int(tokens), "total_tokens": int(tokens)},
    }


def cosine(source: np.ndarray, others: np.ndarray) -> list[float]:
    """Cosine similarity of ``source`` ``[D]`` with each row of ``others`` ``[N, D]`` (``/similarity``)."""
    a = np.asarray(source, np.float64)
    b = np.asarray(others, np.float64)
    den = np.maximum(np.linalg.norm(a) * np.linalg.norm(b, axis=-1), 1e-12)
    return (b @ a / den).tolist()
