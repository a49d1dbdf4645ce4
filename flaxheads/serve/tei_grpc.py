"""text-embeddings-inference's gRPC services (``tei.proto``, package ``tei.v1``) beside the HTTP
routes: the same :class:`~flaxheads.serve.service.Service`, event loop and batcher, so a text sent
over gRPC batches with those sent over HTTP.

Services and methods as ``tei.proto`` v1.7.1 declares them: ``Info.Info``; ``Embed.Embed``,
``EmbedAll``, ``EmbedSparse`` and their ``...Stream`` forms; ``Predict.Predict``, ``PredictPair``
and their streams; ``Rerank.Rerank``, ``RerankStream``; ``Tokenize.Tokenize``, ``Decode`` and their
streams. A stream's requests run concurrently (a stream's worth of texts batches together) and
its answers come back in the order of its requests. Errors are gRPC statuses as TEI maps its
error types: ``Validation`` -> INVALID_ARGUMENT, ``Tokenizer`` and ``Backend`` (a service the
model's kind does not serve, an inference that failed) -> FAILED_PRECONDITION, ``Overloaded`` ->
RESOURCE_EXHAUSTED, ``Unhealthy`` -> UNAVAILABLE. Not offered: TEI's ``grpc.health.v1`` and
reflection services (they need packages besides grpcio).

Message classes come from the descriptor in :mod:`flaxheads.serve.tei_descriptor`, in a pool of
their own (a client's generated ``tei_pb2`` in the same process does not clash with them).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from flaxheads.serve.answers import embeddings, predict_body, rerank_body
from flaxheads.serve.payloads import BACKEND, OVERLOADED, TOKENIZER, UNHEALTHY, VALIDATION, PayloadError, text_value
from flaxheads.serve.service import ROUTES, Service, Usage

CODES = {
    VALIDATION: grpc.StatusCode.INVALID_ARGUMENT,
    TOKENIZER: grpc.StatusCode.FAILED_PRECONDITION,
    BACKEND: grpc.StatusCode.FAILED_PRECONDITION,
    OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UNHEALTHY: grpc.StatusCode.UNAVAILABLE,
}
MODEL_TYPES = {"embedding": 0, "classifier": 1, "reranker": 2}  # tei.v1.ModelType
SIDES = {0: "right", 1: "left"}  # tei.v1.TruncationDirection


@functools.lru_cache(maxsize=1)
def messages() -> dict[str, Any]:
    """``tei.v1``'s message classes by name."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from flaxheads.serve.tei_descriptor import FILE_DESCRIPTOR

    pool = descriptor_pool.DescriptorPool()
    proto = descriptor_pb2.FileDescriptorProto.FromString(FILE_DESCRIPTOR)
    pool.Add(proto)
    # GetMessageClass came with protobuf 4.22; MessageFactory.GetPrototype before it (removed in 5.x)
    make = getattr(message_factory, "GetMessageClass", None) or message_factory.MessageFactory(pool).GetPrototype
    return {m.name: make(pool.FindMessageTypeByName(f"{proto.package}.{m.name}")) for m in proto.message_type}


class TeiServicer:
    """The handlers of every ``tei.v1`` method, on ``service``."""

    def __init__(self, service: Service):
        self.s = service
        self.m = messages()
        self.parallel = max(1, int(service.settings.max_client_batch_size))  # stream requests in flight

    # ---- pieces -------------------------------------------------------------------------------
    def metadata(self, usage: Usage):
        return self.m["Metadata"](
            compute_chars=usage.chars,
            compute_tokens=usage.tokens,
            total_time_ns=usage.total_ns,
            tokenization_time_ns=usage.tokenization_ns,
            queue_time_ns=usage.queue_ns,
            inference_time_ns=usage.inference_ns,
        )

    @staticmethod
    def side(request) -> str:
        if request.truncation_direction not in SIDES:
            raise PayloadError(
                422,
                f"truncation_direction: {request.truncation_direction} is not a "
                "TruncationDirection (0: right, 1: left)",
            )
        return SIDES[request.truncation_direction]

    @staticmethod
    def prompt_name(request) -> str | None:
        return request.prompt_name if request.HasField("prompt_name") else None

    # ---- methods ------------------------------------------------------------------------------
    async def info(self, request, context):
        i = self.s.info()
        return self.m["InfoResponse"](
            version=i["version"],
            model_id=i["model_id"],
            model_dtype=i["model_dtype"],
            model_type=MODEL_TYPES[self.s.kind],
            max_concurrent_requests=i["max_concurrent_requests"],
            max_input_length=i["max_input_length"],
            max_batch_tokens=i["max_batch_tokens"],
            max_batch_requests=i["max_batch_requests"],
            max_client_batch_size=i["max_client_batch_size"],
            tokenization_workers=i["tokenization_workers"],
        )

    async def embed(self, request, context):
        text = text_value(request.inputs, "inputs")
        emb, usage = await self.s.embed(
            [text], truncate=request.truncate, side=self.side(request), prompt_name=self.prompt_name(request)
        )
        vec = embeddings(emb, normalize=request.normalize)[0]
        return self.m["EmbedResponse"](embeddings=vec.tolist(), metadata=self.metadata(usage))

    async def embed_all(self, request, context):
        text = text_value(request.inputs, "inputs")
        outs, usage = await self.s.embed_all(
            [text], truncate=request.truncate, side=self.side(request), prompt_name=self.prompt_name(request)
        )
        tokens = [self.m["TokenEmbedding"](embeddings=row.tolist()) for row in outs[0]]
        return self.m["EmbedAllResponse"](token_embeddings=tokens, metadata=self.metadata(usage))

    async def embed_sparse(self, request, context):
        raise PayloadError(
            424,
            "EmbedSparse: flaxheads has no sparse (SPLADE) head, so no model it serves gives "
            f"sparse embeddings; this model is a {self.s.kind}: use {ROUTES[self.s.kind]}",
            BACKEND,
        )

    async def _predict(self, text, request):
        logits, usage = await self.s.predict(
            [text], truncate=request.truncate, side=self.side(request), route="Predict"
        )
        rows = predict_body(self.s.clf, logits, raw_scores=request.raw_scores)[0]
        return self.m["PredictResponse"](
            predictions=[self.m["Prediction"](**p) for p in rows], metadata=self.metadata(usage)
        )

    async def predict(self, request, context):
        return await self._predict(text_value(request.inputs, "inputs"), request)

    async def predict_pair(self, request, context):
        texts = list(request.inputs)
        if len(texts) not in (1, 2):
            raise PayloadError(422, f"inputs: a single text or a pair of two, got {len(texts)} texts")
        texts = [text_value(t, f"inputs[{i}]") for i, t in enumerate(texts)]
        return await self._predict(texts[0] if len(texts) == 1 else (texts[0], texts[1]), request)

    async def rerank(self, request, context):
        query = text_value(request.query, "query")
        texts = [text_value(t, f"texts[{i}]") for i, t in enumerate(request.texts)]
        if not texts:
            raise PayloadError(422, "texts: the list is empty; send at least one text")
        if len(texts) > self.s.settings.max_client_batch_size:
            raise PayloadError(413, f"texts: {len(texts)} texts, the most is {self.s.settings.max_client_batch_size}")
        return await self._rerank(query, texts, request, request.raw_scores, request.return_text)

    async def _rerank(self, query, texts, request, raw_scores, return_text):
        scores, usage = await self.s.rerank(query, texts, truncate=request.truncate, side=self.side(request))
        ranks = [
            self.m["Rank"](**r) for r in rerank_body(scores, texts, raw_scores=raw_scores, return_text=return_text)
        ]
        return self.m["RerankResponse"](ranks=ranks, metadata=self.metadata(usage))

    async def rerank_stream(self, requests: AsyncIterator, context):
        """A stream of ``(query, text)`` requests ranked as one: ``raw_scores``, ``return_text``,
        ``truncate`` and ``truncation_direction`` are the first request's, as TEI reads them."""
        self.s.need("RerankStream", "reranker")
        items = [r async for r in requests]
        if not items:
            raise PayloadError(422, "the stream is empty; send at least one (query, text) request")
        texts = [text_value(r.text, f"[{i}].text") for i, r in enumerate(items)]
        queries = [text_value(r.query, f"[{i}].query") for i, r in enumerate(items)]
        first = items[0]
        scores, usage = await self.s.compute(
            list(zip(queries, texts)), truncate=first.truncate, side=self.side(first), name="texts"
        )
        ranks = [
            self.m["Rank"](**r)
            for r in rerank_body(scores[:, 0], texts, raw_scores=first.raw_scores, return_text=first.return_text)
        ]
        return self.m["RerankResponse"](ranks=ranks, metadata=self.metadata(usage))

    async def tokenize(self, request, context):
        text = text_value(request.inputs, "inputs")
        tokens = self.s.tokenize(
            [text], add_special_tokens=request.add_special_tokens, prompt_name=self.prompt_name(request)
        )[0]
        return self.m["EncodeResponse"](
            tokens=[self.m["SimpleToken"](**{k: v for k, v in t.items() if v is not None}) for t in tokens]
        )

    async def decode(self, request, context):
        ids = np.asarray(list(request.ids), np.int64)
        if not len(ids):
            raise PayloadError(422, "ids: the list is empty; send at least one token id")
        return self.m["DecodeResponse"](text=self.s.decode([ids], skip_special_tokens=request.skip_special_tokens)[0])

    # ---- streams ------------------------------------------------------------------------------
    def stream(self, one: Callable[[Any, Any], Awaitable[Any]]):
        """``one`` over a stream of requests: run concurrently (at most :attr:`parallel` at once),
        answered in the stream's order."""

        async def handler(requests: AsyncIterator, context):
            order: asyncio.Queue = asyncio.Queue()
            gate = asyncio.Semaphore(self.parallel)

            async def bounded(request):
                async with gate:
                    return await one(request, context)

            async def read():
                async for request in requests:
                    await order.put(asyncio.ensure_future(bounded(request)))
                await order.put(None)

            reader = asyncio.ensure_future(read())
            try:
                while (task := await order.get()) is not None:
                    yield await task
                await reader
            finally:
                reader.cancel()
                while not order.empty():
                    task = order.get_nowait()
                    if task is not None:
                        task.cancel()

        return handler

    def handlers(self) -> list:
        """The generic handlers of the five services, each call's errors as gRPC statuses."""
        uu, ss = grpc.unary_unary_rpc_method_handler, grpc.stream_stream_rpc_method_handler
        su = grpc.stream_unary_rpc_method_handler
        services = {
            "Info": {"Info": (uu, self.info, "InfoRequest", "InfoResponse")},
            "Embed": {
                "Embed": (uu, self.embed, "EmbedRequest", "EmbedResponse"),
                "EmbedStream": (ss, self.stream(self.embed), "EmbedRequest", "EmbedResponse"),
                "EmbedSparse": (uu, self.embed_sparse, "EmbedSparseRequest", "EmbedSparseResponse"),
                "EmbedSparseStream": (ss, self.stream(self.embed_sparse), "EmbedSparseRequest", "EmbedSparseResponse"),
                "EmbedAll": (uu, self.embed_all, "EmbedAllRequest", "EmbedAllResponse"),
                "EmbedAllStream": (ss, self.stream(self.embed_all), "EmbedAllRequest", "EmbedAllResponse"),
            },
            "Predict": {
                "Predict": (uu, self.predict, "PredictRequest", "PredictResponse"),
                "PredictPair": (uu, self.predict_pair, "PredictPairRequest", "PredictResponse"),
                "PredictStream": (ss, self.stream(self.predict), "PredictRequest", "PredictResponse"),
                "PredictPairStream": (ss, self.stream(self.predict_pair), "PredictPairRequest", "PredictResponse"),
            },
            "Rerank": {
                "Rerank": (uu, self.rerank, "RerankRequest", "RerankResponse"),
                "RerankStream": (su, self.rerank_stream, "RerankStreamRequest", "RerankResponse"),
            },
            "Tokenize": {
                "Tokenize": (uu, self.tokenize, "EncodeRequest", "EncodeResponse"),
                "TokenizeStream": (ss, self.stream(self.tokenize), "EncodeRequest", "EncodeResponse"),
                "Decode": (uu, self.decode, "DecodeRequest", "DecodeResponse"),
                "DecodeStream": (ss, self.stream(self.decode), "DecodeRequest", "DecodeResponse"),
            },
        }
        out = []
        for service, methods in services.items():
            table = {
                name: make(
                    self._guard(f"/tei.v1.{service}/{name}", fn, make is ss),
                    request_deserializer=self.m[req].FromString,
                    response_serializer=self.m[res].SerializeToString,
                )
                for name, (make, fn, req, res) in methods.items()
            }
            out.append(grpc.method_handlers_generic_handler(f"tei.v1.{service}", table))
        return out

    def _guard(self, route: str, fn, streaming: bool):
        """``fn`` with its :class:`PayloadError` as the call's status, and the call counted in /metrics."""
        metrics = self.s.metrics

        async def fail(context, e: PayloadError):
            metrics.requests.labels(route, CODES[e.error_type].name).inc()
            await context.abort(CODES[e.error_type], e.message)

        if streaming:

            async def gen(requests, context):
                try:
                    async for answer in fn(requests, context):
                        yield answer
                except PayloadError as e:
                    await fail(context, e)
                metrics.requests.labels(route, "OK").inc()

            return gen

        async def call(request, context):
            try:
                answer = await fn(request, context)
            except PayloadError as e:
                await fail(context, e)
            metrics.requests.labels(route, "OK").inc()
            return answer

        return call


async def start_grpc(service: Service, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A started ``grpc.aio`` server with TEI's services on ``host:port`` (0: a free port), on
    the running event loop; returns it and its port."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(TeiServicer(service).handlers())
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen for gRPC on {address}: {e}") from None
    await server.start()
    return server, bound
