"""Texts in, predictions out: :class:`Classifier` holds a model with its tokenizer, params,
labels, problem type and decision threshold, and turns lists of texts (and text pairs) into
labels and scores, regression values or embeddings."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Sequence

import numpy as np

from flaxheads.data.batching import make_buckets
from flaxheads.data.chat import chat_pairs, prompt_pairs, read_chat_template
from flaxheads.errors import UsageError
from flaxheads.formats import load_source
from flaxheads.heads.heads import IdentityHead, ProjectionHead
from flaxheads.interop.sentence_transformers import Prompts, read_prompts
from flaxheads.interop.tokenizers import Tokenizer, load_tokenizer, model_max_positions
from flaxheads.losses import MULTI_LABEL, SINGLE_LABEL
from flaxheads.model.sequence import SequenceModel
from flaxheads.predict.batches import Runner, TruncationWarning, check_texts, encode, short_buckets
from flaxheads.predict.ranking import rank_candidates, score_pairs
from flaxheads.predict.results import Predictions
from flaxheads.runtime import phases
from flaxheads.training.programs import jit_count

#: Tokens per text when neither the source nor the tokenizer / config states a maximum.
FALLBACK_MAX_LENGTH = 512


@dataclasses.dataclass
class Classifier:
    """A model ready to predict: ``predict(texts)``, ``embed(texts)``, ``logits(texts)``.

    Load one with :meth:`from_pretrained` (a run folder, a checkpoint, a transformers or
    sentence-transformers folder, a head export with its backbone, or a hub id) or wrap a
    model you hold with :meth:`from_model`. Texts longer than ``max_length`` tokens are cut
    (a :class:`~flaxheads.predict.batches.TruncationWarning` says how many) and batches are
    padded to ``buckets``, so each bucket compiles once per batch size; lengths of 8 and 16
    are added below the smallest (:func:`~flaxheads.predict.batches.short_buckets`)."""

    model: SequenceModel
    tokenizer: Tokenizer
    params: dict
    id2label: dict[int, str]
    problem_type: str
    max_length: int
    buckets: tuple[int, ...]
    threshold: float = 0.5
    source: str = ""
    #: the sentence-transformers prompts of the source folder (the server's ``prompt_name``)
    prompts: Prompts = dataclasses.field(default_factory=Prompts)
    #: text pairs are written in the tokenizer's chat template unless a call says otherwise (a reward model:
    #: ``flaxheads predict / serve --chat-template on``)
    chat_template: bool = False
    _runner: Runner | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_model(
        cls,
        model: SequenceModel,
        tokenizer: Tokenizer | str | os.PathLike,
        *,
        params: dict | None = None,
        threshold: float = 0.5,
        max_length: int | None = None,
        buckets: Sequence[int] | None = None,
        bucket_step: int = 32,
        source: str = "",
        prompts: Prompts | None = None,
    ) -> Classifier:
        """Wrap ``model`` (and ``params``, default ``model.params``) with a tokenizer or its folder.
        ``max_length`` defaults to what the tokenizer / model config allows."""
        tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        limit = model_max_positions(tok, model.backbone.config)
        n = int(max_length or limit or FALLBACK_MAX_LENGTH)
        if limit is not None and n > limit:
            raise UsageError(f"max_length {n} is more than the {limit} positions the model takes; use at most {limit}")
        if not 0.0 < float(threshold) < 1.0:
            raise UsageError(f"threshold must be between 0 and 1 (exclusive), got {threshold}")
        b = tuple(int(x) for x in buckets) if buckets else make_buckets(n, min(bucket_step, n))
        if b[-1] < n:
            b = (*b, n)
        b = short_buckets(b)
        labels = model.id2label or {i: f"LABEL_{i}" for i in range(model.num_labels)}
        return cls(
            model,
            tok,
            model.params if params is None else params,
            dict(labels),
            model.problem_type,
            n,
            b,
            float(threshold),
            source or model.name_or_path,
            prompts or Prompts(),
        )

    @classmethod
    def from_pretrained(
        cls,
        source: str | os.PathLike,
        *,
        step: int | str | None = None,
        backbone: str | os.PathLike | None = None,
        threshold: float | None = None,
        max_length: int | None = None,
        bucket_step: int = 32,
        dtype=None,
        revision: str | None = None,
        verify: bool = False,
        task: str | None = None,
    ) -> Classifier:
        """Load what :func:`flaxheads.load` loads, the same way: a run folder (``step``: latest by
        default, ``"best"`` or a number), a checkpoint folder, a transformers classifier folder, a
        sentence-transformers folder, a PEFT adapter, a head export (with ``backbone``, default: the
        folder it names), or a hub id (``org/name``; the local hub cache when offline). A run's own
        maximum length, buckets and threshold are used unless given here; ``verify``: check every
        byte against the recorded checksums; ``task``: a transformers folder's task adapters (Jina v3's
        ``"retrieval.query"``, ...), as :func:`flaxheads.load` takes it."""
        got = load_source(
            source, step=step, backbone=backbone, dtype=dtype, revision=revision, verify=verify, task=task
        )
        tok = load_tokenizer(got.tokenizer_folder)
        return cls.from_model(
            got.model,
            tok,
            threshold=threshold if threshold is not None else got.threshold or 0.5,
            max_length=max_length or got.max_length,
            buckets=None if max_length else got.buckets,
            bucket_step=bucket_step,
            source=os.fspath(source),
            prompts=read_prompts(got.tokenizer_folder),
        )

    # ---- what it is -------------------------------------------------------------------------
    @property
    def is_embedding(self) -> bool:
        """The head outputs an embedding (projection / identity head), not logits."""
        return isinstance(self.model.head.head, (ProjectionHead, IdentityHead))

    @property
    def template(self) -> str | None:
        """The prompt template an LLM reranker's pairs are written in (a TokenLogits head's), or None."""
        return getattr(self.model.head.head, "template", None)

    def prompts_of(self, queries: Sequence[str], documents: Sequence[str], *, truncate: bool = True) -> list[str]:
        """Each (query, document) written in :attr:`template`; with ``truncate``, a document too long for
        ``max_length`` is cut at its end, so the prompt keeps its end, where the answer is read."""
        assert self.template is not None
        texts, cut = prompt_pairs(self.tokenizer, self.template, queries, documents, self.max_length, truncate=truncate)
        if cut:
            warnings.warn(
                f"{len(cut)} of {len(texts)} documents were cut at their end to fit the reranker's prompt "
                f"in {self.max_length} tokens",
                TruncationWarning,
                stacklevel=3,
            )
        return texts

    def pair_texts(
        self,
        queries: Sequence[str],
        documents: Sequence[str],
        *,
        truncate: bool = True,
        chat_template: bool | None = None,
    ) -> list[str] | None:
        """Each (query, document) as the one text the model reads: a conversation in the tokenizer's chat
        template (``chat_template``, default :attr:`chat_template`: a reward model's input, its special tokens
        written, :func:`flaxheads.data.chat.chat_pairs`), else in an LLM reranker's prompt template
        (:meth:`prompts_of`); None where the pairs are the tokenizer's own pair encoding. What
        :meth:`outputs` and the server (``/rerank``, ``/predict``) both write pairs with."""
        if self.chat_template if chat_template is None else chat_template:
            return chat_pairs(self.tokenizer.name_or_path, zip(queries, documents), chat=self._chat)
        if self.template is not None:
            return self.prompts_of(queries, documents, truncate=truncate)
        return None

    @functools.cached_property
    def _chat(self) -> tuple[str | None, dict[str, str]]:
        """The tokenizer folder's chat template and special tokens (:func:`~flaxheads.data.chat.read_chat_template`),
        read once, not with each batch of pairs."""
        folder = self.tokenizer.name_or_path
        return read_chat_template(folder) if folder else (None, {})

    @property
    def has_chat_template(self) -> bool:
        """The tokenizer has a chat template (what ``outputs(..., chat_template=True)`` writes pairs in)."""
        return self._chat[0] is not None

    def wants_chat_template(self, choice: str = "auto", *, reward_model: bool = False) -> bool:
        """Whether text pairs go in the tokenizer's chat template for ``choice`` (``auto``, ``on``, ``off``:
        ``flaxheads rank / predict / serve --chat-template``): ``auto`` is on for a reward model's scores
        (``reward_model``: ``rank --preference``) when the tokenizer has one; ``on`` needs one."""
        if choice not in ("auto", "on", "off"):
            raise UsageError(f"chat template choice must be auto, on or off, got {choice!r}")
        if choice == "auto":
            return reward_model and self.has_chat_template
        if choice == "on" and not self.has_chat_template:
            raise UsageError(
                f"--chat-template on: the tokenizer of {self.source} has no chat_template (tokenizer_config.json "
                "or chat_template.jinja); give the texts already formatted, or leave --chat-template out"
            )
        return choice == "on"

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    @property
    def compiles(self) -> int:
        """Programs compiled so far (one per bucket and batch size seen)."""
        return 0 if self._runner is None else jit_count(self._runner.program)

    def runner(self) -> Runner:
        if self._runner is None:
            self._runner = Runner(self.model, self.params)
        return self._runner

    # ---- outputs ----------------------------------------------------------------------------
    def outputs(
        self,
        texts: Sequence[str],
        text_pairs: Sequence[str] | None = None,
        *,
        batch_size: int = 32,
        truncate: bool = True,
        progress: bool | None = None,
        rows: Sequence[str] | None = None,
        chat_template: bool | None = None,
    ) -> tuple[np.ndarray, int]:
        """The model's raw outputs ``[N, K]`` (logits, or embeddings) in input order, and how many
        texts were truncated. ``rows``: how to name each input in errors (default ``texts[i]``).
        ``chat_template`` (default :attr:`chat_template`): each (prompt, response) pair is written in the
        tokenizer's chat template (:func:`flaxheads.data.chat.chat_pairs`, as a reward model reads it) and
        tokenised as it is (:meth:`pair_texts`)."""
        if int(batch_size) < 1:
            raise UsageError(f"batch_size must be a positive integer, got {batch_size}")
        texts = check_texts(texts, "texts", rows)
        pairs = None
        if text_pairs is not None:
            pairs = check_texts(text_pairs, "text_pairs", None if rows is None else [f"{r} (pair)" for r in rows])
            if len(pairs) != len(texts):
                raise UsageError(f"{len(texts)} texts but {len(pairs)} text pairs; give one pair per text")
            chat = self.chat_template if chat_template is None else chat_template
            written = self.pair_texts(texts, pairs, truncate=truncate, chat_template=chat)
            texts, pairs = (texts, pairs) if written is None else (written, None)
        elif chat_template:
            raise UsageError("chat_template=True formats (prompt, response) pairs: give text_pairs (the responses)")
        else:
            chat = False  # single texts are read as they are
        with phases.phase("tokenising", unless_named=True):
            enc = encode(
                self.tokenizer,
                texts,
                pairs,
                self.max_length,
                truncate=truncate,
                rows=rows,
                add_special_tokens=not chat,  # a chat template writes its special tokens
            )
        with phases.phase("predicting", unless_named=True):
            out = self.runner()(
                enc, batch_size=int(batch_size), buckets=self.buckets, pad_id=self.pad_id, progress=progress
            )
        return out, len(enc.truncated)

    def predict(
        self,
        texts: Sequence[str],
        text_pairs: Sequence[str] | None = None,
        *,
        batch_size: int = 32,
        top_k: int | None = None,
        truncate: bool = True,
        progress: bool | None = None,
        rows: Sequence[str] | None = None,
        chat_template: bool | None = None,
    ) -> Predictions:
        """Labels and scores (single-label: softmax, the best label, ``top_k`` best; multi-label:
        sigmoid, the labels over :attr:`threshold`; regression: the values), and the raw logits.
        ``chat_template``: text pairs in the tokenizer's chat template, as :meth:`outputs`."""
        if self.is_embedding:
            raise UsageError(
                f"{self.source}: this model has an embedding head ({type(self.model.head.head).__name__}),"
                " not a classifier or regressor; use embed() (flaxheads embed)"
            )
        if top_k is not None and not 1 <= int(top_k) <= len(self.id2label):
            raise UsageError(f"top_k must be from 1 to the {len(self.id2label)} labels, got {top_k}")
        if top_k is not None and self.problem_type != SINGLE_LABEL:
            raise UsageError(
                f"top_k applies to single-label classifiers; this model is {self.problem_type} "
                "(multi-label gives every label's score)"
            )
        logits, cut = self.outputs(
            texts,
            text_pairs,
            batch_size=batch_size,
            truncate=truncate,
            progress=progress,
            rows=rows,
            chat_template=chat_template,
        )
        return Predictions(
            logits,
            self.problem_type,
            self.id2label,
            self.threshold if self.problem_type == MULTI_LABEL else 0.5,
            None if top_k is None else int(top_k),
            cut,
        )

    def embed(
        self,
        texts: Sequence[str],
        text_pairs: Sequence[str] | None = None,
        *,
        batch_size: int = 32,
        truncate: bool = True,
        progress: bool | None = None,
        rows: Sequence[str] | None = None,
    ) -> np.ndarray:
        """Embeddings ``[N, D]`` float32 of a projection / identity head (normalised when the head normalises)."""
        if not self.is_embedding:
            raise UsageError(
                f"{self.source}: this model's head ({type(self.model.head.head).__name__}) gives "
                f"{self.problem_type} logits, not embeddings; use predict() (flaxheads predict), or "
                "load a sentence-transformers folder / a model with a projection or identity head"
            )
        return self.outputs(texts, text_pairs, batch_size=batch_size, truncate=truncate, progress=progress, rows=rows)[
            0
        ]

    # ---- rerankers and reward models (one output) -------------------------------------------
    def score(
        self,
        pairs: Sequence[tuple[str, str]],
        *,
        batch_size: int = 32,
        truncate: bool = True,
        progress: bool | None = None,
    ) -> np.ndarray:
        """One score per ``(query, candidate)`` pair ``[N]`` float32, in input order (a one-output
        model: a reranker's relevance or a reward model's reward, the raw output)."""
        return score_pairs(self, pairs, batch_size=batch_size, truncate=truncate, progress=progress)

    def rank(
        self, query: str, candidates: Sequence[str], *, top_k: int | None = None, batch_size: int = 32
    ) -> list[dict]:
        """``candidates`` for ``query``, best first: ``[{"index", "score", "text"}, ...]``."""
        return rank_candidates(self, query, candidates, top_k=top_k, batch_size=batch_size)
