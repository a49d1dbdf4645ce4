"""Serving a model with text-embeddings-inference's API (``flaxheads serve``): :func:`create_app`
(a Starlette app on a :class:`~flaxheads.predict.Classifier`, with TEI's gRPC services beside it
when asked), the :class:`Batcher` that batches concurrent requests, and :func:`run` (uvicorn).

Needs the ``serve`` extra: ``pip install "flaxheads[serve]"``.
"""

from flaxheads.serve.app import ServeSettings, create_app
from flaxheads.serve.batcher import Batcher, Shapes
from flaxheads.serve.server import bind, run

__all__ = ["Batcher", "ServeSettings", "Shapes", "bind", "create_app", "run"]
