"""The HTTP app: text-embeddings-inference's (TEI's) routes on a :class:`~flaxheads.predict.Classifier`,
its texts batched by a :class:`~flaxheads.serve.batcher.Batcher`.

Starlette (the ASGI toolkit FastAPI is built on) rather than FastAPI: the bodies are read here,
field by field, so that every error has TEI's shape (``{"error", "error_type"}``, the field named),
which FastAPI's pydantic 422s do not. Any ASGI server runs it; :func:`~flaxheads.serve.run` uses uvicorn.

Routes, as TEI's published OpenAPI description (v1.7.1) has them: ``POST /predict``, ``/rerank``,
``/embed``, ``/embed_all``, ``/embed_sparse``, ``/similarity``, ``/tokenize``, ``/decode``,
``/v1/embeddings`` (and ``/embeddings``, as TEI), ``GET /info``, ``/health`` (and ``/ping``, ``GET /``),
``/metrics``. ``POST /`` answers as the Hugging Face Inference API does for the model's task
(text-classification, feature-extraction, sentence-similarity), which is what
``huggingface_hub.InferenceClient(model=url)`` posts to and reads. With ``grpc_port`` set, TEI's gRPC
services run beside it on the same event loop and batcher (:mod:`flaxheads.serve.tei_grpc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flaxheads.predict import Classifier
from flaxheads.serve.answers import (
    classification_body,
    cosine,
    embed_body,
    embeddings,
    encode_vectors,
    openai_body,
    predict_body,
    rerank_body,
)
from flaxheads.serve.batcher import Batcher
from flaxheads.serve.metrics import Metrics
from flaxheads.serve.payloads import (
    BACKEND,
    UNHEALTHY,
    PayloadError,
    bool_field,
    classification_parameters,
    dimensions_field,
    embed_inputs,
    encoding_field,
    ids_field,
    json_object,
    object_field,
    predict_inputs,
    prompt_name_field,
    similarity_inputs,
    text_value,
    texts_field,
    tokenize_inputs,
    truncation_side,
)
from flaxheads.serve.service import INLINE_TEXTS, ROUTES, ClientGone, Service

#: Seconds the gRPC calls in flight get to finish when the server stops.
GRPC_GRACE_S = 30


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """Limits and batching of a server (TEI's defaults where TEI has the setting)."""

    max_batch_tokens: int = 16384  # padded tokens per batch
    max_batch_size: int = 32  # texts per batch
    max_wait_ms: float = 2.0  # how long the oldest queued text waits for a fuller batch
    max_queue: int = 1024  # texts queued at most; beyond it 429 + Retry-After
    max_client_batch_size: int = 32  # inputs per request; beyond it 413
    max_body_bytes: int = 2_000_000  # request body; beyond it 413
    retry_after_s: int = 1
    devices: int | None = None  # local devices a batch is split over (None: all of them)
    auto_truncate: bool = False  # what "truncate" means when a request leaves it out (and on /v1/embeddings)
    grpc_port: int | None = None  # TEI's gRPC services on this port too (0: a free one); None: HTTP only
    grpc_host: str = "127.0.0.1"


def create_app(
    clf: Classifier,
    settings: ServeSettings | None = None,
    *,
    warm_up: bool = True,
    on_ready: Callable[[Batcher], None] | None = None,
) -> Starlette:
    """An ASGI app serving ``clf``. On startup it compiles every batch shape (``warm_up``), starts
    the batcher (and the gRPC server with ``settings.grpc_port``), then calls ``on_ready``; on
    shutdown it answers what is queued, then stops."""
    settings = settings or ServeSettings()
    batcher = Batcher(
        clf,
        max_batch_tokens=settings.max_batch_tokens,
        max_batch_size=settings.max_batch_size,
        max_wait_s=settings.max_wait_ms / 1000.0,
        max_queue=settings.max_queue,
        devices=None if settings.devices is None else jax.local_devices()[: settings.devices],
    )
    metrics = Metrics(lambda: batcher.queued, lambda: batcher.compiles)
    batcher.observe = metrics.observe_batch
    service = Service(clf, settings, batcher, metrics)
    state: dict[str, Any] = {"ready": False, "grpc": None}
    most = settings.max_client_batch_size

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if warm_up:
            await asyncio.to_thread(batcher.warm_up)
        batcher.start()
        if settings.grpc_port is not None:
            from flaxheads.serve.tei_grpc import start_grpc

            state["grpc"], app.state.grpc_port = await start_grpc(service, settings.grpc_host, settings.grpc_port)
        state["ready"] = True
        if on_ready is not None:
            on_ready(batcher)
        try:
            yield
        finally:
            state["ready"] = False
            if state["grpc"] is not None:
                await state["grpc"].stop(GRPC_GRACE_S)
            await asyncio.to_thread(batcher.close)

    def gone(request: Request):
        return lambda: _disconnected(request)

    def truncate(body: dict, where: str = "") -> bool:
        return bool_field(body, "truncate", settings.auto_truncate, where)

    async def predict(request: Request, body: dict) -> Any:
        service.need("/predict", "classifier", "reranker")
        inputs, single = predict_inputs(body, max_texts=most)
        raw = bool_field(body, "raw_scores", False)
        logits, _ = await service.predict(
            inputs, truncate=truncate(body), side=truncation_side(body), gone=gone(request)
        )
        rows = predict_body(clf, logits, raw_scores=raw)
        return rows[0] if single else rows

    async def rerank(request: Request, body: dict) -> Any:
        service.need("/rerank", "reranker")
        query = text_value(body.get("query"), "query")
        texts = texts_field(body, "texts", max_texts=most)
        raw, return_text = bool_field(body, "raw_scores", False), bool_field(body, "return_text", False)
        scores, _ = await service.rerank(
            query, texts, truncate=truncate(body), side=truncation_side(body), gone=gone(request)
        )
        return rerank_body(scores, texts, raw_scores=raw, return_text=return_text)

    async def embed(request: Request, body: dict) -> Any:
        service.need("/embed", "embedding")
        inputs, _ = embed_inputs(body, max_texts=most)
        dims, encoding = dimensions_field(body, clf.model.num_labels), encoding_field(body)
        normalize = bool_field(body, "normalize", True)
        emb, _ = await service.embed(
            inputs,
            truncate=truncate(body),
            side=truncation_side(body),
            prompt_name=prompt_name_field(body),
            gone=gone(request),
        )
        return embed_body(
            emb, normalize=normalize, dimensions=dims, encoding=encoding, model_normalizes=service.model_normalizes
        )

    async def embed_all(request: Request, body: dict) -> Any:
        service.need("/embed_all", "embedding")
        inputs, _ = embed_inputs(body, max_texts=most)
        outs, _ = await service.embed_all(
            inputs, truncate=truncate(body), side=truncation_side(body), prompt_name=prompt_name_field(body)
        )
        return [o.tolist() for o in outs]

    async def embed_sparse(request: Request, body: dict) -> Any:
        raise PayloadError(
            424,
            f"/embed_sparse: flaxheads has no sparse (SPLADE) head, so no model it serves gives "
            f"sparse embeddings; this model is a {service.kind}: use {ROUTES[service.kind]}",
            BACKEND,
        )

    async def similarity(request: Request, body: dict) -> Any:
        service.need("/similarity", "embedding")
        source, sentences = similarity_inputs(body.get("inputs"), max_texts=most)
        params = object_field(body, "parameters")
        emb, _ = await service.similarity(
            source,
            sentences,
            truncate=truncate(params, "parameters."),
            side=truncation_side(params, "parameters."),
            prompt_name=prompt_name_field(params, "parameters."),
            gone=gone(request),
        )
        return cosine(emb[0], emb[1:])

    async def tokenize(request: Request, body: dict) -> Any:
        texts = tokenize_inputs(body, max_texts=most)
        special, name = bool_field(body, "add_special_tokens", True), prompt_name_field(body)
        work = lambda: service.tokenize(texts, add_special_tokens=special, prompt_name=name)  # noqa: E731
        return work() if len(texts) <= INLINE_TEXTS else await asyncio.to_thread(work)

    async def decode(request: Request, body: dict) -> Any:
        ids = ids_field(body, max_texts=most)
        return service.decode(ids, skip_special_tokens=bool_field(body, "skip_special_tokens", True))

    async def openai_embed(request: Request, body: dict) -> Any:
        service.need("/v1/embeddings", "embedding")
        inputs, _ = embed_inputs(body, "input", max_texts=most)
        for name in ("model", "user"):
            if body.get(name) is not None and not isinstance(body[name], str):
                raise PayloadError(422, f"{name}: expected a string or null, got {type(body[name]).__name__}")
        dims, encoding = dimensions_field(body, clf.model.num_labels), encoding_field(body)
        emb, usage = await service.embed(
            inputs, truncate=settings.auto_truncate, route="/v1/embeddings", gone=gone(request)
        )
        vectors = encode_vectors(
            embeddings(emb, normalize=True, dimensions=dims, model_normalizes=service.model_normalizes), encoding
        )
        return openai_body(vectors, model=clf.source, tokens=usage.tokens)

    async def inference_api(request: Request, body: dict) -> Any:
        """``POST /``: the Inference API's answer for the model's task."""
        if service.kind == "embedding":
            if isinstance(body.get("inputs"), dict):  # sentence-similarity
                return await similarity(request, body)
            return await embed(request, {**object_field(body, "parameters"), **body})  # feature-extraction
        if service.kind == "reranker" and "query" in body:
            return await rerank(request, body)
        inputs, _ = predict_inputs(body, max_texts=most)  # text-classification: a list per input, always
        top_k, function = classification_parameters(body, clf.model.num_labels)
        raw = bool_field(body, "raw_scores", False)
        logits, _ = await service.predict(
            inputs, truncate=truncate(body), side=truncation_side(body), route="/", gone=gone(request)
        )
        return classification_body(clf, logits, top_k=top_k, function=function, raw_scores=raw)

    def post(route: str, handler, openai: bool = False) -> Route:
        async def endpoint(request: Request) -> Response:
            started = time.perf_counter()
            try:
                result = await handler(request, json_object(await _body(request, settings.max_body_bytes)))
                response: Response = JSONResponse(result)
            except PayloadError as e:
                headers = {"Retry-After": str(settings.retry_after_s)} if e.status in (429, 503) else None
                response = JSONResponse(e.openai_body() if openai else e.body(), status_code=e.status, headers=headers)
            except ClientGone:
                response = Response(status_code=499)  # nobody reads it; counted as such
            metrics.requests.labels(route, str(response.status_code)).inc()
            metrics.latency.labels(route).observe(time.perf_counter() - started)
            return response

        return Route(route, endpoint, methods=["POST"])

    async def health(request: Request) -> Response:
        if state["ready"]:
            return JSONResponse({"status": "ok"})
        return JSONResponse(
            PayloadError(503, "unhealthy: the server is starting up or shutting down", UNHEALTHY).body(),
            status_code=503,
        )

    async def info(request: Request) -> Response:
        return JSONResponse(service.info())

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.text(), media_type=metrics.content_type)

    routes = [
        post("/predict", predict),
        post("/rerank", rerank),
        post("/embed", embed),
        post("/embed_all", embed_all),
        post("/embed_sparse", embed_sparse),
        post("/similarity", similarity),
        post("/tokenize", tokenize),
        post("/decode", decode),
        post("/v1/embeddings", openai_embed, True),
        post("/embeddings", openai_embed, True),
        post("/", inference_api),
        Route("/health", health),
        Route("/ping", health),
        Route("/", health, methods=["GET"]),
        Route("/info", info),
        Route("/metrics", metrics_route),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.batcher, app.state.metrics, app.state.classifier = batcher, metrics, clf
    app.state.service, app.state.grpc_port = service, None
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
