"""What the server does for a request, whichever protocol brought it (HTTP or gRPC): which routes
the model's kind serves, inputs to token ids, token ids through the :class:`Batcher`, and the
model's description (``/info``).

A model is one of TEI's three kinds (:func:`kind_of`): ``"embedding"`` (a projection or identity
head: ``/embed``, ``/embed_all``, ``/similarity``, ``/v1/embeddings``), ``"reranker"`` (one
output: ``/rerank`` and ``/predict``) or ``"classifier"`` (``/predict``). Any other model route
is a 424, as TEI answers it; ``/tokenize`` and ``/decode`` serve every kind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from flaxheads._version import __version__
from flaxheads.losses import MULTI_LABEL
from flaxheads.predict import Classifier
from flaxheads.predict.tokens import TokenOutputs, TokenView
from flaxheads.serve.batcher import Batcher, Closed, Job, QueueFull
from flaxheads.serve.payloads import BACKEND, OVERLOADED, TOKENIZER, UNHEALTHY, PayloadError, Text, prompt_text

#: Requests of at most this many texts and characters are tokenised on the event loop itself.
INLINE_TEXTS, INLINE_CHARS = 4, 2048
#: Routes per kind, for the 424's hint.
ROUTES = {
    "embedding": "/embed, /embed_all, /similarity or /v1/embeddings",
    "reranker": "/rerank or /predict",
    "classifier": "/predict",
}


def kind_of(clf: Classifier) -> str:
    """What TEI would call the model: ``"embedding"``, ``"reranker"`` (one output, which TEI
    takes for a relevance score) or ``"classifier"``."""
    if clf.is_embedding:
        return "embedding"
    return "reranker" if clf.model.num_labels == 1 and clf.problem_type != MULTI_LABEL else "classifier"


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


@dataclasses.dataclass
class Usage:
    """What a request cost: characters and tokens in, and where its time went (TEI's ``Metadata``)."""

    chars: int = 0
    tokens: int = 0
    tokenization_ns: int = 0
    queue_ns: int = 0
    inference_ns: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def total_ns(self) -> int:
        return int((time.perf_counter() - self.started) * 1e9)


def _a(kind: str) -> str:
    return f"an {kind} model" if kind[0] in "aeiou" else f"a {kind}"


def _chars(x: Text) -> int:
    return len(x) if isinstance(x, (str, np.ndarray)) else len(x[0]) + len(x[1])


class Service:
    """The routes' work on ``clf``, its texts batched by ``batcher``; ``metrics`` counts refusals
    and dropped texts. ``settings``: a :class:`~flaxheads.serve.app.ServeSettings`."""

    def __init__(self, clf: Classifier, settings, batcher: Batcher, metrics):
        self.clf, self.settings, self.batcher, self.metrics = clf, settings, batcher, metrics
        self.kind = kind_of(clf)
        self.view = TokenView(clf.tokenizer)
        self.model_normalizes = bool(getattr(clf.model.head.head, "normalize", False))
        self._token_outputs: TokenOutputs | None = None
        self._token_lock = threading.Lock()

    # ---- what the model serves ----------------------------------------------------------------
    def need(self, route: str, *kinds: str) -> None:
        """A 424 (TEI's answer to a route the model's kind cannot serve) unless the model is one of ``kinds``."""
        if self.kind not in kinds:
            what = "an embedding model" if self.kind == "embedding" else f"a {self.kind} ({self.clf.problem_type})"
            raise PayloadError(
                424,
                f"{route}: this model is {what}, not {' or '.join(_a(k) for k in kinds)}; use {ROUTES[self.kind]}",
                BACKEND,
            )

    def prompt(self, name: str | None, inputs: Sequence[Text] = (), where: str = "") -> str:
        """The prompt text for ``prompt_name`` ``name`` (None: the model's default), refused with token-id inputs."""
        if name is not None and any(isinstance(x, np.ndarray) for x in inputs):
            raise PayloadError(
                422,
                f"{where}prompt_name: token ids are used as given, without a prompt; send texts "
                "to have the prompt put before them, or leave prompt_name out",
            )
        return prompt_text(name, self.clf.prompts, where)

    # ---- inputs -> token ids ------------------------------------------------------------------
    def encode(
        self, inputs: Sequence[Text], *, truncate: bool, side: str = "right", prompt: str = "", name: str = "inputs"
    ) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Token ids (and token types) per input. Texts get ``prompt`` before them; token ids are
        used as given (checked against the vocabulary). Past the maximum length an input is cut at
        ``side`` when ``truncate`` (special tokens kept), else a 413 naming it."""
        clf, n = self.clf, self.clf.max_length
        # a pair is one text in a reward model's chat template or an LLM reranker's prompt (Classifier.pair_texts)
        at = [i for i, x in enumerate(inputs) if isinstance(x, tuple)]
        written = (
            clf.pair_texts([inputs[i][0] for i in at], [inputs[i][1] for i in at], truncate=truncate) if at else None
        )
        chat = set(at) if written is not None and clf.chat_template else set()  # texts that hold their special tokens
        if written is not None:
            inputs = list(inputs)
            for i, text in zip(at, written):
                inputs[i] = text
        token_types = self.batcher.token_types
        ids: list[Any] = [None] * len(inputs)
        types: list[Any] | None = [None] * len(inputs) if token_types else None

        def where(i: int) -> str:
            return f"{name}[{i}]" if len(inputs) > 1 else name

        def too_long(i: int, count: int) -> PayloadError:
            return PayloadError(
                413,
                f"{where(i)}: longer than the model's maximum of {n} tokens ({count} input(s) "
                'are); shorten it, or send "truncate": true to cut it',
            )

        over_ids = []
        for i, x in enumerate(inputs):
            if isinstance(x, np.ndarray):
                bad = self.view.check_ids(x)
                if bad is not None:
                    raise PayloadError(422, f"{where(i)}{bad}", TOKENIZER)
                over_ids += [i] if len(x) > n else []
                ids[i] = x if len(x) <= n else x[:n] if side == "right" else x[-n:]
                if types is not None:
                    types[i] = np.zeros(len(ids[i]), np.int32)
        if over_ids and not truncate:
            raise too_long(over_ids[0], len(over_ids))
        texts = {i: x for i, x in enumerate(inputs) if isinstance(x, str) and i not in chat}
        chats = {i: x for i, x in enumerate(inputs) if isinstance(x, str) and i in chat}
        pairs = {i: x for i, x in enumerate(inputs) if isinstance(x, tuple)}
        for idx, first, second, special in (
            (list(texts), [prompt + x for x in texts.values()], None, True),
            (list(chats), list(chats.values()), None, False),
            (list(pairs), [x[0] for x in pairs.values()], [x[1] for x in pairs.values()], True),
        ):
            if not idx:
                continue
            out = clf.tokenizer(
                first, second, truncation=True, max_length=n + 1, padding=False, add_special_tokens=special
            )
            over = [j for j, x in enumerate(out["input_ids"]) if len(x) > n]
            if over and not truncate:
                raise too_long(idx[over[0]], len(over))
            if over:
                cut = clf.tokenizer(
                    [first[j] for j in over],
                    None if second is None else [second[j] for j in over],
                    truncation=True,
                    max_length=n,
                    padding=False,
                    truncation_side=side,
                    add_special_tokens=special,
                )
                for k, j in enumerate(over):
                    for key in out:
                        out[key][j] = cut[key][k]
            for j, i in enumerate(idx):
                ids[i] = np.asarray(out["input_ids"][j], np.int32)
                if types is not None:
                    types[i] = np.asarray(out["token_type_ids"][j], np.int32)
        return ids, types

    async def encode_async(self, inputs: Sequence[Text], usage: Usage, **kw):
        """:meth:`encode`, on the event loop for a few short inputs (a hop to a thread costs more
        than their ~0.1 ms on a busy CPU), else in a worker thread."""
        started = time.perf_counter()
        usage.chars += sum(_chars(x) for x in inputs)
        if len(inputs) <= INLINE_TEXTS and sum(_chars(x) for x in inputs) <= INLINE_CHARS:
            ids, types = self.encode(inputs, **kw)
        else:
            ids, types = await asyncio.to_thread(lambda: self.encode(inputs, **kw))
        usage.tokens += sum(len(x) for x in ids)
        usage.tokenization_ns += int((time.perf_counter() - started) * 1e9)
        return ids, types

    # ---- token ids -> outputs -----------------------------------------------------------------
    async def compute(
        self,
        inputs: Sequence[Text],
        *,
        truncate: bool,
        side: str = "right",
        prompt: str = "",
        name: str = "inputs",
        gone: Callable[[], Awaitable[None]] | None = None,
        usage: Usage | None = None,
    ) -> tuple[np.ndarray, Usage]:
        """The model's outputs ``[n, K]`` for ``inputs``, batched with other requests' texts.
        ``gone``: returns when the client has left (its texts then leave the queue: :class:`ClientGone`)."""
        usage = usage or Usage()
        ids, types = await self.encode_async(inputs, usage, truncate=truncate, side=side, prompt=prompt, name=name)
        try:
            job = self.batcher.submit(ids, types)
        except QueueFull as e:
            self.metrics.rejected.inc()
            raise PayloadError(
                429, f"the model is overloaded: {e}; retry in {self.settings.retry_after_s} s", OVERLOADED
            ) from None
        except Closed as e:
            self.metrics.rejected.inc()
            raise PayloadError(503, f"{e}; retry on another replica or once it is back", UNHEALTHY) from None
        try:
            out = await self._wait(job, gone)
        except (ClientGone, asyncio.CancelledError):
            raise
        except Exception as e:  # the forward failed: TEI's "inference failed"
            raise PayloadError(424, f"inference failed: {type(e).__name__}: {e}", BACKEND) from None
        if job.started is not None and job.finished is not None:
            usage.queue_ns += int((job.started - job.queued_at) * 1e9)
            usage.inference_ns += int((job.finished - job.started) * 1e9)
        return out, usage

    async def _wait(self, job: Job, gone) -> np.ndarray:
        if gone is None:
            try:
                return await job.future
            except asyncio.CancelledError:  # gRPC cancels the call's task when its client leaves
                self.metrics.cancelled.inc(self.batcher.cancel(job))
                raise
        waiter = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({job.future, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if job.future.done():
                return job.future.result()
            self.metrics.cancelled.inc(self.batcher.cancel(job))
            raise ClientGone()
        finally:
            waiter.cancel()

    # ---- the routes' work ---------------------------------------------------------------------
    async def predict(
        self, inputs: Sequence[Text], *, truncate: bool, side: str = "right", route: str = "/predict", gone=None
    ) -> tuple[np.ndarray, Usage]:
        """Logits ``[n, K]`` of texts and pairs (classifiers and rerankers)."""
        self.need(route, "classifier", "reranker")
        return await self.compute(inputs, truncate=truncate, side=side, gone=gone)

    async def rerank(
        self, query: str, texts: Sequence[str], *, truncate: bool, side: str = "right", gone=None
    ) -> tuple[np.ndarray, Usage]:
        """The one output ``[n]`` of each ``(query, text)`` pair (rerankers)."""
        self.need("/rerank", "reranker")
        out, usage = await self.compute(
            [(query, t) for t in texts], truncate=truncate, side=side, name="texts", gone=gone
        )
        return out[:, 0], usage

    async def embed(
        self,
        inputs: Sequence[Text],
        *,
        truncate: bool,
        side: str = "right",
        prompt_name: str | None = None,
        route: str = "/embed",
        where: str = "",
        gone=None,
    ) -> tuple[np.ndarray, Usage]:
        """The model's embeddings ``[n, D]`` (before any ``normalize`` / ``dimensions``)."""
        self.need(route, "embedding")
        prompt = self.prompt(prompt_name, inputs, where)
        return await self.compute(inputs, truncate=truncate, side=side, prompt=prompt, gone=gone)

    async def similarity(
        self,
        source: str,
        sentences: Sequence[str],
        *,
        truncate: bool,
        side: str = "right",
        prompt_name: str | None = None,
        gone=None,
    ) -> tuple[np.ndarray, Usage]:
        """Embeddings of ``source`` then ``sentences``; the caller takes their cosines."""
        return await self.embed(
            [source, *sentences],
            truncate=truncate,
            side=side,
            prompt_name=prompt_name,
            route="/similarity",
            where="parameters.",
            gone=gone,
        )

    async def embed_all(
        self, inputs: Sequence[Text], *, truncate: bool, side: str = "right", prompt_name: str | None = None
    ) -> tuple[list[np.ndarray], Usage]:
        """The backbone's last hidden state ``[T_i, H]`` at every token of each input (no pooling):
        run apart from the batcher, one request at a time, each padded shape compiled when first met."""
        self.need("/embed_all", "embedding")
        usage = Usage()
        prompt = self.prompt(prompt_name, inputs)
        ids, types = await self.encode_async(inputs, usage, truncate=truncate, side=side, prompt=prompt)

        def run() -> list[np.ndarray]:
            with self._token_lock:
                if self._token_outputs is None:
                    s, clf = self.settings, self.clf
                    self._token_outputs = TokenOutputs(
                        clf.model,
                        clf.params,
                        buckets=clf.buckets,
                        pad_id=clf.pad_id,
                        max_rows=s.max_batch_size,
                        max_tokens=s.max_batch_tokens,
                    )
                started = time.perf_counter()
                out = self._token_outputs(ids, types)
                usage.inference_ns += int((time.perf_counter() - started) * 1e9)
                return out

        try:
            return await asyncio.to_thread(run), usage
        except Exception as e:
            raise PayloadError(424, f"inference failed: {type(e).__name__}: {e}", BACKEND) from None

    def tokenize(
        self, texts: Sequence[str], *, add_special_tokens: bool = True, prompt_name: str | None = None
    ) -> list[list[dict]]:
        """Each text's tokens (:meth:`TokenView.tokens <flaxheads.predict.tokens.TokenView.tokens>`),
        the prompt (``prompt_name``, else the model's default) put before it, as the model sees it."""
        prompt = self.prompt(prompt_name)
        return [self.view.tokens(prompt + t, add_special_tokens=add_special_tokens) for t in texts]

    def decode(self, ids: Sequence[np.ndarray], *, skip_special_tokens: bool = True) -> list[str]:
        """Token ids back to text; an id the tokenizer does not have is a 422."""
        for i, x in enumerate(ids):
            bad = self.view.check_ids(x)
            if bad is not None:
                raise PayloadError(422, f"ids{f'[{i}]' if len(ids) > 1 else ''}{bad}", TOKENIZER)
        return [self.view.decode(x, skip_special_tokens=skip_special_tokens) for x in ids]

    # ---- the model ----------------------------------------------------------------------------
    def pooling(self) -> str:
        """The pooling as TEI names it (``cls``, ``mean``, ``last_token``, ...), else the pooler's class."""
        pooler = getattr(self.clf.model.head, "pooler", None)
        mode = getattr(pooler, "mode", None)
        if isinstance(mode, str):
            return {"last": "last_token"}.get(mode, mode)
        return type(pooler).__name__

    def info(self) -> dict:
        """TEI's ``Info`` (every field its schema requires), and what flaxheads adds: problem type,
        buckets, batch shapes, programs compiled, compute plan."""
        clf, s, b = self.clf, self.settings, self.batcher
        labels = {str(i): n for i, n in sorted(clf.id2label.items())}
        model_type = (
            {"embedding": {"pooling": self.pooling()}}
            if self.kind == "embedding"
            else {self.kind: {"id2label": labels, "label2id": {n: int(i) for i, n in labels.items()}}}
        )
        plan = getattr(clf.model, "plan", None)
        return {
            "model_id": clf.source,
            "model_sha": None,
            "model_dtype": str(np.dtype(getattr(clf.model.backbone, "dtype", np.float32))),
            "model_type": model_type,
            "max_concurrent_requests": s.max_queue,
            "max_input_length": clf.max_length,
            "max_batch_tokens": s.max_batch_tokens,
            "max_batch_requests": s.max_batch_size,
            "max_client_batch_size": s.max_client_batch_size,
            "auto_truncate": bool(s.auto_truncate),
            # tokenisation runs on the event loop (a few short texts) or asyncio's default thread pool
            "tokenization_workers": min(32, (os.cpu_count() or 1) + 4),
            "version": __version__,
            "sha": None,
            "docker_label": None,
            "problem_type": clf.problem_type,
            "max_wait_ms": s.max_wait_ms,
            "buckets": list(clf.buckets),
            "batch_shapes": [list(x) for x in b.shapes.all()],
            "compiled_programs": b.compiles,
            "compiled_at_warm_up": b.compiles_after_warm_up,
            "token_programs": 0 if self._token_outputs is None else self._token_outputs.compiles,
            "plan": plan.describe() if plan is not None else None,
            "router": "flaxheads",
        }
