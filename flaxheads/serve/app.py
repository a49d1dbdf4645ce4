"""The HTTP app: text-embeddings-inference's routes on a :class:`~flaxheads.predict.Classifier`,
its texts batched by a :class:`~flaxheads.serve.batcher.Batcher`.

Starlette (the ASGI toolkit FastAPI is built on) rather than FastAPI: six routes whose bodies
are validated here so that errors have TEI's shape (``{"error", "error_type"}``, the field
named), which FastAPI's pydantic 422s do not. Any ASGI server runs it; :func:`~flaxheads.serve.run`
uses uvicorn.

Routes: ``POST /predict`` (classifiers, regressors, rerankers), ``POST /rerank`` (one-output
models), ``POST /embed`` (embedding heads), ``POST /`` (whichever of them the model is, as TEI
and the Hugging Face inference API route it), ``GET /health``, ``GET /info``, ``GET /metrics``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable

import jax
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flaxheads._version import __version__
from flaxheads.predict import Classifier
from flaxheads.serve.batcher import Batcher, Closed, Job, QueueFull
from flaxheads.serve.metrics import Metrics
from flaxheads.serve.payloads import (PayloadError, bool_field, dimensions_field, embed_body, encoding_field, json_object, kind_of,
                       predict_body, prompt_field, rerank_body, text_value, texts_field, tokenize, truncation_side)


#: Requests of at most this many texts and characters are tokenised on the event loop itself.
INLINE_TEXTS, INLINE_CHARS = 4, 2048


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """Limits and batching of a server (TEI's defaults where TEI has the setting)."""

    max_batch_tokens: int = 16384  # padded tokens per batch
    max_batch_size: int = 32  # texts per batch
    max_wait_ms: float = 2.0  # how long the oldest queued text waits for a fuller batch
    max_queue: int = 1024  # texts queued at most; beyond it 503 + Retry-After
    max_client_batch_size: int = 32  # texts per request; beyond it 413
    max_body_bytes: int = 2_000_000  # request body; beyond it 413
    retry_after_s: int = 1
    devices: int | None = None  # local devices a batch is split over (None: all of them)


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(clf: Classifier, settings: ServeSettings | None = None, *, warm_up: bool = True,
               on_ready: Callable[[Batcher], None] | None = None) -> Starlette:
    """An ASGI app serving ``clf``. On startup it compiles every batch shape (``warm_up``), then
    starts the batcher and calls ``on_ready``; on shutdown it answers what is queued, then stops."""
    settings = settings or ServeSettings()
    batcher = Batcher(clf, max_batch_tokens=settings.max_batch_tokens, max_batch_size=settings.max_batch_size,
                      max_wait_s=settings.max_wait_ms / 1000.0, max_queue=settings.max_queue,
                      devices=None if settings.devices is None else jax.local_devices()[:settings.devices])
    metrics = Metrics(lambda: batcher.queued, lambda: batcher.compiles)
    batcher.observe = metrics.observe_batch
    kind = kind_of(clf)
    state = {"ready": False}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warm_up:
            await asyncio.to_thread(batcher.warm_up)
        batcher.start()
        state["ready"] = True
        if on_ready is not None:
            on_ready(batcher)
        try:
            yield
        finally:
            state["ready"] = False
            await asyncio.to_thread(batcher.close)

    async def outputs(request: Request, inputs, body: dict, name: str = "inputs") -> np.ndarray:
        work = functools.partial(tokenize, clf, inputs, truncate=bool_field(body, "truncate", False),
                                 token_types=batcher.token_types, name=name, side=truncation_side(body))
        # a few short texts tokenise in ~0.1 ms: a hop to a thread and back costs more than that on a busy CPU
        small = len(inputs) <= INLINE_TEXTS and sum(len(t) if isinstance(t, str) else len(t[0]) + len(t[1])
                                                    for t in inputs) <= INLINE_CHARS
        ids, types = work() if small else await asyncio.to_thread(work)
        return await _answer_or_leave(request, batcher.submit(ids, types))

    async def _answer_or_leave(request: Request, job: Job) -> np.ndarray:
        # a client that leaves takes its queued texts with it: its disconnect ends this wait
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({job.future, gone}, return_when=asyncio.FIRST_COMPLETED)
            if job.future.done():
                return job.future.result()
            metrics.cancelled.inc(batcher.cancel(job))
            raise _ClientGone()
        finally:
            gone.cancel()

    def need(what: str, route: str) -> None:
        if kind not in what.split("|"):
            other = {"embedding": "/embed", "reranker": "/rerank or /predict", "classifier": "/predict"}[kind]
            raise PayloadError(400, f"{route} is not served for this model: it is a {kind} "
                                    f"({clf.problem_type}); use {other}", "validation")

    async def predict(request: Request, body: dict) -> Any:
        need("classifier|reranker", "/predict")
        inputs, single = texts_field(body, "inputs", max_texts=settings.max_client_batch_size)
        logits = await outputs(request, inputs, body)
        return predict_body(clf, logits, raw_scores=bool_field(body, "raw_scores", False), single=single)

    async def rerank(request: Request, body: dict) -> Any:
        need("reranker", "/rerank")
        query = text_value(body.get("query"), "query")
        texts, _ = texts_field(body, "texts", pairs=False, max_texts=settings.max_client_batch_size)
        query = [query]
        scores = await outputs(request, [(query[0], t) for t in texts], body, "texts")
        return rerank_body(scores[:, 0], texts, raw_scores=bool_field(body, "raw_scores", False),
                           return_text=bool_field(body, "return_text", False))

    async def embed(request: Request, body: dict) -> Any:
        need("embedding", "/embed")
        inputs, _ = texts_field(body, "inputs", pairs=False, max_texts=settings.max_client_batch_size)
        prompt, dims = prompt_field(body, clf.prompts), dimensions_field(body, clf.model.num_labels)
        normalize, encoding = bool_field(body, "normalize", True), encoding_field(body)
        emb = await outputs(request, [prompt + t for t in inputs], body)
        return embed_body(emb, normalize=normalize, dimensions=dims, encoding=encoding,
                          model_normalizes=bool(getattr(clf.model.head.head, "normalize", False)))

    async def default(request: Request, body: dict) -> Any:
        return await {"embedding": embed, "reranker": rerank, "classifier": predict}[kind](request, body)

    def post(route: str, handler) -> Route:
        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            headers = {}
            try:
                result = await handler(request, json_object(await _body(request, settings.max_body_bytes)))
                response: Response = JSONResponse(result)
            except PayloadError as e:
                response = JSONResponse(e.body(), status_code=e.status)
            except (QueueFull, Closed) as e:
                metrics.rejected.inc()
                headers = {"Retry-After": str(settings.retry_after_s)}
                response = JSONResponse({"error": f"{e}; retry in {settings.retry_after_s} s", "error_type":
                                         "overloaded" if isinstance(e, QueueFull) else "unhealthy"},
                                        status_code=503, headers=headers)
            except _ClientGone:
                response = Response(status_code=499)  # nobody reads it; counted as such
            metrics.requests.labels(route, str(response.status_code)).inc()
            metrics.latency.labels(route).observe(time.perf_counter() - started)
            return response
        return Route(route, endpoint, methods=["POST"])

    async def health(request: Request) -> Response:
        ok = state["ready"]
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def info(request: Request) -> Response:
        return JSONResponse(info_body(clf, settings, batcher, kind))

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.text(), media_type=metrics.content_type)

    routes = [post("/predict", predict), post("/rerank", rerank), post("/embed", embed), post("/", default),
              Route("/health", health), Route("/info", info), Route("/metrics", metrics_route)]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.batcher, app.state.metrics, app.state.classifier = batcher, metrics, clf
    return app


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past ``limit`` bytes, by its header or as it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadError(413, f"body: {declared} bytes, the most is {limit}; send fewer or shorter texts")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadError(413, f"body: more than {limit} bytes; send fewer or shorter texts")
        chunks.append(chunk)
    return b"".join(chunks)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the next ASGI message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def info_body(clf: Classifier, settings: ServeSettings, batcher: Batcher, kind: str) -> dict:
    """TEI's ``/info`` fields, and what flaxheads adds: problem type, buckets, batch shapes, compute plan."""
    labels = {str(i): n for i, n in sorted(clf.id2label.items())}
    pooler = type(getattr(clf.model.head, "pooler", None)).__name__
    model_type = {"embedding": {"pooling": pooler}} if kind == "embedding" \
        else {kind: {"id2label": labels, "label2id": {n: int(i) for i, n in labels.items()}}}
    plan = getattr(clf.model, "plan", None)
    return {"model_id": clf.source, "model_dtype": str(np.dtype(getattr(clf.model.backbone, "dtype", np.float32))),
            "model_type": model_type, "problem_type": clf.problem_type, "max_input_length": clf.max_length,
            "max_batch_tokens": settings.max_batch_tokens, "max_batch_requests": settings.max_batch_size,
            "max_client_batch_size": settings.max_client_batch_size, "max_concurrent_requests": settings.max_queue,
            "max_wait_ms": settings.max_wait_ms, "buckets": list(clf.buckets),
            "batch_shapes": [list(s) for s in batcher.shapes.all()], "compiled_programs": batcher.compiles,
            "compiled_at_warm_up": batcher.compiles_after_warm_up,
            "plan": plan.describe() if plan is not None else None, "version": __version__,
            "router": "flaxheads"}
