"""Load on loopback: `flaxheads serve` against transformers' text-classification pipeline behind
the same ASGI stack (Starlette + uvicorn, the same TEI /predict payload), each in its own process
on 127.0.0.1, driven by one client process (plain asyncio keep-alive connections) at each
concurrency. Both serve the same folder: all-MiniLM-L6-v2 with a random 4-label BERT head,
exported as a transformers classifier.

Per server and concurrency: requests/s, p50 / p99 latency, and the checks: every request
answered exactly once (none lost, none twice), each answer the one its own text gets alone
(label and score within 1e-5 of the concurrency-1 answer). Then flaxheads alone over
--memory-requests requests at the highest concurrency: its resident memory before and after,
and the programs compiled after warm-up (from /info). Counts and time are bounded per level.

  python bench/serve_load.py                       # 1, 8, 64 concurrent; 1000 requests each
  python bench/serve_load.py --requests 200 --memory-requests 0 --concurrency 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import common  # noqa: E402

#: Sentences of news-like lengths (8-40 tokens), cycled through by the requests.
TEXTS = [
    "Shares in the bank fell sharply after it reported weaker profits for the third quarter.",
    "The striker scored twice as the home side won the cup final.",
    "A new phone with a folding screen goes on sale next month.",
    "The minister said the election would be held in the spring.",
    "Critics praised the film's quiet performances and its score.",
    "Oil prices rose on fears of lower supply from the region, while the dollar weakened against the euro.",
    "The coach was sacked after a run of six defeats.",
    "Broadband speeds in rural areas are still far behind those in cities, a report found.",
    "Voters go to the polls on Thursday.",
    "The band's new album went straight to number one.",
    "Inflation slowed for a second month as fuel and food prices eased, official figures showed on Wednesday.",
    "Hackers stole millions of passwords from the games site.",
]


def pipeline_app(folder: str, max_length: int, threads: int | None = None):
    """The reference: transformers' pipeline called per request (one at a time: concurrent
    PyTorch forwards on the same cores only oversubscribe them), TEI's /predict answer."""
    import torch
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from transformers import pipeline

    if threads:
        torch.set_num_threads(threads)
    pipe = pipeline("text-classification", model=folder, tokenizer=folder, top_k=None, device="cpu")
    lock = threading.Lock()

    def run(texts):
        with lock, torch.inference_mode():
            return pipe(texts, truncation=True, max_length=max_length)

    async def predict(request):
        body = await request.json()
        single = isinstance(body["inputs"], str)
        out = await run_in_threadpool(run, [body["inputs"]] if single else body["inputs"])
        rows = [
            sorted(({"score": float(d["score"]), "label": d["label"]} for d in r), key=lambda d: -d["score"])
            for r in out
        ]
        return JSONResponse(rows[0] if single else rows)

    return Starlette(routes=[Route("/predict", predict, methods=["POST"])])


def launch(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)


def wait_ready(proc: subprocess.Popen) -> str:
    """The URL of a server process, once it prints ``serving ... on http://...``; then its
    stderr keeps being read (a full pipe would stop it)."""
    for line in proc.stderr:
        if "serving" in line and "http://" in line:
            proc.tail = collections.deque(maxlen=20)  # what it says last, shown if it dies during the run
            threading.Thread(target=lambda: proc.tail.extend(proc.stderr), daemon=True).start()
            return "http://" + line.split("http://")[1].split()[0]
    proc.kill()
    raise RuntimeError(f"{proc.args[:4]} exited before it served")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


class Connection:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads the answer (by its
    Content-Length). The load is made with this rather than httpx: with 64 connections httpx's
    pool costs the client process more CPU than the servers' own work on a 2-core machine, and
    the client's delays then read as server latency. httpx is what the tests drive the server with."""

    def __init__(self, url: str):
        self.host, self.port = url.split("//")[1].split(":")
        self.reader = self.writer = None

    async def post(self, path: str, payload: dict) -> tuple[int, object]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
        body = json.dumps(payload).encode()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body)
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next(int(x.split(":", 1)[1]) for x in lines[1:] if x.lower().startswith("content-length:"))
        return status, json.loads(await self.reader.readexactly(length))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def load(
    url: str,
    texts: list[str],
    concurrency: int,
    requests: int,
    time_limit: float,
    expected: dict[int, list] | None = None,
) -> dict:
    """``requests`` POST /predict (text ``i % len(texts)``) from ``concurrency`` connections,
    stopping early at ``time_limit`` seconds; latency per request and the exactly-once /
    same-answer checks."""
    answers: dict[int, list] = {}
    latency, failed, seen_twice = [], 0, 0
    next_id = iter(range(requests))
    deadline = time.perf_counter() + time_limit

    async def worker():
        nonlocal failed, seen_twice
        conn = Connection(url)
        try:
            for i in next_id:
                if time.perf_counter() > deadline:
                    return
                t0 = time.perf_counter()
                status, answer = await conn.post("/predict", {"inputs": texts[i % len(texts)], "truncate": True})
                latency.append(time.perf_counter() - t0)
                if status != 200:
                    failed += 1
                    continue
                seen_twice += i in answers
                answers[i] = answer
        finally:
            conn.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    sent = len(latency)
    wrong = 0
    for i, a in answers.items():
        ref = (expected or {}).get(i % len(texts))
        if ref is not None and (a[0]["label"] != ref[0]["label"] or abs(a[0]["score"] - ref[0]["score"]) > 1e-5):
            wrong += 1
    lat = sorted(latency) or [float("nan")]
    return {
        "sent": sent,
        "answered": len(answers),
        "failed": failed,
        "duplicated": seen_twice,
        "wrong": wrong,
        "rps": sent / wall,
        "p50_ms": 1e3 * lat[len(lat) // 2],
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "answers": answers,
    }


def model_folder(tmp: str) -> str:
    import flaxheads as fh

    model = fh.from_pretrained(common.minilm_path(), num_labels=4, seed=0)
    return str(fh.export(model, os.path.join(tmp, "classifier")))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,64")
    ap.add_argument("--requests", type=int, default=1000, help="requests per server and concurrency")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per server and concurrency at most")
    ap.add_argument("--memory-requests", type=int, default=10000, help="flaxheads alone, at the top concurrency")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--systems", default="flaxheads,pipeline")
    ap.add_argument("--torch-threads", type=int, default=0, help="the pipeline's torch threads (default: torch's)")
    ap.add_argument("--pipeline-server", default=None, help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.pipeline_server:
        from flaxheads.serve import bind, run

        sock = bind("127.0.0.1", 0)
        app = pipeline_app(args.pipeline_server, args.max_length, args.torch_threads)
        print(f"serving pipeline on http://127.0.0.1:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
        return run(app, sock)

    folder = model_folder(tempfile.mkdtemp(prefix="bench-serve-"))
    commands = {
        "flaxheads": [
            sys.executable,
            "-m",
            "flaxheads",
            "serve",
            folder,
            "--port",
            "0",
            "--max-length",
            str(args.max_length),
        ],
        "pipeline": [
            sys.executable,
            os.path.abspath(__file__),
            "--pipeline-server",
            folder,
            "--max-length",
            str(args.max_length),
            "--torch-threads",
            str(args.torch_threads),
        ],
    }
    levels = [int(x) for x in args.concurrency.split(",")]
    print(common.environment())
    print(f"load average before: {os.getloadavg()}; {len(TEXTS)} texts cycled, max length {args.max_length}\n")
    print("| server | concurrency | requests | req/s | p50 ms | p99 ms | failed | lost | duplicated | wrong |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    procs = {name: launch(commands[name]) for name in args.systems.split(",")}  # both warm up at once
    try:
        servers = {name: (proc, wait_ready(proc)) for name, proc in procs.items()}
        expected = {}
        for name, (_, url) in servers.items():  # each text alone, once: the answer every later one must equal
            expected[name] = asyncio.run(load(url, TEXTS, 1, len(TEXTS), 600))["answers"]
        for c in levels:
            for name, (_, url) in servers.items():
                r = asyncio.run(load(url, TEXTS, c, args.requests, args.time_limit, expected[name]))
                print(
                    f"| {name} | {c} | {r['sent']} | {r['rps']:.1f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                    f"{r['failed']} | {r['sent'] - r['answered'] - r['failed']} | {r['duplicated']} | "
                    f"{r['wrong']} |",
                    flush=True,
                )
        if args.memory_requests and "flaxheads" in servers:
            proc, url = servers["flaxheads"]
            before = rss_mib(proc.pid)
            r = asyncio.run(load(url, TEXTS, levels[-1], args.memory_requests, 3600, expected["flaxheads"]))
            after = rss_mib(proc.pid)
            print(
                f"\nflaxheads over {r['sent']} requests at concurrency {levels[-1]}: RSS {before:.0f} -> "
                f"{after:.0f} MiB; {r['rps']:.1f} req/s; failed {r['failed']}, wrong {r['wrong']}, lost "
                f"{r['sent'] - r['answered'] - r['failed']}"
            )
        if "flaxheads" in servers:
            import httpx

            info = httpx.get(servers["flaxheads"][1] + "/info").json()
            metrics = dict(
                line.rsplit(" ", 1)
                for line in httpx.get(servers["flaxheads"][1] + "/metrics").text.splitlines()
                if line.startswith("flaxheads_") and not line.startswith("#")
            )
            server_ms = (
                1e3
                * float(metrics['flaxheads_request_duration_seconds_sum{route="/predict"}'])
                / float(metrics['flaxheads_request_duration_seconds_count{route="/predict"}'])
            )
            queue_ms = (
                1e3
                * float(metrics["flaxheads_queue_duration_seconds_sum"])
                / float(metrics["flaxheads_queue_duration_seconds_count"])
            )
            batch_ms = (
                1e3
                * float(metrics["flaxheads_batch_duration_seconds_sum"])
                / float(metrics["flaxheads_batch_duration_seconds_count"])
            )
            print(
                f"flaxheads, all levels: mean {server_ms:.1f} ms in the server per request, of which {queue_ms:.1f} "
                f"queued; mean forward {batch_ms:.1f} ms per batch"
            )
            print(
                f"flaxheads programs: {info['compiled_programs']} now, {info['compiled_at_warm_up']} after "
                f"warm-up ({len(info['batch_shapes'])} batch shapes); texts per batch over the run: "
                f"{float(metrics['flaxheads_batch_size_sum']) / float(metrics['flaxheads_batch_size_count']):.1f}"
            )
        print(f"load average after: {os.getloadavg()}")
    finally:
        for name, proc in procs.items():
            if proc.poll() is not None:
                print(
                    f"{name} server exited with {proc.returncode}; its last lines:\n"
                    + "".join(getattr(proc, "tail", [])),
                    file=sys.stderr,
                )
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
