"""``flaxheads serve``: a model behind an HTTP server with text-embeddings-inference's API
(``/predict``, ``/rerank``, ``/embed``, ``/embed_all``, ``/similarity``, ``/tokenize``, ``/decode``,
``/v1/embeddings``, ``/health``, ``/info``, ``/metrics``; ``POST /`` as the Hugging Face Inference
API), and TEI's gRPC services with ``--grpc-port``. The flags go to :mod:`flaxheads.serve`; SOURCE
is anything ``flaxheads predict`` takes.

Examples:
  flaxheads serve runs/news --port 8080
  curl 127.0.0.1:8080/predict -H 'Content-Type: application/json' -d '{"inputs": "Shares fell"}'
  flaxheads serve sentence-transformers/all-MiniLM-L6-v2 --port 8080 --grpc-port 9000
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
import time

from flaxheads.cli import flags
from flaxheads.cli.flags import Program
from flaxheads.cli.predict import load_classifier
from flaxheads.errors import UsageError


def run_serve(args: argparse.Namespace, program: Program | None = None) -> int:
    try:
        from flaxheads import serve
    except ImportError as e:
        raise UsageError(
            f"flaxheads serve needs the serve extra ({e.name} is missing): pip install 'flaxheads[serve]'"
        ) from None
    try:  # before the model loads: a taken port is a one-line error, not minutes later
        sock = serve.bind(args.host, args.port)
    except OSError as e:
        hint = "choose another --port" if e.errno == errno.EADDRINUSE else "check --host"
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror}; {hint}") from None
    if args.grpc_port is not None:
        try:
            for module in ("grpc", "google.protobuf"):
                importlib.import_module(module)
        except ImportError as e:
            raise UsageError(
                f"--grpc-port needs grpcio and protobuf ({e.name} is missing): pip install 'flaxheads[serve]'"
            ) from None
        if args.grpc_port:
            try:  # the same early check for the gRPC port (the gRPC server binds it once the model is warm)
                serve.bind(args.host, args.grpc_port).close()
            except OSError as e:
                hint = "choose another --grpc-port" if e.errno == errno.EADDRINUSE else "check --host"
                raise UsageError(f"cannot listen on {args.host}:{args.grpc_port}: {e.strerror}; {hint}") from None
    clf = load_classifier(args)
    clf.chat_template = flags.chat_template_wanted(args, clf, reward_model=False)  # /rerank and /predict pairs
    settings = serve.ServeSettings(
        max_batch_tokens=args.max_batch_tokens,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_queue=args.max_queue,
        max_client_batch_size=args.max_client_batch_size,
        auto_truncate=args.auto_truncate,
        grpc_port=args.grpc_port,
        grpc_host=args.host,
    )
    host, port = sock.getsockname()[:2]
    started = time.perf_counter()

    def ready(batcher) -> None:
        grpc = "" if app.state.grpc_port is None else f" and grpc://{host}:{app.state.grpc_port}"
        print(
            f"serving {args.source} on http://{host}:{port}{grpc} ({batcher.compiles} programs compiled in "
            f"{time.perf_counter() - started:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    app = serve.create_app(clf, settings, on_ready=ready)
    code = serve.run(app, sock, log_level=args.log_level)
    print("stopped: every request in flight was answered", file=sys.stderr, flush=True)
    return code


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """Register ``flaxheads serve``."""
    p = sub.add_parser(
        "serve",
        help="an HTTP server (text-embeddings-inference's API) with dynamic batching",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="what flaxheads predict takes: run folder, checkpoint folder, "
        "transformers or sentence-transformers folder, head export or PEFT adapter folder, or hub id",
    )
    p.add_argument("--step", type=flags.step_spec, default=None, help="a run's checkpoint: latest (default), best, N")
    p.add_argument("--backbone", default=None, help="backbone folder of a head export or PEFT adapter")
    p.add_argument(
        "--max-length",
        type=flags.positive_int,
        default=None,
        help="tokens per text (default: the run's --max-length, else the model's maximum)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    p.add_argument("--port", type=flags.non_negative_int, default=8080, help="default 8080; 0: a free port")
    p.add_argument("--max-batch-tokens", type=flags.positive_int, default=16384, help="padded tokens per batch")
    p.add_argument("--max-batch-size", type=flags.positive_int, default=32, help="texts per batch")
    p.add_argument(
        "--max-wait-ms",
        type=flags.non_negative_float,
        default=2.0,
        help="how long a queued text waits for a fuller batch (default 2)",
    )
    p.add_argument(
        "--max-queue",
        type=flags.positive_int,
        default=1024,
        help="texts queued at most; past it requests get 429 with Retry-After",
    )
    p.add_argument(
        "--max-client-batch-size", type=flags.positive_int, default=32, help="inputs per request; past it 413"
    )
    p.add_argument(
        "--auto-truncate",
        action="store_true",
        help='cut texts past the maximum length when a request does not say "truncate" (and on '
        "/v1/embeddings, which has no such field); without it they are refused with 413",
    )
    p.add_argument(
        "--grpc-port",
        type=flags.non_negative_int,
        default=None,
        help="also serve TEI's gRPC services (tei.proto) on this port of --host (0: a free one)",
    )
    flags.add_chat_template_flag(p, "off; on: /rerank's (query, text) and /predict's pairs of a reward model")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    p.set_defaults(func=run_serve)
